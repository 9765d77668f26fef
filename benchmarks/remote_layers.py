"""Where the remote tier's client CPU goes, one layer at a time, against one server.

Writes ``--pages`` pages of ``--page-size`` per pass, ``--repeats`` passes per layer
(interleaved), and reports GB/s (best pass) and the client process's CPU seconds per GB
(median; all its threads, independent of the machine's load):

1. ``wire``: :func:`~kvtier.backends.remote_datapath.send_pages` on one
   ``WireConnection`` in the main thread, values without a header;
2. ``wire + header``: the same with the page header (xxh3 of every page);
3. ``wire via pool``: (1) through ``WirePool.run``, one executor hop per batch, from the
   event loop;
4. ``RedisStore.put``: the tier itself.

Usage::

    .venv/bin/python benchmarks/remote_layers.py --page-size 256KiB --pages 512 --repeats 7

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import redis
import xxhash
from kvtier.backends.remote import RedisStore
from kvtier.backends.remote_datapath import (
    SetItem,
    WirePool,
    WireSettings,
    byte_view,
    send_pages,
)
from kvtier.backends.remote_wire import WireConnection

from kvtier.keys import PageKey
from kvtier.testing.servers import RedisServer


async def run(page: int, n: int, repeats: int, batch: int) -> dict[str, tuple[float, float]]:
    vals = [np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8) for i in range(n)]
    res: dict[str, list[tuple[float, float]]] = {}

    def rec(name: str, wall: float, cpu: float) -> None:
        res.setdefault(name, []).append((wall, cpu))

    with RedisServer("valkey") as srv:
        flush = redis.Redis(port=srv.port)
        conn = WireConnection.connect("127.0.0.1", srv.port, deadline=time.monotonic() + 3600,
                                      connect_timeout_s=1.0)  # fmt: skip
        pool = WirePool(WireSettings(connect_timeout_s=1.0), threads=1)
        store = RedisStore(page_bytes=page, capacity_pages=n * (repeats + 1), url=srv.url)
        await store.open()
        address = ("127.0.0.1", srv.port)
        try:
            for rep in range(repeats):
                names = [b"layers:%d:%d" % (rep, i) for i in range(n)]
                for label, header in (("1 wire", False), ("2 wire + header", True)):
                    c0, t0 = time.process_time(), time.perf_counter()
                    key = b"k" * 16 if header else None
                    for s in range(0, n, batch):
                        part = range(s, min(n, s + batch))
                        items = [SetItem(names[j], byte_view(vals[j]), key) for j in part]
                        send_pages(conn, items, False, 0)
                    rec(label, time.perf_counter() - t0, time.process_time() - c0)
                    flush.flushall()
                c0, t0 = time.process_time(), time.perf_counter()
                for s in range(0, n, batch):
                    items = [SetItem(names[j], byte_view(vals[j]))
                             for j in range(s, min(n, s + batch))]  # fmt: skip
                    await pool.run(address, lambda c, it=items: send_pages(c, it, False, 0),  # type: ignore[misc]
                                   time.monotonic() + 60)  # fmt: skip
                rec("3 wire via pool", time.perf_counter() - t0, time.process_time() - c0)
                flush.flushall()
                keys = [PageKey(xxhash.xxh3_128_digest(nm)) for nm in names]
                c0, t0 = time.process_time(), time.perf_counter()
                for s in range(0, n, batch):
                    assert all(await store.put(keys[s : s + batch], vals[s : s + batch]))
                rec("4 RedisStore.put", time.perf_counter() - t0, time.process_time() - c0)
                await store.delete(keys)
        finally:
            conn.close()
            pool.close()
            await store.close()
            flush.close()
    gb = n * page / 1e9
    return {k: (gb / min(w for w, _ in v), statistics.median(c for _, c in v) / gb)
            for k, v in res.items()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-size", default="256KiB")
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    units = {"KiB": 1 << 10, "MiB": 1 << 20}
    text = args.page_size
    page = next((int(text[: -len(u)]) * m for u, m in units.items() if text.endswith(u)), 0)
    page = page or int(text)
    for name, (gbps, cpu) in asyncio.run(run(page, args.pages, args.repeats, args.batch)).items():
        print(f"{name:20s} best {gbps:.2f} GB/s   client CPU {cpu:.3f} s/GB")


if __name__ == "__main__":
    main()
