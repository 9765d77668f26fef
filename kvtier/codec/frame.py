"""The codec frame: a 32-byte header in front of every encoded page.

A codec-wrapped store (:class:`kvtier.codec.store.CodecStore`) hands its inner store one
blob per page: this frame followed by the encoded bytes. The inner store wraps the blob in
its own page header (:mod:`kvtier.pageformat`), whose checksum therefore covers the
encoded bytes; the frame records what decoding needs and checks it again, so a store that
verifies nothing still cannot feed a decoder bad bytes::

    offset size field
    0      4    magic b"KVCF"
    4      1    frame version (FRAME_VERSION)
    5      1    flags (FLAG_RAW: the page is stored as is, the codec found no gain)
    6      2    zero
    8      4    codec tag: xxh32 of the codec's identity
    12     4    encoded length in bytes (the bytes after the frame)
    16     8    xxh3-64 of the encoded bytes
    24     4    logical page length in bytes
    28     4    xxh32 of bytes 0..27 (the frame's own checksum)

Little-endian. :func:`verify_frame` checks the frame's checksum, version, codec tag and
page length, then the encoded length against the bytes actually there, then the encoded
bytes' checksum, and only then returns: no length it did not verify reaches a decoder.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import IntegrityError

FRAME_MAGIC = b"KVCF"
FRAME_VERSION = 1
FRAME_SIZE = 32
#: The page is stored unencoded (a lossless codec found no gain).
FLAG_RAW = 1
_KNOWN_FLAGS = FLAG_RAW
_BODY = struct.Struct("<4sBBHIIQI")  # 28 bytes, then the xxh32 of them
#: Longest page or encoded length a frame records.
MAX_LENGTH = 0xFFFFFFFF


@dataclass(frozen=True)
class Frame:
    """A verified frame: its flags and the encoded bytes (a view, no copy)."""

    flags: int
    encoded: np.ndarray

    @property
    def raw(self) -> bool:
        """Whether the page is stored unencoded."""
        return bool(self.flags & FLAG_RAW)


def codec_tag(identity: str) -> int:
    """The 32-bit tag of a codec identity (see :attr:`kvtier.codec.base.Codec.identity`)."""
    return xxhash.xxh32_intdigest(identity.encode())


def write_frame(out: np.ndarray, tag: int, flags: int, encoded_len: int, page_bytes: int) -> None:
    """Fill ``out[:FRAME_SIZE]`` with the frame of the ``encoded_len`` bytes that follow it
    in ``out`` (they must already be there: their checksum is computed here)."""
    if not 0 <= encoded_len <= MAX_LENGTH or not 0 < page_bytes <= MAX_LENGTH:
        raise ValueError(f"frame lengths out of range: {encoded_len}, {page_bytes}")
    payload = out[FRAME_SIZE : FRAME_SIZE + encoded_len]
    body = _BODY.pack(
        FRAME_MAGIC,
        FRAME_VERSION,
        flags,
        0,
        tag,
        encoded_len,
        xxhash.xxh3_64_intdigest(payload.data),
        page_bytes,
    )
    out[: _BODY.size] = np.frombuffer(body, dtype=np.uint8)
    out[_BODY.size : FRAME_SIZE] = np.frombuffer(
        struct.pack("<I", xxhash.xxh32_intdigest(body)), dtype=np.uint8
    )


def verify_frame(blob: np.ndarray, tag: int, page_bytes: int) -> Frame:
    """Check the frame at the start of ``blob`` (all the bytes the store returned) and
    return it; :class:`IntegrityError` names the first problem.

    ``tag`` and ``page_bytes`` are what this tier's codec expects: a page framed by another
    codec (a reconfigured tier, another server's settings) or for another page size is a
    mismatch, never decoded.
    """
    if blob.nbytes < FRAME_SIZE:
        raise IntegrityError(f"codec frame truncated: {blob.nbytes} of {FRAME_SIZE} bytes")
    body = blob[: _BODY.size].tobytes()
    magic, version, flags, zero, got_tag, length, checksum, raw_len = _BODY.unpack(body)
    if magic != FRAME_MAGIC:
        raise IntegrityError(f"bad codec frame magic {magic!r} (not a codec-encoded page)")
    (stored,) = struct.unpack("<I", blob[_BODY.size : FRAME_SIZE].tobytes())
    if xxhash.xxh32_intdigest(body) != stored:
        raise IntegrityError("codec frame checksum mismatch")
    if version != FRAME_VERSION or zero != 0 or flags & ~_KNOWN_FLAGS:
        raise IntegrityError(f"codec frame version {version} / flags {flags:#x} not understood")
    if got_tag != tag:
        raise IntegrityError(
            f"page was encoded by another codec (tag {got_tag:#010x}, this tier {tag:#010x})"
        )
    if raw_len != page_bytes:
        raise IntegrityError(f"codec frame is for {raw_len}-byte pages, expected {page_bytes}")
    room = blob.nbytes - FRAME_SIZE
    if length > room:
        raise IntegrityError(f"codec frame claims {length} encoded bytes, {room} are there")
    if flags & FLAG_RAW and length != page_bytes:
        raise IntegrityError(f"raw page of {length} bytes, expected {page_bytes}")
    encoded = blob[FRAME_SIZE : FRAME_SIZE + length]
    if xxhash.xxh3_64_intdigest(encoded.data) != checksum:
        raise IntegrityError("encoded page checksum mismatch")
    return Frame(flags, encoded)
