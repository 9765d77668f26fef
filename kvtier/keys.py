"""Content-addressed page keys.

``key(page i) = xxh3_128(key(page i-1) || namespace digest || token ids of page i)``,
with ``key(page -1)`` the 16 zero bytes. Token ids are hashed as little-endian uint32, so
a key depends only on the tokens, their position in the chain and the namespace: it is the
same in every process and on every machine (Python's ``hash()`` is never used). Equal keys
mean equal KV. Only full pages get keys; a trailing partial page is never shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType, cast

import numpy as np
import xxhash

from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec

#: A 16-byte (128-bit) page key.
PageKey = NewType("PageKey", bytes)

KEY_BYTES = 16
ROOT_KEY = PageKey(bytes(KEY_BYTES))

#: Version of the page layout and key scheme; part of every namespace.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class Namespace:
    """What keeps caches apart: KV from another namespace can never be returned.

    Attributes:
        model_id: model name, e.g. ``meta-llama/Llama-3.1-8B``.
        revision: weights revision (a commit hash or tag).
        kv_dtype: KV cache dtype.
        page_tokens: tokens per page.
        rank: parallel rank (tensor/pipeline shard) whose heads the pages hold.
        layout_version: page layout version (:data:`LAYOUT_VERSION`).
    """

    model_id: str
    revision: str = "main"
    kv_dtype: str = "bfloat16"
    page_tokens: int = 16
    rank: int = 0
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not self.model_id:
            raise KVTierUsageError("Namespace.model_id must be a non-empty string")
        if self.page_tokens <= 0:
            raise KVTierUsageError(f"Namespace.page_tokens must be > 0, got {self.page_tokens}")
        if self.rank < 0:
            raise KVTierUsageError(f"Namespace.rank must be >= 0, got {self.rank}")

    @classmethod
    def for_spec(
        cls, spec: KVSpec, model_id: str | None = None, revision: str = "main", rank: int = 0
    ) -> Namespace:
        """The namespace of a model geometry (model id defaults to the spec's name)."""
        return cls(model_id or spec.name, revision, spec.dtype, spec.page_tokens, rank)

    @property
    def label(self) -> str:
        """Human-readable form, stored beside pages for inspection."""
        return (
            f"{self.model_id}@{self.revision}/{self.kv_dtype}/p{self.page_tokens}"
            f"/r{self.rank}/v{self.layout_version}"
        )

    @property
    def digest(self) -> bytes:
        """16-byte fingerprint of every field; mixed into every key."""
        return xxhash.xxh3_128_digest(self.label.encode())


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate token ids and return them as a little-endian uint32 array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise KVTierUsageError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise KVTierUsageError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise KVTierUsageError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def page_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: Namespace,
    parent: PageKey = ROOT_KEY,
) -> list[PageKey]:
    """Keys of every *full* page of ``tokens`` (``namespace.page_tokens`` per page).

    ``parent`` is the key of the page before ``tokens[0]`` (the root for a sequence start),
    so a sequence can be hashed in pieces. A trailing partial page gets no key.
    """
    ids = _token_bytes(tokens)
    prev = bytes(parent)
    if len(prev) != KEY_BYTES:
        raise KVTierUsageError(f"parent key must be {KEY_BYTES} bytes, got {len(prev)}")
    n = namespace.page_tokens
    ns = namespace.digest
    full = len(ids) // n
    raw = ids[: full * n].tobytes()
    step = n * 4
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    append = keys.append
    for i in range(full):
        prev = digest(prev + ns + raw[i * step : (i + 1) * step])
        append(prev)
    return cast(list[PageKey], keys)  # PageKey is bytes; no per-key call in the loop


def key_hex(key: bytes) -> str:
    """Short printable form of a key (32 hex digits)."""
    return key.hex()
