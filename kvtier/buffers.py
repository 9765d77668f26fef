"""Checks of the page buffers and blobs a backend takes: each names what is wrong.

:func:`check_buffer` / :func:`check_buffers` for fixed-size pages (numpy uint8 arrays or
bytes-like objects, taken without a copy), :func:`check_blobs` for the variable-length
blobs of :meth:`~kvtier.backend.StoreBackend.write_blobs`. :mod:`kvtier.backend`
re-exports them, where backends have always imported them from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import KVTierUsageError

_UINT8 = np.dtype(np.uint8)


def check_buffer(buf: Any, page_bytes: int, what: str = "buffer") -> np.ndarray:
    """Return ``buf`` as a 1-D uint8 array of ``page_bytes`` bytes, or raise.

    Accepts numpy arrays and objects with the buffer protocol (bytes, memoryview) without
    copying. Raises :class:`KVTierUsageError` naming the shape, dtype or size that is wrong.
    """
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(memoryview(buf), dtype=np.uint8)
        except TypeError:
            raise KVTierUsageError(
                f"{what} must be a numpy uint8 array or a bytes-like object, "
                f"got {type(buf).__name__}"
            ) from None
        except BufferError as exc:  # a strided memoryview: numpy cannot wrap it
            raise KVTierUsageError(f"{what} must be C-contiguous ({exc})") from None
    if arr.dtype != np.uint8:
        raise KVTierUsageError(f"{what} must have dtype uint8, got {arr.dtype}")
    if arr.ndim != 1:
        raise KVTierUsageError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.nbytes != page_bytes:
        raise KVTierUsageError(f"{what} must hold {page_bytes} bytes (one page), got {arr.nbytes}")
    if not arr.flags.c_contiguous:
        raise KVTierUsageError(f"{what} must be C-contiguous")
    return arr


def check_buffers(
    bufs: Sequence[Any], count: int, page_bytes: int, writable: bool = False
) -> list[np.ndarray]:
    """Validate a batch of page buffers against the number of keys it goes with."""
    if len(bufs) != count:
        raise KVTierUsageError(f"got {len(bufs)} buffers for {count} keys")
    # Fast path for what callers pass almost always (pages of an arena or of a batch
    # array): no per-buffer label is formatted unless a buffer is wrong.
    out = [b if type(b) is np.ndarray and b.dtype is _UINT8 and b.ndim == 1
           and b.nbytes == page_bytes and b.flags.c_contiguous
           else check_buffer(b, page_bytes, f"buffer {i}") for i, b in enumerate(bufs)]  # fmt: skip
    if writable:
        for i, arr in enumerate(out):
            if not arr.flags.writeable:
                raise KVTierUsageError(f"buffer {i} must be writable to receive a page")
    return out


def check_blobs(blobs: Sequence[Any], count: int, max_bytes: int) -> list[np.ndarray]:
    """Validate a batch of variable-length blobs: 1-D C-contiguous uint8, 1 to
    ``max_bytes`` bytes each, one per key; :class:`KVTierUsageError` names the bad one."""
    if len(blobs) != count:
        raise KVTierUsageError(f"got {len(blobs)} blobs for {count} keys")
    out: list[np.ndarray] = []
    for i, blob in enumerate(blobs):
        try:
            n = blob.nbytes if isinstance(blob, np.ndarray) else memoryview(blob).nbytes
        except TypeError:
            raise KVTierUsageError(
                f"blob {i} must be a numpy uint8 array or a bytes-like object, "
                f"got {type(blob).__name__}"
            ) from None
        if not 1 <= n <= max_bytes:
            raise KVTierUsageError(f"blob {i} holds {n} bytes; a blob holds 1 to {max_bytes}")
        out.append(check_buffer(blob, n, f"blob {i}"))
    return out
