"""The raw baseline of ``kvtier bench io`` for an arena in GPU memory (the ``hbm`` backend).

The plainest fast way to move the same bytes between the same host buffers and the same
device slots: one ``cudaMemcpyAsync`` per page (CuPy's ``MemoryPointer`` copy calls) on one
non-blocking stream, synchronised once at the end of each direction. No batching, no
events awaited from asyncio, no slot bookkeeping: what is left of kvtier's path after
those is the copy engine's own speed. The host buffers are the bench's own (pageable)
pages, so both sides pay the same staging cost.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.backend import ArenaBackend
from kvtier.bench.baseline_types import BaselineSample, IOProfile, IOTarget, no_options
from kvtier.errors import KVTierUsageError, TierIOError

METHOD = "cudaMemcpyAsync per page, one stream"


async def cuda_memcpy_baseline(target: IOTarget) -> BaselineSample:
    """Time host -> slot and slot -> host copies of ``target``'s pages in the arena's own
    device slots (the same bytes kvtier wrote, so the arena's content is unchanged).

    Raises :class:`KVTierUsageError` when the backend is not an arena with
    ``device_view(slot)`` (a CuPy array per slot), and :class:`TierIOError` when a page
    kvtier wrote is not in the arena.
    """
    backend = target.backend
    device_view = getattr(backend, "device_view", None)
    if not isinstance(backend, ArenaBackend) or not callable(device_view):
        raise KVTierUsageError(
            f"the CUDA memcpy baseline needs an arena with device_view(slot); "
            f"{target.backend_name!r} has none"
        )
    slots = [backend.slot_of(k) for k in target.keys]
    if any(s is None for s in slots):
        raise TierIOError("CUDA memcpy baseline: a page kvtier wrote is not in the arena")
    dsts = [device_view(s) for s in slots if s is not None]
    device = int(getattr(backend, "device", 0))
    return await asyncio.to_thread(_timed, device, dsts, target.pages, target.page_bytes)


def _timed(
    device: int, dsts: Sequence[Any], pages: Sequence[np.ndarray], page_bytes: int
) -> BaselineSample:
    import cupy

    outs = [np.ones(page_bytes, dtype=np.uint8) for _ in pages]  # pre-faulted
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        start = time.perf_counter()
        for dst, src in zip(dsts, pages, strict=True):
            dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), page_bytes, stream)
        stream.synchronize()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for src_dev, out in zip(dsts, outs, strict=True):
            src_dev.data.copy_to_host_async(ctypes.c_void_p(out.ctypes.data), page_bytes, stream)
        stream.synchronize()
        read_s = time.perf_counter() - start
    for out, page in zip(outs, pages, strict=True):
        if not np.array_equal(out, page):
            raise TierIOError("CUDA memcpy baseline read back different bytes")
    return BaselineSample(METHOD, write_s, read_s, len(dsts) * page_bytes)


CUDA_MEMCPY_PROFILE = IOProfile(no_options, cuda_memcpy_baseline, METHOD)
