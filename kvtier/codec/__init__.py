"""Per-tier page codecs: fewer bytes per page below DRAM.

A tier's config names a codec (``codec = "zstd"``, ``codec_params = {level = 3}``); pages
are encoded on their way into that tier and decoded on their way out, off the event loop
and in batches. Built-ins: ``none`` (the default: no wrapper), ``zstd`` and ``lz4``
(lossless, with a byte-plane shuffle for 16/32-bit KV) and ``fp8-e4m3`` (lossy, per-head
scales; a tier using it changes the cache's namespace). Plugins add codecs through the
``kvtier.codecs`` entry-point group.

* :mod:`kvtier.codec.base`: the :class:`Codec` contract;
* :mod:`kvtier.codec.registry`: discovery and construction by name;
* :mod:`kvtier.codec.frame`: the per-page frame (codec tag, lengths, checksum);
* :mod:`kvtier.codec.store`: :class:`CodecStore`, a store wrapped by a codec;
* :mod:`kvtier.codec.tiers`: building a tier's backend with its codec.
"""

from kvtier.codec.base import Codec, CodecError
from kvtier.codec.registry import NO_CODEC, CodecInfo, discover, make_codec, resolve
from kvtier.codec.store import CodecStore, slot_bytes, tier_capacity_pages, wrap

__all__ = [
    "NO_CODEC",
    "Codec",
    "CodecError",
    "CodecInfo",
    "CodecStore",
    "discover",
    "make_codec",
    "resolve",
    "slot_bytes",
    "tier_capacity_pages",
    "wrap",
]
