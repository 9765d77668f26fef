#!/usr/bin/env python
"""The GPU check: kvtier's GPU tiers on a real GPU, compared with raw baselines measured
in the same run. Prints one JSON object on stdout (progress on stderr).

    .venv/bin/python benchmarks/gpu_check.py [--out FILE] [--nvme-dir DIR] [--budget-s 330]

Sections (each records its own error instead of aborting the run, and is skipped with a
reason when the time budget is spent; the whole run stays under 6 minutes):

1. ``conformance``: the backend conformance suite on the HBM arena, the DRAM arena
   (pinned when torch sees CUDA) and the NVMe store with the KvikIO engine.
2. ``copy``: D2H and H2D GB/s of kvtier's path (HbmArena.write/get from and to pinned
   host pages, batched, on its copy streams, 1 or 4 batches in flight) vs raw
   ``cudaMemcpyAsync`` of the same pinned pages, all queued at once, for 4 MiB and 64 KiB
   pages and 1 and 2 streams; ``ratio`` = kvtier / raw. Beside them, one copy of the
   whole buffer: the copy engine's own limit.
3. ``layout``: moving llama3-8b pages down from a layer-first engine cache: page-first
   (one gather kernel pair + one D2H copy) vs per-(page, layer, K/V) copies.
4. ``overlap``: copy GB/s and matmul time alone and together (matmuls on the default
   stream, copies on kvtier's non-blocking streams); ``loss`` = 1 - together / alone.
5. ``nvme_to_hbm``: GB/s of NVMe -> HBM through kvtier (NvmeStore with the KvikIO engine,
   verified reads into pinned pages, then HbmArena.write) vs KvikIO's own raw
   ``CuFile.pread`` into device memory, page cache dropped before each read.

Without a usable GPU it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def section(name: str, budget: Budget, need_s: float, fn: Callable[[], Any]) -> Any:
    if budget.left() < need_s:
        return {
            "skipped": f"time budget: {budget.left():.0f} s left, section needs ~{need_s:.0f} s"
        }
    log(f"{name} ...")
    start = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # record and go on: one broken section must not hide the rest
        import traceback

        out = {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}
    if isinstance(out, dict):
        out["seconds"] = round(time.monotonic() - start, 2)
    return out


# -- 1. conformance -----------------------------------------------------------------------


def run_conformance() -> dict[str, Any]:
    from kvtier.backends.dram import DramArena
    from kvtier.backends.hbm import HbmArena
    from kvtier.backends.nvme import NvmeStore
    from kvtier.backends.nvme_engines import kvikio_unavailable_reason

    from kvtier.testing.conformance import ConformanceError, check_backend

    out: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-gpu-conformance-"))
    factories: dict[str, Callable[[], Any]] = {
        "hbm": lambda: HbmArena(page_bytes=64 * 1024, capacity_pages=16),
        "dram": lambda: DramArena(page_bytes=64 * 1024, capacity_pages=16),
    }
    kvikio_reason = kvikio_unavailable_reason()
    if kvikio_reason is None:
        # 5000 bytes: not a multiple of 4 KiB, so the body/tail split is covered.
        factories["nvme_kvikio"] = lambda: NvmeStore(
            page_bytes=5000, capacity_pages=16, path=scratch / "nvme", engine="kvikio",
            slab_bytes=4 * 12288,
        )  # fmt: skip
    else:
        out["nvme_kvikio"] = {"skipped": kvikio_reason}
    for name, factory in factories.items():
        try:
            report = asyncio.run(check_backend(factory, persistent=name.startswith("nvme")))
            out[name] = {
                "passed": report.passed,
                "skipped": report.skipped,
                "failed": [],
            }
        except ConformanceError as exc:
            out[name] = {"failed": str(exc).splitlines()[1:] or [str(exc)]}

    async def dram_memory() -> str:
        async with DramArena(page_bytes=4096, capacity_pages=1) as a:
            return str(a.stats()["memory"])

    out["dram_memory"] = asyncio.run(dram_memory())
    shutil.rmtree(scratch, ignore_errors=True)
    return out


# -- helpers ------------------------------------------------------------------------------


def pinned_pages(n: int, page: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """One pinned host buffer of ``n`` pages (random bytes) and a view per page."""
    from kvtier.cuda_streams import pinned_host_array

    buf = pinned_host_array(n * page)
    buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
    return buf, [buf[i * page : (i + 1) * page] for i in range(n)]


def raw_copy_gbs(direction: str, host: list[np.ndarray], streams: int, repeats: int) -> float:
    """GB/s of cudaMemcpyAsync of each pinned page, round-robin over ``streams``."""
    import cupy

    rt = cupy.cuda.runtime
    page = host[0].nbytes
    dev = cupy.empty(len(host) * page, dtype=cupy.uint8)
    pool = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)]
    kind = rt.memcpyHostToDevice if direction == "h2d" else rt.memcpyDeviceToHost
    times = []
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for i, h in enumerate(host):
            d = dev.data.ptr + i * page
            s = pool[i % streams]
            if direction == "h2d":
                rt.memcpyAsync(d, h.ctypes.data, page, kind, s.ptr)
            else:
                rt.memcpyAsync(h.ctypes.data, d, page, kind, s.ptr)
        for s in pool:
            s.synchronize()
        times.append(time.perf_counter() - start)
    return len(host) * page / statistics.median(times) / 1e9


async def kvtier_copy_gbs(
    host: list[np.ndarray],
    streams: int,
    repeats: int,
    batch: int,
    inflight: int = 1,
    before: Callable[[], None] | None = None,
) -> dict[str, float]:
    """GB/s of HbmArena.write (H2D) and HbmArena.get (D2H) of the pinned pages, in
    batches of ``batch`` pages, ``inflight`` batches in flight at once (a sliding window,
    as the cache's links keep ``pipeline.max_inflight_per_link`` batches going) on
    ``streams`` copy streams per direction. ``before`` runs once the arena is open, just
    before the first timed copy (to queue compute alongside)."""
    from kvtier.backends.hbm import HbmArena

    from kvtier.keys import PageKey

    page = host[0].nbytes
    n = len(host)
    keys = [PageKey(i.to_bytes(16, "little")) for i in range(n)]
    out: dict[str, list[float]] = {"h2d": [], "d2h": []}

    async def window(calls: list[Callable[[], Any]]) -> float:
        gate = asyncio.Semaphore(inflight)

        async def one(call: Callable[[], Any]) -> None:
            async with gate:
                await call()

        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in calls))
        return time.perf_counter() - start

    async with HbmArena(page_bytes=page, capacity_pages=n, copy_streams=streams) as arena:
        chunks = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
        if before is not None:
            before()
        for _ in range(repeats):
            await arena.delete(await arena.keys())
            res = [r for r in await arena.reserve(keys) if r is not None]
            assert len(res) == n, "HBM arena could not reserve every page"
            writes = [
                lambda rs=[res[i] for i in c], hs=[host[i] for i in c]: arena.write(rs, hs)
                for c in chunks
            ]
            out["h2d"].append(await window(writes))
            await arena.commit(res)
            reads = [
                lambda c=c: arena.get([keys[i] for i in c], [host[i] for i in c]) for c in chunks
            ]
            out["d2h"].append(await window(reads))
    return {d: n * page / statistics.median(t) / 1e9 for d, t in out.items()}


# -- 2. copy bandwidth ---------------------------------------------------------------------


def run_copy(total_mib: int) -> dict[str, Any]:
    results = []
    for page in (4 * MIB, 64 * 1024):
        n = max(8, total_mib * MIB // page)
        _buf, host = pinned_pages(n, page)
        for streams in (1, 2):
            raw = {d: raw_copy_gbs(d, host, streams, repeats=3) for d in ("h2d", "d2h")}
            for inflight in (1, 4):
                k = asyncio.run(
                    kvtier_copy_gbs(host, streams, repeats=3, batch=max(1, n // 8),
                                    inflight=inflight)
                )  # fmt: skip
                for direction in ("h2d", "d2h"):
                    results.append(
                        {
                            "page_bytes": page,
                            "pages": n,
                            "batch_pages": max(1, n // 8),
                            "streams": streams,
                            "inflight": inflight,
                            "direction": direction,
                            "raw_gbs": round(raw[direction], 2),
                            "kvtier_gbs": round(k[direction], 2),
                            "ratio": round(k[direction] / raw[direction], 3),
                        }
                    )
    # The copy engine's own limit: one cudaMemcpyAsync of the whole contiguous buffer.
    buf, _ = pinned_pages(1, total_mib * MIB)
    whole = [buf]
    bulk = {d: round(raw_copy_gbs(d, whole, 1, repeats=3), 2) for d in ("h2d", "d2h")}
    return {
        "results": results,
        "one_copy_of_everything_gbs": bulk,
        "goal": "ratio >= 0.9 for 4 MiB pages",
    }


# -- 3. layer-first vs page-first -------------------------------------------------------


def run_layout(pages: int) -> dict[str, Any]:
    import cupy

    from kvtier.spec import preset
    from kvtier.transfer.layout import LayerFirstCache

    spec = preset("llama3-8b")
    blocks = pages * 2
    shape = (spec.num_layers, blocks, spec.kv_factor, spec.page_tokens, spec.num_kv_heads,
             spec.head_dim)  # fmt: skip
    engine = cupy.random.random(shape, dtype=cupy.float32).astype(cupy.float16)
    cupy.cuda.Device().synchronize()  # filled on the default stream; gathers run on another
    cache = LayerFirstCache(spec, engine, "blocks_first")
    ids = np.arange(0, blocks, 2)[:pages]
    host_all, host = pinned_pages(pages, spec.page_bytes)
    staging = cupy.empty((pages, spec.page_bytes), dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime
    chunk = spec.bytes_per_layer // spec.kv_factor
    u8 = engine.view(cupy.uint8).reshape(spec.num_layers, blocks, spec.kv_factor, chunk)

    def page_first() -> None:
        with stream:
            cache.gather(ids, staging)
            rt.memcpyAsync(host_all.ctypes.data, staging.data.ptr, staging.nbytes,
                           rt.memcpyDeviceToHost, stream.ptr)  # fmt: skip
        stream.synchronize()

    def per_chunk() -> None:
        for p, block in enumerate(ids):
            base = host[p].ctypes.data
            for layer in range(spec.num_layers):
                for kv in range(spec.kv_factor):
                    src = u8[layer, int(block), kv]
                    off = (layer * spec.kv_factor + kv) * chunk
                    rt.memcpyAsync(base + off, src.data.ptr, chunk, rt.memcpyDeviceToHost,
                                   stream.ptr)  # fmt: skip
        stream.synchronize()

    def timed(fn: Callable[[], None]) -> float:
        fn()  # warm-up
        ts = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
        return statistics.median(ts)

    t_page = timed(page_first)
    page_result = np.stack(host).copy()
    t_chunk = timed(per_chunk)
    same = bool(np.array_equal(page_result, np.stack(host)))
    moved = pages * spec.page_bytes
    return {
        "spec": spec.name,
        "page_bytes": spec.page_bytes,
        "pages": pages,
        "page_first_gbs": round(moved / t_page / 1e9, 2),
        "per_layer_copies_gbs": round(moved / t_chunk / 1e9, 2),
        "speedup": round(t_chunk / t_page, 2),
        "per_layer_copy_count": pages * spec.num_layers * spec.kv_factor,
        "results_identical": same,
        "goal": "speedup >= 4",
    }


# -- 4. copies overlapped with compute --------------------------------------------------


def run_overlap(total_mib: int) -> dict[str, Any]:
    import cupy

    page = 4 * MIB
    n = total_mib * MIB // page
    _buf, host = pinned_pages(n, page)
    a = cupy.random.random((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.random((8192, 8192), dtype=cupy.float32).astype(cupy.float16)

    def matmuls(count: int) -> None:
        for _ in range(count):
            cupy.matmul(a, b)

    # size the matmul loop to last about as long as the copies
    null = cupy.cuda.Stream.null
    start = time.perf_counter()
    matmuls(5)
    null.synchronize()
    per = (time.perf_counter() - start) / 5
    copy_alone = asyncio.run(kvtier_copy_gbs(host, 2, repeats=1, batch=8, inflight=4))
    copy_s = 2 * n * page / ((copy_alone["h2d"] + copy_alone["d2h"]) / 2 * 1e9)
    count = max(10, int(copy_s / per))
    start = time.perf_counter()
    matmuls(count)
    null.synchronize()
    mm_alone = time.perf_counter() - start

    async def together() -> tuple[dict[str, float], float]:
        t0 = 0.0

        def queue_matmuls() -> None:  # queued on the default stream; runs while copies go
            nonlocal t0
            t0 = time.perf_counter()
            matmuls(count)

        copies = await kvtier_copy_gbs(
            host, 2, repeats=1, batch=8, inflight=4, before=queue_matmuls
        )
        await asyncio.get_running_loop().run_in_executor(None, null.synchronize)
        return copies, time.perf_counter() - t0

    copy_with, mm_with = asyncio.run(together())
    out: dict[str, Any] = {
        "matmul_count": count,
        "matmul_alone_s": round(mm_alone, 3),
        "matmul_with_copies_s": round(mm_with, 3),
        "goal": "loss <= 0.10 for both",
    }
    for d in ("h2d", "d2h"):
        out[f"{d}_alone_gbs"] = round(copy_alone[d], 2)
        out[f"{d}_with_matmul_gbs"] = round(copy_with[d], 2)
        out[f"{d}_loss"] = round(1 - copy_with[d] / copy_alone[d], 3)
    out["matmul_loss"] = round(1 - mm_alone / mm_with, 3)
    return out


# -- 5. NVMe -> HBM ---------------------------------------------------------------------


def _drop_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _kvikio_compat_mode() -> str:
    """KvikIO's compat mode setting (ON: POSIX reads, no GPUDirect Storage), as it says."""
    try:
        import kvikio.defaults

        return str(kvikio.defaults.get("compat_mode"))
    except Exception as exc:  # an older KvikIO has defaults.compat_mode() instead
        return f"unknown ({exc!r})"


def run_nvme(nvme_dir: Path, total_mib: int) -> dict[str, Any]:
    from kvtier.backends.nvme_engines import kvikio_unavailable_reason

    reason = kvikio_unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    import cupy
    import kvikio
    from kvtier.backends.hbm import HbmArena
    from kvtier.backends.nvme import NvmeStore

    from kvtier.keys import PageKey

    page = 4 * MIB
    n = total_mib * MIB // page
    host_all, host = pinned_pages(n, page)
    keys = [PageKey(i.to_bytes(16, "little")) for i in range(n)]
    with tempfile.TemporaryDirectory(dir=nvme_dir) as tmp:
        root = Path(tmp)

        async def kvtier_path() -> float:
            store = NvmeStore(page_bytes=page, capacity_pages=n, path=root / "store",
                              engine="kvikio")  # fmt: skip
            async with store, HbmArena(page_bytes=page, capacity_pages=n) as hbm:
                assert all(await store.put(keys, host))
                _drop_cache(root / "store")
                res = await hbm.reserve(keys)
                start = time.perf_counter()
                for i in range(0, n, 16):
                    sl = slice(i, i + 16)
                    ok = await store.get(keys[sl], host[sl])
                    assert all(ok), "verified read failed"
                    await hbm.write([r for r in res[sl] if r is not None], host[sl])
                return n * page / (time.perf_counter() - start) / 1e9

        kv = asyncio.run(kvtier_path())
        raw_file = root / "raw.bin"
        with kvikio.CuFile(raw_file, "w") as f:
            f.write(host_all)
        _drop_cache(root)
        dev = cupy.empty(n * page, dtype=cupy.uint8)
        start = time.perf_counter()
        with kvikio.CuFile(raw_file, "r") as f:
            futures = [f.pread(dev[i * page : (i + 1) * page], page, i * page) for i in range(n)]
            got = sum(fut.get() for fut in futures)
        raw = got / (time.perf_counter() - start) / 1e9
    return {
        "pages": n,
        "page_bytes": page,
        "kvikio_compat_mode": _kvikio_compat_mode(),
        "kvtier_gbs": round(kv, 2),
        "kvikio_raw_gbs": round(raw, 2),
        "ratio": round(kv / raw, 3),
        "kvtier_path": "NvmeStore(kvikio).get into pinned host pages (verified) + HbmArena.write",
        "raw_path": "kvikio.CuFile.pread straight into device memory (no verification)",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--nvme-dir", type=Path, default=Path.cwd(), help="scratch dir on NVMe")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting sections after")
    ap.add_argument("--copy-mib", type=int, default=512, help="bytes moved per copy test")
    args = ap.parse_args()

    from kvtier.cuda_streams import cupy_unavailable_reason

    reason = cupy_unavailable_reason()
    if reason is not None:
        print(f"gpu_check: no usable GPU on this machine: {reason}", file=sys.stderr)
        return 2
    import cupy

    from kvtier.topology import read_topology

    budget = Budget(args.budget_s)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result: dict[str, Any] = {
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "topology": read_topology().to_dict(),
    }
    sections: list[tuple[str, float, Callable[[], Any]]] = [
        ("conformance", 20, run_conformance),
        ("copy", 60, lambda: run_copy(args.copy_mib)),
        ("layout", 30, lambda: run_layout(64)),
        ("overlap", 40, lambda: run_overlap(args.copy_mib)),
        ("nvme_to_hbm", 60, lambda: run_nvme(args.nvme_dir, args.copy_mib)),
    ]
    for name, need_s, fn in sections:
        result[name] = section(name, budget, need_s, fn)
        if args.out:  # after every section: a run killed by its time limit keeps the rest
            args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
