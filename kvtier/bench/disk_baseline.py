"""The disk baseline of ``kvtier bench io``: fio on the store's directory, or threaded
``O_DIRECT`` ``pwrite``/``pread`` when fio is missing (see :mod:`kvtier.bench.baselines`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.baseline_types import DISK_IODEPTH, DISK_JOBS, BaselineSample, IOTarget
from kvtier.errors import KVTierUsageError, TierIOError

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


async def fio_io(path: Path, page_bytes: int, pages: int, jobs: int = DISK_JOBS) -> BaselineSample:
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
