"""Memory and copies of the DRAM arena (:mod:`kvtier.backends.dram`): available memory,
``mlock``, and batched copies split across threads."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import KVTierError
from kvtier.health import LogOnce

#: Below this many bytes per call, a copy runs on one thread (splitting costs more).
PARALLEL_COPY_MIN_BYTES = 8 << 20
#: Below this many bytes per call, the copy runs on the event loop itself: it takes less
#: time than the executor hop it would replace (measured 50-200 us per hop here, against
#: 60-150 us for a 1 MiB memcpy), so the loop is blocked no longer than the hop would
#: keep it busy, and small pages stop paying a hop per call.
INLINE_COPY_MAX_BYTES = 1 << 20
#: Smallest piece of a split copy.
MIN_PIECE_BYTES = 1 << 20

#: Causes already logged by DRAM arenas of this process (an mlock refusal is logged once).
LOGGED = LogOnce()

CopyPair = tuple[np.ndarray, np.ndarray]


class ArenaAllocationError(KVTierError):
    """The arena's memory cannot be had (more than the machine has available)."""


def available_memory() -> int | None:
    """Bytes of memory available for new allocations (``MemAvailable`` in
    ``/proc/meminfo``), or ``None`` where that cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def size_text(nbytes: int) -> str:
    from kvtier.units import format_size

    return format_size(nbytes)


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install must not break the CPU path
        return False


#: ``cudaHostRegisterPortable``: the registered memory counts as pinned for every GPU.
CUDA_HOST_REGISTER_PORTABLE = 1


def cuda_host_register(addr: int, length: int) -> str | None:
    """Page-lock ``length`` bytes at ``addr`` for CUDA (``cudaHostRegister``, portable),
    through torch's CUDA runtime; this faults every page in. ``None`` on success, else why
    it was refused (never raises)."""
    try:
        import torch

        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(addr, length, CUDA_HOST_REGISTER_PORTABLE)
        if int(err) == 0:
            return None
        why = cudart.cudaGetErrorString(err)
    except Exception as exc:  # no CUDA runtime, a torch without it: not pinned, not fatal
        return f"cudaHostRegister of {length} bytes failed: {exc!r}"
    return (
        f"cudaHostRegister of {length} bytes refused: {why} (error {int(err)}); check the "
        "locked-memory limit (ulimit -l; containers: --ulimit memlock=-1)"
    )


def cuda_host_unregister(addr: int) -> None:
    """Undo :func:`cuda_host_register` (``cudaHostUnregister``); errors are ignored: the
    memory stays valid either way."""
    with contextlib.suppress(Exception):
        import torch

        torch.cuda.cudart().cudaHostUnregister(addr)  # type: ignore[no-untyped-call]


def try_mlock(addr: int, length: int) -> str | None:
    """``mlock`` the range; ``None`` on success, else why it was refused."""
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError as exc:
        return f"cannot load libc: {exc}"
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.restype = ctypes.c_int
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) == 0:
        return None
    err = ctypes.get_errno()
    return f"mlock of {length} bytes refused: {errno.errorcode.get(err, err)} ({os.strerror(err)})"


def copy_pairs(pairs: Sequence[CopyPair]) -> None:
    """Copy ``src`` into ``dst`` for each pair (runs on a worker thread; numpy drops the
    GIL for the memcpy)."""
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")


def split_pairs(pairs: Sequence[CopyPair], parts: int) -> list[list[CopyPair]]:
    """Split a batch of copies into ``parts`` groups of about equal bytes, cutting pages
    into pieces where needed (a single 4 MiB page may go to several threads)."""
    total = sum(int(d.nbytes) for d, _ in pairs)
    target = max(MIN_PIECE_BYTES, -(-total // parts))
    groups: list[list[CopyPair]] = [[]]
    room = target
    for dst, src in pairs:
        start, end = 0, int(dst.nbytes)
        while start < end:
            take = min(room, end - start)
            groups[-1].append((dst[start : start + take], src[start : start + take]))
            start += take
            room -= take
            if room == 0:
                groups.append([])
                room = target
    return [g for g in groups if g]


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two page buffers are the very same bytes (so a copy is a no-op).

    Only views of one base array are compared by address (reading an address costs
    microseconds); buffers of different bases are taken as different, so the rare buffer
    that reaches the same bytes through another object is copied onto itself: harmless.
    """
    if a is b:
        return True
    base = a.base
    return bool(
        base is not None
        and base is b.base
        and a.ctypes.data == b.ctypes.data
        and a.nbytes == b.nbytes
    )
