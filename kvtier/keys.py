"""Content-addressed page keys.

``key(page i) = xxh3_128(key(page i-1) || namespace digest || token ids of page i)``,
with ``key(page -1)`` the 16 zero bytes. Token ids are hashed as little-endian uint32, so
a key depends only on the tokens, their position in the chain and the namespace: it is the
same in every process and on every machine (Python's ``hash()`` is never used). Equal keys
mean equal KV. Only full pages get keys; a trailing partial page is never shared.
"""

from __future__ import annotations

import itertools
import re
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

#: Version of the page layout and key scheme; part of every namespace, so keys of stores
#: written under another version are never asked for (a miss, never another model's KV).
#: Version 2: the namespace label escapes its separators (version 1 labels were
#: ambiguous). Version 3: a model shape given without a name is named after its geometry
#: (``tiny-L2H4D4``); version 2 kvtier before 2026-12-03 named it after its preset, so
#: its pages of a custom 512-byte shape sat under the ``tiny`` preset's keys.
LAYOUT_VERSION = 3

#: Bounds of the integer namespace fields (a 32-bit signed range: anything larger is a
#: mistake, not a rank or a page size).
_INT_LIMIT = 2**31
#: Characters escaped in every text field of a label: the escape character, the ``@``
#: that ends the model id, and control characters (so a label is printable and stores keep
#: it intact). The fields after the model id also escape ``/``, their separator; the model
#: id keeps its ``/`` (``meta-llama/Llama-3.1-8B``): it ends at the first ``@``.
_ESCAPED = frozenset("%@") | frozenset(chr(c) for c in [*range(0x20), 0x7F])
_ESCAPED_AFTER_MODEL = _ESCAPED | {"/"}
_LABEL_RE = re.compile(r"^([^@]+)@([^@/]*)/([^@/]+)/p([0-9]+)/r([0-9]+)/v([0-9]+)$")


def _escape(text: str, escaped: frozenset[str] = _ESCAPED_AFTER_MODEL) -> str:
    """``text`` with every character of ``escaped`` as ``%XX`` (its code point)."""
    return "".join(f"%{ord(c):02X}" if c in escaped else c for c in text)


def _unescape(text: str) -> str:
    return re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), text)


