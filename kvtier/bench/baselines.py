"""Raw baselines for ``kvtier bench io``, pluggable per backend name.

A baseline measures the same bytes moved the plainest fast way on the *same* medium
kvtier just used: the arena's own slots (numpy memcpy; ``cudaMemcpyAsync`` for the ``hbm``
arena, :mod:`kvtier.bench.cuda_baseline`), the store's directory (fio, or
threaded ``O_DIRECT`` ``pwrite``/``pread``), the same server (the C client
``redis-benchmark`` when installed, and a bare ``redis.asyncio`` pipeline). Each backend
name maps to an :class:`IOProfile`: the backend options a bench run uses (a scratch
directory, a server it starts) and the baseline function. Backends without a registered
profile get a default by kind (arena -> memcpy, store -> disk).

Other modules refine these with :func:`register_profile`, for example a store with its
own engine registering a baseline that matches its queue depth::

    register_profile("nvme", IOProfile(options=..., baseline=..., description=...),
                     replace=True)

Plugin distributions register theirs through the entry-point group
:data:`PROFILE_ENTRY_POINT_GROUP` (``kvtier.bench_io_profiles``), named like the backend.
``bench io`` without ``--tier`` measures arenas and the stores that have a profile; a
store without one is skipped (its options are unknown), and measured with the disk
profile only when named.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvtier.backend import ArenaBackend, Backend, BackendKind
from kvtier.bench.baseline_types import (
    DISK_IODEPTH,
    DISK_JOBS,
    BaselineSample,
    IOProfile,
    IOTarget,
    directory_options,
    no_options,
    valkey_options,
)
from kvtier.bench.cuda_baseline import CUDA_MEMCPY_PROFILE
from kvtier.bench.disk_baseline import aligned_buffers, disk_baseline, fio_io

__all__ = [
    "CUDA_MEMCPY_PROFILE",
    "DISK_IODEPTH",
    "DISK_JOBS",
    "DISK_PROFILE",
    "MEMCPY_PROFILE",
    "PROFILE_ENTRY_POINT_GROUP",
    "REDIS_PROFILE",
    "BaselineSample",
    "IOProfile",
    "IOTarget",
    "aligned_buffers",
    "directory_options",
    "disk_baseline",
    "fio_io",
    "memcpy_baseline",
    "no_options",
    "profile_for",
    "redis_baseline",
    "redis_py_baseline",
    "register_profile",
    "registered_profile",
    "registered_profiles",
    "valkey_options",
]
from kvtier.errors import KVTierUsageError, TierIOError

# -- memcpy ------------------------------------------------------------------------------


def _copy_chunk(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for src, dst in pairs:
        np.copyto(dst, src)


def _timed_copies(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    threads: int,
    pool: concurrent.futures.ThreadPoolExecutor | None,
) -> float:
    """Seconds to copy every ``src -> dst`` pair, split over ``threads`` threads."""
    start = time.perf_counter()
    if threads <= 1 or pool is None:
        _copy_chunk(pairs)
    else:
        chunks = [pairs[i::threads] for i in range(threads)]
        for fut in [pool.submit(_copy_chunk, c) for c in chunks if c]:
            fut.result()
    return time.perf_counter() - start


def kvtier_call_threads(backend: Backend, call_pages: int, page_bytes: int, threads: int) -> int:
    """Threads kvtier's path copies one backend call of ``call_pages`` pages on: the
    backend's own answer (``copy_threads_for(nbytes)``: for ``dram`` one thread below
    8 MiB per call, else its I/O threads, at most one per core) when it has one, else
    ``threads`` (its copy threads)."""
    ask = getattr(backend, "copy_threads_for", None)
    if callable(ask):
        return max(1, int(ask(call_pages * page_bytes)))
    return max(1, threads)


def _kvtier_copy_threads(target: IOTarget) -> int:
    """:func:`kvtier_call_threads` of one call of ``batch_pages`` pages (or of every
    page, when there are fewer: a call never holds more)."""
    call_pages = min(target.batch_pages, len(target.keys))
    return kvtier_call_threads(target.backend, call_pages, target.page_bytes, target.threads)


async def _memcpy_pass(
    writes: list[tuple[np.ndarray, np.ndarray]],
    reads: list[tuple[np.ndarray, np.ndarray]],
    threads: int,
) -> tuple[float, float]:
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
    if pool is not None:  # start the threads now, not inside the timed copies
        barrier = threading.Barrier(threads)
        for fut in [pool.submit(barrier.wait) for _ in range(threads)]:
            fut.result()
    try:
        write_s = await asyncio.to_thread(_timed_copies, writes, threads, pool)
        read_s = await asyncio.to_thread(_timed_copies, reads, threads, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    return write_s, read_s


def _memcpy_name(threads: int) -> str:
    return f"numpy memcpy, {threads} thread{'s' if threads > 1 else ''}"


async def memcpy_baseline(target: IOTarget) -> BaselineSample:
    """numpy memcpy of the same bytes into and out of the arena's own slots.

    Writes copy each source page into the slot kvtier put it in (the same bytes, so the
    arena's content is unchanged); reads copy each slot into a pre-faulted buffer. The
    main figure uses as many threads as kvtier's path uses for one call of
    ``batch_pages`` pages (see :func:`_kvtier_copy_threads`); when that differs from
    ``target.threads`` (the arena's copy threads), a pass with those is reported beside
    it in ``others``. Stores (no slots) copy into separate pre-faulted buffers instead.
    """
    if isinstance(target.backend, ArenaBackend):
        slots = [target.backend.slot_of(k) for k in target.keys]
        if any(s is None for s in slots):
            raise TierIOError("memcpy baseline: a page kvtier wrote is not in the arena")
        dsts = [target.backend.view(s) for s in slots if s is not None]
    else:
        dsts = [np.ones(target.page_bytes, dtype=np.uint8) for _ in target.keys]
    outs = [np.ones(target.page_bytes, dtype=np.uint8) for _ in target.keys]
    writes = list(zip(target.pages, dsts, strict=True))
    reads = list(zip(dsts, outs, strict=True))
    used = min(_kvtier_copy_threads(target), len(dsts))
    write_s, read_s = await _memcpy_pass(writes, reads, used)
    others: dict[str, tuple[float, float]] = {}
    pool_threads = max(1, min(target.threads, len(dsts)))
    if pool_threads != used:
        others[_memcpy_name(pool_threads)] = await _memcpy_pass(writes, reads, pool_threads)
    nbytes = len(dsts) * target.page_bytes
    return BaselineSample(_memcpy_name(used), write_s, read_s, nbytes, others)


# -- remote --------------------------------------------------------------------------------


async def redis_baseline(target: IOTarget) -> BaselineSample:
    """The C client on the same server when ``redis-benchmark`` is installed
    (:func:`kvtier.bench.redis_c.c_client_sample`: as many values of the page size, best
    of two shapes), with the bare ``redis.asyncio`` loop of :func:`redis_py_baseline`
    beside it under ``others["redis.asyncio"]``; the ``redis.asyncio`` loop alone
    otherwise."""
    from kvtier.bench.redis_c import c_client_sample, redis_benchmark_path

    py = await redis_py_baseline(target)
    if redis_benchmark_path() is None:
        return py
    url = _redis_url(target)
    c = await c_client_sample(url, target.page_bytes, len(target.keys), target.batch_pages)
    return BaselineSample(
        c.method,
        c.write_seconds,
        c.read_seconds,
        len(target.keys) * target.page_bytes,
        {"redis.asyncio": (py.write_seconds, py.read_seconds)},
    )


def _redis_url(target: IOTarget) -> str:
    url = target.options.get("url")
    if not isinstance(url, str):
        raise KVTierUsageError(f"{target.backend_name}: the redis baseline needs a 'url' option")
    return url


async def redis_py_baseline(target: IOTarget) -> BaselineSample:
    """A bare ``redis.asyncio`` loop on the same server: SET then GET of the same values,
    pipelined ``batch_pages`` deep (no header, no checksum, no copy out)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(_redis_url(target))
    names = [b"kvtier-bench-raw:" + bytes(k) for k in target.keys]
    depth = max(1, target.batch_pages)
    try:
        start = time.perf_counter()
        for i in range(0, len(names), depth):
            pipe = client.pipeline(transaction=False)
            for name, page in zip(names[i : i + depth], target.pages[i : i + depth], strict=True):
                pipe.set(name, page.data)
            await pipe.execute()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        got = 0
        for i in range(0, len(names), depth):
            pipe = client.pipeline(transaction=False)
            for name in names[i : i + depth]:
                pipe.get(name)
            got += sum(len(v) for v in await pipe.execute() if v is not None)
        read_s = time.perf_counter() - start
        await client.delete(*names)
    finally:
        await client.aclose()
    if got != len(names) * target.page_bytes:
        raise TierIOError(f"redis baseline read back {got} of {len(names) * target.page_bytes} B")
    return BaselineSample(f"redis.asyncio SET/GET, pipeline {depth}", write_s, read_s, got)


# -- the registry ----------------------------------------------------------------------------

MEMCPY_PROFILE = IOProfile(no_options, memcpy_baseline, "memcpy into the arena's slots")
DISK_PROFILE = IOProfile(directory_options, disk_baseline, "fio / O_DIRECT on the store's dir")
REDIS_PROFILE = IOProfile(
    valkey_options, redis_baseline, "redis-benchmark (C client) and bare redis.asyncio"
)

_log = logging.getLogger(__name__)

#: Entry-point group where plugin distributions register the bench profile of their
#: backends (name = the backend's name, value = ``module:PROFILE``).
PROFILE_ENTRY_POINT_GROUP = "kvtier.bench_io_profiles"

_PROFILES: dict[str, IOProfile] = {
    "dram": MEMCPY_PROFILE,
    "hbm": CUDA_MEMCPY_PROFILE,
    "file": DISK_PROFILE,
    "nvme": DISK_PROFILE,
    "redis": REDIS_PROFILE,
}


def register_profile(backend_name: str, profile: IOProfile, *, replace: bool = False) -> None:
    """Register how ``kvtier bench io`` benchmarks ``backend_name``.

    Raises :class:`KVTierUsageError` if a profile is registered already and ``replace``
    is false.
    """
    if backend_name in _PROFILES and not replace:
        raise KVTierUsageError(
            f"an I/O bench profile for {backend_name!r} exists; pass replace=True"
        )
    _PROFILES[backend_name] = profile


def _entry_point_profile(backend_name: str) -> IOProfile | None:
    """A profile a distribution registers in :data:`PROFILE_ENTRY_POINT_GROUP` under the
    backend's name (``module:attribute`` of an :class:`IOProfile`), loaded on first use.
    A profile that fails to load is treated as absent."""
    try:
        eps = importlib.metadata.entry_points(group=PROFILE_ENTRY_POINT_GROUP)
        ep = next((e for e in eps if e.name == backend_name), None)
        profile = ep.load() if ep is not None else None
    except Exception as exc:  # a broken plugin must not break the benchmark of the others
        _ignored(backend_name, f"cannot load ({exc!r})")
        return None
    if profile is None:
        return None
    if not isinstance(profile, IOProfile):
        _ignored(backend_name, f"is a {type(profile).__name__}, not an IOProfile")
        return None
    _PROFILES[backend_name] = profile
    return profile


def _ignored(backend_name: str, why: str) -> None:
    """Log that the entry-point profile of ``backend_name`` is not used, and why."""
    _log.warning(
        "bench io profile for %r (entry point group %s) %s: using the default for its kind",
        backend_name,
        PROFILE_ENTRY_POINT_GROUP,
        why,
    )


def registered_profile(backend_name: str) -> IOProfile | None:
    """The profile registered for ``backend_name`` (here or through the entry-point
    group), or ``None``."""
    return _PROFILES.get(backend_name) or _entry_point_profile(backend_name)


def profile_for(backend_name: str, kind: BackendKind | str | None) -> IOProfile:
    """The registered profile of ``backend_name``, else the default for its kind
    (arena -> memcpy, store -> disk)."""
    profile = registered_profile(backend_name)
    if profile is not None:
        return profile
    if kind is not None and str(kind) == str(BackendKind.ARENA):
        return MEMCPY_PROFILE
    return DISK_PROFILE


def registered_profiles() -> dict[str, IOProfile]:
    """A copy of the registry (backend name -> profile)."""
    return dict(_PROFILES)
