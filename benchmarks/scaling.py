"""How each data path's cost grows, with its raw baseline in the same run; one PNG per path.

For the DRAM arena (baseline: memcpy), the NVMe store (fio, 2 jobs x iodepth 8, O_DIRECT)
and the remote ``redis`` tier (``redis-benchmark``, the C client), three sweeps:

* page size 64 KiB .. 16 MiB (calls of 8 pages, one caller);
* pages per call 1 .. 256 (256 KiB pages, one caller);
* concurrent callers 1 .. 256 (256 KiB pages, one call of 8 pages each, or one page each
  when callers x 8 pages would pass ``--total``).

Each point moves about ``--total`` bytes (at least one call per caller), written then read
back (checked), best of ``--repeats``; the baseline of a page size is measured beside it.
For the control plane, directory sizes 10^3 .. ``--max-pages`` (see
``benchmarks/control_plane.py``): microseconds of bookkeeping per page for ``store``,
``lookup`` and ``load`` (fault from the lower tier), and bytes of metadata per page (the
process's resident memory growth while filling, divided by the pages).

Usage::

    .venv/bin/python benchmarks/scaling.py --out docs/img --json scaling.json \
        [--paths dram,nvme,redis,control] [--dir /path/on/nvme]

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.baselines import aligned_buffers, fio_io, memcpy_baseline
from kvtier.bench.pagecache import drop_page_cache
from kvtier.keys import PageKey

KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
BATCHES = [1, 4, 16, 64, 256]
CALLERS = [1, 4, 16, 64, 256]
SWEEP_PAGE = 256 * KIB


def _keys(tag: str, n: int) -> list[PageKey]:
    import xxhash

    return [PageKey(xxhash.xxh3_128_digest(f"scaling/{tag}/{i}".encode())) for i in range(n)]


async def _pass(
    backend: Any, pages: Sequence[np.ndarray], outs: Sequence[np.ndarray], batch: int,
    callers: int, tag: str, workdir: Path | None,
) -> tuple[float, float]:  # fmt: skip
    """Write then read ``pages`` through ``backend`` with ``callers`` concurrent callers,
    ``batch`` pages per call; returns (write s, read s) and checks the bytes."""
    n = len(pages)
    keys = _keys(tag, n)
    share = [range(c, n, callers) for c in range(callers)]

    async def run(op: Callable[..., Awaitable[list[bool]]], bufs: Sequence[np.ndarray]) -> None:
        async def caller(idx: range) -> None:
            ids = list(idx)
            for s in range(0, len(ids), batch):
                part = ids[s : s + batch]
                ok = await op([keys[i] for i in part], [bufs[i] for i in part])
                assert all(ok), f"{tag}: {ok.count(False)} pages failed"

        await asyncio.gather(*(caller(idx) for idx in share if len(idx)))

    t = time.perf_counter()
    await run(backend.put, pages)
    write_s = time.perf_counter() - t
    if workdir is not None:
        drop_page_cache(workdir)
    t = time.perf_counter()
    await run(backend.get, outs)
    read_s = time.perf_counter() - t
    bad = sum(not np.array_equal(a, b) for a, b in zip(pages, outs, strict=True))
    assert bad == 0, f"{tag}: {bad} pages read back wrong"
    await backend.delete(keys)
    return write_s, read_s


def _points(total: int) -> list[tuple[str, int, int, int, int]]:
    """(sweep, x, page bytes, pages per call, callers) of every point."""
    pts = [("page size", s, s, 8, 1) for s in SIZES]
    pts += [("pages per call", b, SWEEP_PAGE, b, 1) for b in BATCHES]
    for c in CALLERS:
        per = 8 if c * 8 * SWEEP_PAGE <= total else 1
        pts.append(("concurrent callers", c, SWEEP_PAGE, per, c))
    return pts


class PathBench:
    """One data path: how to open the backend for a page size, and its baseline."""

    name = "?"
    baseline_name = "?"

    async def open(self, page_bytes: int, capacity: int) -> Any: ...
    async def baseline(
        self, backend: Any, page_bytes: int, pages: Sequence[np.ndarray], keys: list[PageKey]
    ) -> tuple[float, float]: ...
    async def close(self, backend: Any) -> None:
        await backend.close()

    workdir: Path | None = None


class Dram(PathBench):
    name, baseline_name = "DRAM arena", "memcpy"

    async def open(self, page_bytes: int, capacity: int) -> Any:
        from kvtier.backends.dram import DramArena

        b = DramArena(page_bytes=page_bytes, capacity_pages=capacity)
        await b.open()
        return b

    async def baseline(
        self, backend: Any, page_bytes: int, pages: Sequence[np.ndarray], keys: list[PageKey]
    ) -> tuple[float, float]:
        from kvtier.bench.baselines import IOTarget
        from kvtier.bench.io import copy_threads

        assert all(await backend.put(keys, list(pages)))
        target = IOTarget("dram", backend, keys, pages, page_bytes, None, {},
                          copy_threads(backend), 8)  # fmt: skip
        s = await memcpy_baseline(target)
        await backend.delete(keys)
        return s.write_seconds, s.read_seconds


class Nvme(PathBench):
    name, baseline_name = "NVMe store", "fio 2 jobs x iodepth 8"

    def __init__(self, root: Path) -> None:
        self.root = root

    async def open(self, page_bytes: int, capacity: int) -> Any:
        from kvtier.backends.nvme import NvmeStore

        self.workdir = self.root / f"store-{page_bytes}"
        shutil.rmtree(self.workdir, ignore_errors=True)
        b = NvmeStore(page_bytes=page_bytes, capacity_pages=capacity, path=self.workdir)
        await b.open()
        return b

    async def baseline(
        self, backend: Any, page_bytes: int, pages: Sequence[np.ndarray], keys: list[PageKey]
    ) -> tuple[float, float]:
        s = await fio_io(self.root / "fio.dat", page_bytes, len(pages))
        scale = len(pages) * page_bytes / s.nbytes
        return s.write_seconds * scale, s.read_seconds * scale

    async def close(self, backend: Any) -> None:
        await backend.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Redis(PathBench):
    name, baseline_name = "remote redis tier", "redis-benchmark (C client)"

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self, page_bytes: int, capacity: int) -> Any:
        from kvtier.backends.remote import RedisStore

        b = RedisStore(page_bytes=page_bytes, capacity_pages=capacity * 4, url=self.url,
                       op_timeout_s=60.0, key_prefix="scaling")  # fmt: skip
        await b.open()
        return b

    async def baseline(
        self, backend: Any, page_bytes: int, pages: Sequence[np.ndarray], keys: list[PageKey]
    ) -> tuple[float, float]:
        from kvtier.bench.redis_c import c_client_sample

        s = await c_client_sample(self.url, page_bytes, len(pages), 8)
        return s.write_seconds, s.read_seconds


async def bench_path(path: PathBench, total: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base_cache: dict[int, tuple[float, float]] = {}
    for sweep, x, size, batch, callers in _points(total):
        n = max(callers * batch if callers > 1 else batch, total // size)
        n = max(n, callers)
        pages = aligned_buffers(n, size)
        rng = np.random.default_rng(size + n)
        for p in pages:
            p[:] = rng.integers(0, 256, size, dtype=np.uint8)
        outs = aligned_buffers(n, size)
        backend = await path.open(size, n)
        best_w = best_r = float("inf")
        try:
            for rep in range(repeats):
                w, r = await _pass(backend, pages, outs, batch, callers,
                                   f"{sweep}/{x}/{rep}", path.workdir)  # fmt: skip
                best_w, best_r = min(best_w, w), min(best_r, r)
            if size not in base_cache:
                bw = br = float("inf")
                for rep in range(repeats):
                    w, r = await path.baseline(backend, size, pages, _keys(f"base{rep}", n))
                    bw, br = min(bw, w * total / (n * size)), min(br, r * total / (n * size))
                base_cache[size] = (bw, br)  # seconds for `total` bytes
        finally:
            await path.close(backend)
        nbytes = n * size
        bw, br = base_cache[size]
        row = {"sweep": sweep, "x": x, "page_bytes": size, "pages_per_call": batch,
               "callers": callers, "pages": n,
               "write_gbps": nbytes / best_w / 1e9, "read_gbps": nbytes / best_r / 1e9,
               "base_write_gbps": total / bw / 1e9, "base_read_gbps": total / br / 1e9}  # fmt: skip
        rows.append(row)
        print(f"  {path.name}: {sweep} {x}: write {row['write_gbps']:.2f} (base "
              f"{row['base_write_gbps']:.2f}) read {row['read_gbps']:.2f} (base "
              f"{row['base_read_gbps']:.2f}) GB/s", file=sys.stderr)  # fmt: skip
    return rows


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def bench_control(max_pages: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).parent))
    import control_plane as cp

    rows = []
    size = 1000
    while size <= max_pages:
        run = cp.Run(size, 256, 256)
        async with run.cache as cache:
            gc.collect()
            before = _rss()
            await run.fill(size)
            gc.collect()
            grown = _rss() - before
            k = max(1, min(16, len(run.chains) // 4))
            old, recent = run.chains[:k], run.chains[-k:]
            t = time.perf_counter()
            for _ in range(k):
                await cache.store(run.tokens(), run.page)
            await cache.pipeline.drain()
            store_us = (time.perf_counter() - t) / (k * run.chain) * 1e6
            t = time.perf_counter()
            for toks in recent:
                await cache.lookup(toks)
            lookup_us = (time.perf_counter() - t) / (k * run.chain) * 1e6
            t = time.perf_counter()
            for toks in old:
                keys = run.keys(toks)
                await cache.load(keys)
                cache.release(keys)
            await cache.pipeline.drain()
            load_us = (time.perf_counter() - t) / (k * run.chain) * 1e6
            pages = len(cache.directory)
        row = {"directory_pages": pages, "store_us": store_us, "lookup_us": lookup_us,
               "load_fault_us": load_us, "bytes_per_page": grown / pages}  # fmt: skip
        rows.append(row)
        print(f"  control plane: {pages} pages: store {store_us:.1f} lookup {lookup_us:.2f} "
              f"load {load_us:.1f} us/page, {row['bytes_per_page']:.0f} B/page",
              file=sys.stderr)  # fmt: skip
        size *= 10
    return rows


def _tick(x: float, sweep: str) -> str:
    if sweep != "page size":
        return str(int(x))
    return f"{int(x)} KiB" if x < 1024 else f"{int(x) // 1024} MiB"


def plot_path(name: str, baseline: str, rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [
        ("page size", "page size (log scale)", 1 / KIB),
        ("pages per call", "pages per call (256 KiB pages, log scale)", 1),
        ("concurrent callers", "concurrent callers (256 KiB pages, log scale)", 1),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, (sweep, label, scale) in zip(axes, sweeps, strict=True):
        pts = [r for r in rows if r["sweep"] == sweep]
        xs = [r["x"] * scale for r in pts]
        ax.plot(xs, [r["write_gbps"] for r in pts], "o-", color="tab:blue", label="kvtier write")
        ax.plot(xs, [r["read_gbps"] for r in pts], "s-", color="tab:orange", label="kvtier read")
        ax.plot(xs, [r["base_write_gbps"] for r in pts], "o--", color="tab:blue", alpha=0.5,
                label=f"{baseline} write")  # fmt: skip
        ax.plot(xs, [r["base_read_gbps"] for r in pts], "s--", color="tab:orange", alpha=0.5,
                label=f"{baseline} read")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([_tick(x, sweep) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("throughput (GB/s, 1e9 B/s)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: kvtier vs {baseline}, best of repeats, same run")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_control(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["directory_pages"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("store_us", "store (write-through, evictions)", "o-"),
                              ("load_fault_us", "load + release (fault from tier 2)", "s-"),
                              ("lookup_us", "lookup", "^-")):  # fmt: skip
        a.plot(xs, [r[key] for r in rows], style, label=label)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("pages in the directory (log scale)")
    a.set_ylabel("bookkeeping per page (µs, log scale)")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    b.plot(xs, [r["bytes_per_page"] for r in rows], "o-", color="tab:green")
    b.set_xscale("log")
    b.set_xlabel("pages in the directory (log scale)")
    b.set_ylabel("metadata per page (bytes of resident memory)")
    b.grid(True, alpha=0.3)
    fig.suptitle("control plane: cost per page vs directory size (256 B pages, 2 DRAM tiers)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.testing.servers import RedisServer

    wanted = args.paths.split(",")
    total = int(args.total_mib) * MIB
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if "dram" in wanted:
        results["dram"] = await bench_path(Dram(), total, args.repeats)
        plot_path("DRAM arena", "memcpy", results["dram"], out / "scaling_dram.png")
    if "nvme" in wanted:
        root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-scaling-"))
        root.mkdir(parents=True, exist_ok=True)
        try:
            results["nvme"] = await bench_path(Nvme(root), total, args.repeats)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        plot_path("NVMe store", "fio 2x8", results["nvme"], out / "scaling_nvme.png")
    if "redis" in wanted:
        with RedisServer("valkey") as server:
            results["redis"] = await bench_path(Redis(server.url), total, args.repeats)
        plot_path("remote redis tier (Valkey, loopback)", "redis-benchmark",
                  results["redis"], out / "scaling_redis.png")  # fmt: skip
    if "control" in wanted:
        results["control"] = await bench_control(args.max_pages)
        plot_control(results["control"], out / "scaling_control.png")
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default="dram,nvme,redis,control")
    p.add_argument("--total-mib", default="64", help="MiB moved per point")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-pages", type=int, default=1_000_000)
    p.add_argument("--dir", default="", help="directory for the NVMe store and fio")
    p.add_argument("--out", default="docs/img")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
