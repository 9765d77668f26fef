"""The on-media page format shared by every persistent or remote store (NVMe, remote).

Each stored page carries a fixed 64-byte header::

    offset size field
    0      4    magic b"KVTP"
    4      2    format version (FORMAT_VERSION)
    6      2    flags (0)
    8      8    payload length in bytes
    16     8    xxh3-64 checksum of the payload
    24     16   page key
    40     16   namespace digest (xxh3-128 of the namespace label)
    56     4    xxh32 of bytes 0..55 (the header's own checksum)
    60     4    zero padding (checked: any other value is damage)

All integers little-endian. A store may place the header before or after the payload (the
NVMe store puts it after, so that payloads start 4 KiB-aligned); it must verify it, with
:func:`verify_page`, on every read. A page whose header or payload does not verify is a
miss, never served (design invariant 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import IntegrityError
from kvtier.keys import KEY_BYTES

MAGIC = b"KVTP"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_STRUCT = struct.Struct("<4sHHQQ16s16s")  # 56 bytes, then xxh32 and padding
_PADDING = bytes(HEADER_SIZE - _STRUCT.size - 4)


@dataclass(frozen=True)
class PageHeader:
    """A decoded page header."""

    version: int
    payload_len: int
    checksum: int
    key: bytes
    namespace_digest: bytes


BytesLike = np.ndarray | bytes | bytearray | memoryview


def _bytes_view(data: BytesLike) -> memoryview:
    """A flat byte view of ``data`` without copying."""
    view = data.data if isinstance(data, np.ndarray) else memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


#: Prefix of the label that stands for a namespace known only by its digest (a page whose
#: index row was rebuilt from its header): ``digest:`` + 32 hex digits. No namespace label
#: has this form (every label holds an ``@``).
DIGEST_LABEL_PREFIX = "digest:"


def digest_label(digest: bytes) -> str:
    """The label of a namespace known only by its 16-byte ``digest``."""
    return DIGEST_LABEL_PREFIX + bytes(digest).hex()


def namespace_digest(label: str) -> bytes:
    """16-byte digest of a namespace label (equal to ``Namespace.digest``); for a
    :func:`digest_label`, the digest it carries."""
    if label.startswith(DIGEST_LABEL_PREFIX) and len(label) == len(DIGEST_LABEL_PREFIX) + 32:
        try:
            return bytes.fromhex(label[len(DIGEST_LABEL_PREFIX) :])
        except ValueError:
            pass
    return xxhash.xxh3_128_digest(label.encode())


def payload_checksum(payload: BytesLike) -> int:
    """xxh3-64 of the payload bytes (no copy for contiguous arrays)."""
    return xxhash.xxh3_64_intdigest(_bytes_view(payload))


def encode_header(key: bytes, namespace_label: str, payload: BytesLike) -> bytes:
    """The 64-byte header for ``payload`` stored under ``key``."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
    body = _STRUCT.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        _bytes_view(payload).nbytes,
        payload_checksum(payload),
        bytes(key),
        namespace_digest(namespace_label),
    )
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body)) + bytes(4)


def decode_header(raw: BytesLike) -> PageHeader:
    """Parse and check a header; :class:`IntegrityError` names what is wrong."""
    data = bytes(_bytes_view(raw)[:HEADER_SIZE])
    if len(data) < HEADER_SIZE:
        raise IntegrityError(f"page header truncated: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, _flags, length, checksum, key, ns = _STRUCT.unpack_from(data)
    if magic != MAGIC:
        raise IntegrityError(f"bad page magic {magic!r}")
    (stored,) = struct.unpack_from("<I", data, _STRUCT.size)
    if xxhash.xxh32_intdigest(data[: _STRUCT.size]) != stored:
        raise IntegrityError("page header checksum mismatch")
    if data[_STRUCT.size + 4 :] != _PADDING:  # outside the header's checksum: zero, or damaged
        raise IntegrityError("page header padding (bytes 60-63) is not zero")
    if version > FORMAT_VERSION:
        raise IntegrityError(f"page format version {version} is newer than {FORMAT_VERSION}")
    return PageHeader(version, length, checksum, key, ns)


def verify_page(
    raw_header: BytesLike,
    key: bytes,
    payload: BytesLike,
) -> PageHeader:
    """Check a page read back: header intact, same key, same length, payload checksum.

    Returns the header; raises :class:`IntegrityError` describing the first mismatch.
    """
    header = decode_header(raw_header)
    if header.key != bytes(key):
        raise IntegrityError(f"page header holds key {header.key.hex()}, expected {key.hex()}")
    nbytes = _bytes_view(payload).nbytes
    if header.payload_len != nbytes:
        raise IntegrityError(f"page length {header.payload_len} in header, {nbytes} bytes expected")
    if payload_checksum(payload) != header.checksum:
        raise IntegrityError(f"payload checksum mismatch for page {key.hex()}")
    return header
