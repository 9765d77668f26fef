"""MooncakeStore against a bare Mooncake client loop, in the same run, same deployment.

    python -m kvtier_mooncake.bench --page-size 4MiB --pages 32 --batch 8 --repeats 5

Starts a loopback :class:`~kvtier_mooncake.server.MooncakeCluster`, then per repeat
(interleaved, medians reported): kvtier's ``put``/``get`` in batches of ``--batch`` pages,
and the baseline: ``batch_put_from``/``batch_get_into`` of the same bytes from/into
registered buffers (no header, no checksum, no copy out). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import numpy as np

from kvtier.keys import PageKey


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


async def run(page: int, pages: int, batch: int, repeats: int) -> dict[str, Any]:
    from kvtier_mooncake.server import MooncakeCluster
    from kvtier_mooncake.store import MooncakeStore

    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, page, dtype=np.uint8) for _ in range(pages)]
    out = [np.empty(page, np.uint8) for _ in range(pages)]
    pool = max(512 << 20, 6 * pages * (page + 4096))  # far from its eviction watermark
    t: dict[str, list[float]] = {"kv_put": [], "kv_get": [], "raw_put": [], "raw_get": []}
    # the lease must outlast the slowest batch transfer, or reads fail with LEASE_EXPIRED
    with MooncakeCluster(pool_bytes=pool, lease_ms=2000) as cluster:
        opts: dict[str, Any] = dict(cluster.options())
        store = MooncakeStore(page_bytes=page, capacity_pages=pages, staging_pages=batch,
                              read_pages=batch, op_timeout_s=60, **opts)  # fmt: skip
        async with store:
            client = store._client  # the same connected client: the same transport
            raw = np.concatenate(data)
            sink = np.empty_like(raw)
            for buf in (raw, sink):
                assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            for rep in range(-1, repeats):
                keys = [PageKey(os.urandom(16)) for _ in range(pages)]
                names = [f"raw/{k.hex()}" for k in keys]
                start = time.perf_counter()
                for i in range(0, pages, batch):
                    assert all(await store.put(keys[i : i + batch], data[i : i + batch]))
                kv_put = time.perf_counter() - start
                start = time.perf_counter()
                for i in range(0, pages, batch):
                    assert all(await store.get(keys[i : i + batch], out[i : i + batch]))
                kv_get = time.perf_counter() - start
                assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
                start = time.perf_counter()
                for i in range(0, pages, batch):
                    ptrs = [raw.ctypes.data + j * page for j in range(i, min(i + batch, pages))]
                    codes = await store.run_blocking(
                        client.batch_upsert_from, names[i : i + batch], ptrs, [page] * len(ptrs)
                    )
                    assert all(c == 0 for c in codes), codes
                raw_put = time.perf_counter() - start
                start = time.perf_counter()
                for i in range(0, pages, batch):
                    ptrs = [sink.ctypes.data + j * page for j in range(i, min(i + batch, pages))]
                    got = await store.run_blocking(
                        client.batch_get_into, names[i : i + batch], ptrs, [page] * len(ptrs)
                    )
                    assert all(g == page for g in got), got
                raw_get = time.perf_counter() - start
                await store.delete(keys)
                await asyncio.sleep(0.01)
                await store.run_blocking(client.batch_remove, names, True)
                if rep >= 0:
                    for name, v in zip(t, (kv_put, kv_get, raw_put, raw_get), strict=True):
                        t[name].append(v)
    med = {k: statistics.median(v) for k, v in t.items()}
    nbytes = page * pages
    return {
        "page_bytes": page, "pages": pages, "batch": batch, "repeats": repeats,
        "kvtier_put_gbps": nbytes / med["kv_put"] / 1e9,
        "kvtier_get_gbps": nbytes / med["kv_get"] / 1e9,
        "raw_put_gbps": nbytes / med["raw_put"] / 1e9,
        "raw_get_gbps": nbytes / med["raw_get"] / 1e9,
        "put_ratio": med["raw_put"] / med["kv_put"],
        "get_ratio": med["raw_get"] / med["kv_get"],
        "baseline": "MooncakeDistributedStore batch_upsert_from / batch_get_into, same batch",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--page-size", default="4MiB")
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    print(json.dumps(asyncio.run(run(_size(a.page_size), a.pages, a.batch, a.repeats))))


if __name__ == "__main__":
    main()