@dataclass(frozen=True)
class Namespace:
    """What keeps caches apart: KV from another namespace can never be returned.

    The :attr:`label` is an unambiguous encoding of every field (text fields are escaped,
    so no field can imitate a separator): different namespaces have different labels, hence
    different digests and different page keys (:meth:`from_label` inverts it).

    Attributes:
        model_id: model name, e.g. ``meta-llama/Llama-3.1-8B`` (non-empty).
        revision: weights revision (a commit hash or tag).
        kv_dtype: KV cache dtype (non-empty).
        page_tokens: tokens per page, in ``[1, 2**31)``.
        rank: parallel rank (tensor/pipeline shard) whose heads the pages hold, in
            ``[0, 2**31)``.
        layout_version: page layout version (:data:`LAYOUT_VERSION`), in ``[1, 2**31)``.

    Raises :class:`KVTierUsageError` naming a field of the wrong type or out of range.
    """

    model_id: str
    revision: str = "main"
    kv_dtype: str = "bfloat16"
    page_tokens: int = 16
    rank: int = 0
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise KVTierUsageError(
                    f"Namespace.{name} must be a non-empty string, got {value!r}"
                )
        if not isinstance(self.revision, str):
            raise KVTierUsageError(f"Namespace.revision must be a string, got {self.revision!r}")
        for name in ("model_id", "revision", "kv_dtype"):
            try:  # a lone surrogate (undecodable bytes from the environment) cannot be
                getattr(self, name).encode("utf-8")  # hashed: it failed at the first store
            except UnicodeEncodeError as exc:
                raise KVTierUsageError(
                    f"Namespace.{name} {getattr(self, name)!r} is not valid Unicode text "
                    f"({exc.reason} at {exc.start}): undecodable bytes?"
                ) from None
        for name, low in (("page_tokens", 1), ("rank", 0), ("layout_version", 1)):
            value = getattr(self, name)
            bad_type = isinstance(value, bool) or not isinstance(value, int)
            if bad_type or not low <= value < _INT_LIMIT:
                raise KVTierUsageError(
                    f"Namespace.{name} must be an integer in [{low}, 2**31), got {value!r}"
                )

    @classmethod
    def for_spec(
        cls, spec: KVSpec, model_id: str | None = None, revision: str = "main", rank: int = 0
    ) -> Namespace:
        """The namespace of a model geometry (model id defaults to the spec's name)."""
        return cls(model_id or spec.name, revision, spec.dtype, spec.page_tokens, rank)

    @classmethod
    def from_label(cls, label: str) -> Namespace:
        """The namespace whose :attr:`label` is ``label``; :class:`KVTierUsageError` when
        ``label`` is not one."""
        m = _LABEL_RE.match(label) if isinstance(label, str) else None
        if m is None:
            raise KVTierUsageError(f"{label!r} is not a namespace label")
        model, rev, dtype, pages, rank, version = m.groups()
        ns = cls(
            _unescape(model), _unescape(rev), _unescape(dtype), int(pages), int(rank), int(version)
        )
        if ns.label != label:  # e.g. "p012" or "%41": not the canonical form of any namespace
            raise KVTierUsageError(f"{label!r} is not a namespace label (not in canonical form)")
        return ns

    @property
    def label(self) -> str:
        """Unambiguous human-readable form, stored beside pages for inspection:
        ``model@revision/dtype/pN/rN/vN`` with ``%``, ``@`` and control characters of the
        text fields (and ``/`` after the model id) written as ``%XX``."""
        return (
            f"{_escape(self.model_id, _ESCAPED)}@{_escape(self.revision)}/{_escape(self.kv_dtype)}"
            f"/p{self.page_tokens}/r{self.rank}/v{self.layout_version}"
        )

    @property
    def digest(self) -> bytes:
        """16-byte fingerprint of every field (xxh3-128 of the unambiguous label); mixed
        into every key."""
        return xxhash.xxh3_128_digest(self.label.encode())


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate token ids and return them as a little-endian uint32 array;
    :class:`KVTierUsageError` naming what is wrong otherwise."""
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError):  # ragged nesting: numpy makes no array of it
        raise KVTierUsageError(
            "token ids must be a 1-D sequence of integers; numpy cannot make one array of "
            f"this {type(tokens).__name__} (nested sequences of different lengths?)"
        ) from None
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


class PrivateKeys:
    """Keys for private top-tier slots (working pages never committed: an engine's
    unverified KV, a partial page being filled): ``tag`` followed by a counter.

    A content key is a 128-bit hash, so a fixed 10-byte ``tag`` (starting with a byte such
    as 0xff) makes a collision with one negligible; distinct tags keep the private keys
    of different users (the sequence manager, the transformers integration) apart. Keys
    count up from 1 for the life of the process.
    """

    TAG_BYTES = 10

    def __init__(self, tag: bytes) -> None:
        if len(tag) != self.TAG_BYTES:
            raise KVTierUsageError(f"a private key tag is {self.TAG_BYTES} bytes, got {len(tag)}")
        self.tag = bytes(tag)
        self._counter = itertools.count(1)

    def next(self) -> PageKey:
        """A key never handed out before."""
        return PageKey(self.tag + next(self._counter).to_bytes(KEY_BYTES - self.TAG_BYTES, "big"))

    def take(self, n: int) -> list[PageKey]:
        """``n`` new keys."""
        return [self.next() for _ in range(n)]

    def owns(self, key: bytes) -> bool:
        """Whether ``key`` is one of this tag's keys."""
        return key[: self.TAG_BYTES] == self.tag
