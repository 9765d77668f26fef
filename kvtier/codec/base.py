"""The codec contract: how a page is encoded on its way down and decoded on its way up.

A :class:`Codec` turns one page (``page_bytes`` bytes of one model's KV, laid out as
:attr:`kvtier.spec.KVSpec.page_shape`) into fewer bytes and back. It is pure computation on
numpy buffers: no I/O, no state shared between calls other than read-only tables, safe to
call from several worker threads at once (the codec store runs it on its executor).

Rules every codec keeps (the codec store and the tests rely on them):

1. ``encode`` writes at most :meth:`Codec.max_encoded_bytes` bytes into ``out`` and returns
   how many; a *fixed-size* codec (:attr:`Codec.fixed_size`) always writes exactly that
   many. A lossless codec may return ``None`` when the page does not shrink: the store
   then keeps the page raw (flagged in its frame), so a lossless tier never holds more
   than a raw page's bytes.
2. ``encode`` raises :class:`CodecError` for a page it cannot represent (a lossy codec
   meeting a non-finite value): that page is not written to the tier (a ``False`` result).
3. ``decode`` fills all of ``out`` from exactly the bytes ``encode`` produced, or raises
   :class:`CodecError` when they cannot be decoded; it is called only on bytes whose
   length and checksum were verified first (:mod:`kvtier.codec.frame`).
4. A lossless codec (``lossy = False``) decodes to the very bytes it encoded. A lossy one
   declares ``lossy = True``: configuring it on a tier changes the cache's namespace (its
   KV dtype becomes ``float16~<representation>``), so its pages never mix with exact KV.
5. :attr:`Codec.identity` names everything decoding depends on (name, parameters that
   change the encoded layout, the page geometry it assumes); a page framed by a codec of
   another identity is a miss, never mis-decoded.

Codecs are found by name through the ``kvtier.codecs`` entry-point group
(:mod:`kvtier.codec.registry`), exactly like backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from kvtier.errors import ConfigError, KVTierError
from kvtier.spec import KVSpec


class CodecError(KVTierError):
    """A page cannot be encoded (lossy codec, non-finite values) or decoded (bad bytes)."""


class Codec(ABC):
    """Base of every page codec. See the module docstring for the contract.

    Subclasses take the model's :class:`~kvtier.spec.KVSpec` and their own keyword
    parameters (``codec_params`` in a tier's config), and reject unknown or bad
    parameters with :class:`~kvtier.errors.ConfigError` naming them.
    """

    #: The name used in config (``codec = "..."``).
    name: ClassVar[str]
    #: Whether decoded pages may differ from the pages encoded.
    lossy: ClassVar[bool] = False

    def __init__(self, spec: KVSpec, **params: Any) -> None:
        if params:
            raise ConfigError(
                f"codec {self.name!r}: unknown parameter(s) {', '.join(sorted(params))}"
            )
        self.spec = spec
        self.page_bytes = spec.page_bytes

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this codec cannot run here (a missing package), or ``None``. Never raises."""
        return None

    @property
    def identity(self) -> str:
        """Everything decoding depends on, as text (hashed into each page's frame)."""
        return self.name

    @property
    def representation(self) -> str:
        """For a lossy codec, what its decoded pages are (name and the parameters that
        change decoded values), as it enters the namespace's KV dtype: ``float16`` becomes
        ``float16~<representation>``. No ``/`` or ``@``, so labels stay readable."""
        return self.name

    @property
    def fixed_size(self) -> bool:
        """Whether every page encodes to exactly :meth:`max_encoded_bytes` bytes."""
        return False

    @abstractmethod
    def max_encoded_bytes(self) -> int:
        """The most bytes :meth:`encode` writes for one page."""

    @abstractmethod
    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        """Encode ``page`` (``page_bytes`` uint8) into ``out`` (at least
        :meth:`max_encoded_bytes` uint8); the bytes written, or ``None`` when a lossless
        codec finds no gain. Raises :class:`CodecError` for a page it cannot encode."""

    @abstractmethod
    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        """Decode ``data`` (exactly the encoded bytes) into ``out`` (``page_bytes``
        uint8). Raises :class:`CodecError` when ``data`` does not decode to one page."""

    def describe(self) -> dict[str, Any]:
        """Plain-data summary (for stats and inspection)."""
        return {
            "codec": self.name,
            "identity": self.identity,
            "lossy": self.lossy,
            "fixed_size": self.fixed_size,
            "max_encoded_bytes": self.max_encoded_bytes(),
            "page_bytes": self.page_bytes,
        }
