"""NVMe tier vs fio, same directory, same run: write/read GB/s and ratios per page size.

Each repeat interleaves, on the same directory: kvtier's NVMe store (``put`` in batches,
checksums, ``fdatasync`` + index commit per batch, then verified ``get``) and fio
(libaio, O_DIRECT, 2 jobs x iodepth 8, ``end_fsync``; the ``kvtier bench io`` disk
baseline) on the same number of bytes. Medians over repeats are reported, plus the median of the
per-repeat ratios (robust to the noise of a shared machine).

Usage::

    .venv/bin/python benchmarks/nvme_io.py --dir /path/on/nvme \
        --sizes 256KiB,1MiB,4MiB,16MiB --total 256MiB --repeats 5 [--unaligned] [--json]

``--unaligned`` uses ordinary numpy buffers (the body then goes through the engine's
aligned staging copy); by default page buffers are 4 KiB-aligned like the DRAM arena's.
A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_layout import aligned_empty

from kvtier.bench.baselines import fio_io
from kvtier.bench.pagecache import drop_page_cache

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def make_pages(n: int, size: int, aligned: bool, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        if aligned:
            buf = aligned_empty(size)
            buf[:] = data
            out.append(buf)
        else:
            out.append(data)
    return out


def time_phases(store: NvmeStore) -> dict[str, list[float]]:
    """Wrap the store's write and commit steps to time them (``--phases``): seconds per
    call of each, appended as the benchmark runs."""
    spent: dict[str, list[float]] = {"write": [], "commit": []}
    for phase, attr in (("write", "_write"), ("commit", "_commit")):
        inner = getattr(store, attr)

        async def timed(*args: Any, _inner: Any = inner, _phase: str = phase) -> Any:
            start = time.perf_counter()
            try:
                return await _inner(*args)
            finally:
                spent[_phase].append(time.perf_counter() - start)

        setattr(store, attr, timed)
    return spent


async def run_kvtier(
    store: NvmeStore, pages: list[np.ndarray], outs: list[np.ndarray], batch: int, tag: int
) -> tuple[float, float]:
    keys = [(tag * 10**6 + i).to_bytes(16, "little") for i in range(len(pages))]
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        ok = await store.put(keys[i : i + batch], pages[i : i + batch])
        if not all(ok):
            raise RuntimeError("kvtier: a page could not be written")
    write_s = time.perf_counter() - start
    drop_page_cache(store.path)
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        hits = await store.get(keys[i : i + batch], outs[i : i + batch])
        if not all(hits):
            raise RuntimeError("kvtier: a page was missing on read")
    read_s = time.perf_counter() - start
    if not all(np.array_equal(a, b) for a, b in zip(pages, outs, strict=True)):
        raise RuntimeError("kvtier: read back different bytes")
    await store.delete(keys)
    return write_s, read_s


async def bench_size(
    root: Path,
    size: int,
    total: int,
    repeats: int,
    batch_bytes: int,
    aligned: bool,
    io_threads: int | None = None,
    phases: bool = False,
) -> dict[str, Any]:
    n = max(8, total // size)
    batch = min(n, max(8, batch_bytes // size))  # at least 8 pages: the bench io default
    pages = make_pages(n, size, aligned, seed=size)
    outs = [aligned_empty(size) if aligned else np.ones(size, np.uint8) for _ in range(n)]
    store_dir = root / f"store-{size}"
    shutil.rmtree(store_dir, ignore_errors=True)
    kw: list[float] = []
    kr: list[float] = []
    fw: list[float] = []
    fr: list[float] = []
    threads = {} if io_threads is None else {"io_threads": io_threads}
    async with NvmeStore(page_bytes=size, capacity_pages=n, path=store_dir, **threads) as store:
        spent = time_phases(store) if phases else None
        for rep in range(-1, repeats):  # -1: warm-up (slab allocation, first touch)
            w, r = await run_kvtier(store, pages, outs, batch, rep + 1)
            base = await fio_io(root / "fio-baseline.dat", size, n)
            if rep >= 0:
                kw.append(n * size / w / 1e9)
                kr.append(n * size / r / 1e9)
                fw.append(base.nbytes / base.write_seconds / 1e9)
                fr.append(base.nbytes / base.read_seconds / 1e9)
        direct = store.direct
        used_threads = store.io_threads
        if spent is not None:  # the warm-up's calls are in too: shares, not totals
            total_s = sum(spent["write"]) + sum(spent["commit"])
            share = {k: sum(v) / total_s for k, v in spent.items()}
            per_commit_ms = 1e3 * statistics.median(spent["commit"])
    shutil.rmtree(store_dir, ignore_errors=True)
    med = statistics.median
    return {
        "page_bytes": size,
        "pages": n,
        "batch_pages": batch,
        "io_threads": used_threads,
        "direct_io": direct,
        "aligned_buffers": aligned,
        "kvtier_write_gbps": med(kw),
        "kvtier_read_gbps": med(kr),
        "fio_write_gbps": med(fw),
        "fio_read_gbps": med(fr),
        "write_ratio": med(kw) / med(fw),
        "read_ratio": med(kr) / med(fr),
        "write_ratio_paired_median": med(a / b for a, b in zip(kw, fw, strict=True)),
        "read_ratio_paired_median": med(a / b for a, b in zip(kr, fr, strict=True)),
        "samples": {"kvtier_write": kw, "kvtier_read": kr, "fio_write": fw, "fio_read": fr},
        **({"phase_share": share, "commit_ms_median": per_commit_ms} if spent is not None else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="directory on the disk to measure")
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    ap.add_argument("--total", default="256MiB", help="bytes per repeat and page size")
    ap.add_argument(
        "--batch-bytes", default="32MiB", help="bytes per put/get call (at least 8 pages)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unaligned", action="store_true")
    ap.add_argument(
        "--io-threads", type=int, default=None, help="the store's io_threads (pages in flight)"
    )
    ap.add_argument("--phases", action="store_true", help="time the store's write and commit steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio is not installed: this benchmark compares against fio")
    args.dir.mkdir(parents=True, exist_ok=True)
    results = [
        asyncio.run(
            bench_size(
                args.dir,
                parse_size(s),
                parse_size(args.total),
                args.repeats,
                parse_size(args.batch_bytes),
                not args.unaligned,
                args.io_threads,
                args.phases,
            )
        )
        for s in args.sizes.split(",")
    ]
    if args.json:
        print(json.dumps({"results": results}))
        return
    print(
        f"{'page':>8} {'batch':>5} {'kv W GB/s':>9} {'fio W':>6} {'W ratio':>7} "
        f"{'kv R GB/s':>9} {'fio R':>6} {'R ratio':>7}  (paired W/R)"
    )
    for r in results:
        print(
            f"{r['page_bytes'] >> 10:>6}Ki {r['batch_pages']:>5} {r['kvtier_write_gbps']:>9.2f} "
            f"{r['fio_write_gbps']:>6.2f} {r['write_ratio']:>7.2f} {r['kvtier_read_gbps']:>9.2f} "
            f"{r['fio_read_gbps']:>6.2f} {r['read_ratio']:>7.2f}  "
            f"({r['write_ratio_paired_median']:.2f}/{r['read_ratio_paired_median']:.2f})"
        )
        if "phase_share" in r:
            print(
                f"{'':>8} write steps {r['phase_share']['write'] * 100:.0f} %, commits "
                f"{r['phase_share']['commit'] * 100:.0f} % of put time; median commit "
                f"{r['commit_ms_median']:.1f} ms"
            )


if __name__ == "__main__":
    main()
