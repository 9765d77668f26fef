"""Redis-protocol clients side by side on one server, in one run, against the C client.

For each page size, every repeat runs, on the same server and with the same number of
values of the same size (``--total`` bytes), each client's pipelined ``SET`` of every
value and then ``GET`` of every value, in a rotating order, and ``redis-benchmark`` (the
C client, best of ``-c 1 -P depth`` and ``-c 4 -P 2``) on the same server. Figures are
the best of ``--repeats`` for every client alike; the ratio is client / C client.

Clients (each skipped with a reason when it cannot be imported here):

* ``redis-py``: ``redis.asyncio`` + hiredis, a pipeline of ``depth`` commands; values
  sent as memoryviews (no copy), replies are ``bytes``;
* ``glide``: ``valkey-glide`` (Rust core), a non-atomic ``Batch`` of ``depth``;
* ``coredis``: a ``coredis`` pipeline of ``depth``;
* ``wire``: kvtier's own data path (:mod:`kvtier.backends.remote_datapath`) without the
  page header or checksum: ``SET`` straight from the value's buffer, ``GET`` straight
  into the caller's buffer, one worker thread per batch;
* ``kvtier``: the tier itself, ``RedisStore.put`` / ``get`` in calls of ``depth`` pages
  (header, xxh3 checksum, verification, capacity accounting, deadlines), default
  options; ``kvtier-1conn`` (``max_inflight=1``, one connection), ``kvtier-2conn`` and
  ``kvtier-4conn`` (each call split over 2 / 4 connections, ``batch_pages`` =
  depth/2, depth/4) and ``kvtier-call32`` (calls of 32 pages) show the techniques;
* ``--compare-store LABEL=FILE``: another ``RedisStore`` (e.g. the previous commit's, from
  ``git show``) measured the same way, under ``LABEL``.

Third-party clients get their values as ready-made ``bytes`` (built outside the timed
region) and their ``GET`` replies are not copied anywhere: their best case. kvtier's
reads land in the caller's buffers and are checked byte for byte after each repeat.

Usage::

    .venv/bin/python benchmarks/remote_clients.py --sizes 256KiB,4MiB --total 256MiB \
        --repeats 5 [--server valkey|redis] [--clients kvtier,redis-py,...] [--json OUT]

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvtier.bench.redis_c import (
    PARALLEL_SHAPE,
    SET_KEYSPACE,
    drop_keys,
    populate,
    redis_benchmark_path,
    run_redis_benchmark,
)
from kvtier.keys import PageKey
from kvtier.testing.servers import RedisServer

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def fmt_size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}"
    return f"{n} B"


class Client:
    """One client under test: ``write``/``read`` return seconds for all values."""

    name = "?"

    async def open(self, url: str, port: int, size: int) -> None: ...
    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float: ...
    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float: ...
    async def drop(self, names: list[bytes]) -> None: ...
    async def close(self) -> None: ...


def _chunks(n: int, depth: int) -> list[range]:
    return [range(i, min(n, i + depth)) for i in range(0, n, depth)]


class RedisPy(Client):
    name = "redis-py"

    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def open(self, url: str, port: int, size: int) -> None:
        import redis.asyncio as aioredis

        self.c = aioredis.Redis.from_url(url)

    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float:
        start = time.perf_counter()
        for ch in _chunks(len(names), self.depth):
            pipe = self.c.pipeline(transaction=False)
            for i in ch:
                pipe.set(names[i], values[i].data)
            await pipe.execute()
        return time.perf_counter() - start

    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float:
        start, got = time.perf_counter(), 0
        for ch in _chunks(len(names), self.depth):
            pipe = self.c.pipeline(transaction=False)
            for i in ch:
                pipe.get(names[i])
            got += sum(len(v) for v in await pipe.execute())
        took = time.perf_counter() - start
        assert got == sum(o.nbytes for o in outs), "redis-py read short"
        return took

    async def drop(self, names: list[bytes]) -> None:
        for ch in _chunks(len(names), 1000):
            await self.c.delete(*[names[i] for i in ch])

    async def close(self) -> None:
        await self.c.aclose()


class Glide(Client):
    name = "glide"

    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def open(self, url: str, port: int, size: int) -> None:
        from glide import GlideClient, GlideClientConfiguration, NodeAddress

        cfg = GlideClientConfiguration([NodeAddress("127.0.0.1", port)], request_timeout=60000)
        self.c = await GlideClient.create(cfg)

    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float:
        from glide import Batch

        raw = [v.tobytes() for v in values]  # their best case: ready-made bytes
        start = time.perf_counter()
        for ch in _chunks(len(names), self.depth):
            batch = Batch(is_atomic=False)
            for i in ch:
                batch.set(names[i], raw[i])
            await self.c.exec(batch, raise_on_error=True)
        return time.perf_counter() - start

    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float:
        from glide import Batch

        start, got = time.perf_counter(), 0
        for ch in _chunks(len(names), self.depth):
            batch = Batch(is_atomic=False)
            for i in ch:
                batch.get(names[i])
            got += sum(len(v) for v in await self.c.exec(batch, raise_on_error=True) or [])
        took = time.perf_counter() - start
        assert got == sum(o.nbytes for o in outs), "glide read short"
        return took

    async def drop(self, names: list[bytes]) -> None:
        for ch in _chunks(len(names), 1000):
            await self.c.delete([names[i] for i in ch])

    async def close(self) -> None:
        await self.c.close()


class Coredis(Client):
    name = "coredis"

    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def open(self, url: str, port: int, size: int) -> None:
        import coredis

        self.c = coredis.Redis(host="127.0.0.1", port=port, stream_timeout=60)
        self.cm = await self.c.__aenter__() if hasattr(self.c, "__aenter__") else None

    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float:
        raw = [v.tobytes() for v in values]
        start = time.perf_counter()
        for ch in _chunks(len(names), self.depth):
            async with self.c.pipeline(transaction=False) as pipe:
                for i in ch:
                    pipe.set(names[i], raw[i])
        return time.perf_counter() - start

    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float:
        start, got = time.perf_counter(), 0
        for ch in _chunks(len(names), self.depth):
            async with self.c.pipeline(transaction=False) as pipe:
                futs = [pipe.get(names[i]) for i in ch]
            got += sum([len(await f) for f in futs])
        took = time.perf_counter() - start
        assert got == sum(o.nbytes for o in outs), "coredis read short"
        return took

    async def drop(self, names: list[bytes]) -> None:
        for ch in _chunks(len(names), 1000):
            await self.c.delete([names[i] for i in ch])

    async def close(self) -> None:
        if self.cm is not None:
            await self.c.__aexit__(None, None, None)


class Wire(Client):
    """kvtier's data path without the page format: raw values, no checksum."""

    name = "wire"

    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def open(self, url: str, port: int, size: int) -> None:
        from kvtier.backends.remote_datapath import WirePool, WireSettings

        self.pool = WirePool(WireSettings(connect_timeout_s=5.0), threads=2)
        self.addr = ("127.0.0.1", port)

    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float:
        from kvtier.backends.remote_datapath import SetItem, byte_view, send_pages

        start = time.perf_counter()
        for ch in _chunks(len(names), self.depth):
            items = [SetItem(names[i], byte_view(values[i])) for i in ch]
            await self.pool.run(self.addr, lambda c, it=items: send_pages(c, it, False, 0),  # type: ignore[misc]
                                time.monotonic() + 60)  # fmt: skip
        return time.perf_counter() - start

    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float:
        from kvtier.backends.remote_wire import ValueReply

        def fetch(conn: Any, part: list[tuple[bytes, memoryview]]) -> None:
            conn.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n, _ in part])
            for _, view in part:
                got = conn.read_value_into(view, memoryview(b""))
                assert got is ValueReply.VALUE, got

        start = time.perf_counter()
        for ch in _chunks(len(names), self.depth):
            part = [(names[i], memoryview(outs[i])) for i in ch]
            await self.pool.run(self.addr, lambda c, p=part: fetch(c, p),  # type: ignore[misc]
                                time.monotonic() + 60)  # fmt: skip
        return time.perf_counter() - start

    async def drop(self, names: list[bytes]) -> None:
        import redis.asyncio as aioredis

        c = aioredis.Redis(port=self.addr[1])
        for ch in _chunks(len(names), 1000):
            await c.delete(*[names[i] for i in ch])
        await c.aclose()

    async def close(self) -> None:
        self.pool.close()


class Kvtier(Client):
    """The ``redis`` tier: ``RedisStore.put``/``get`` in calls of ``call`` pages."""

    store_class: Any = None  # another implementation (--compare-store), else RedisStore

    def __init__(self, name: str, call: int, **options: Any) -> None:
        self.name = name
        self.call = call
        self.options = options

    async def open(self, url: str, port: int, size: int) -> None:
        from kvtier.backends.remote import RedisStore

        cls = self.store_class or RedisStore
        self.store = cls(page_bytes=size, capacity_pages=1 << 20, url=url,
                                op_timeout_s=60.0, key_prefix="bench", **self.options)  # fmt: skip
        await self.store.open()

    @staticmethod
    def _keys(names: list[bytes]) -> list[PageKey]:
        import xxhash

        return [PageKey(xxhash.xxh3_128_digest(n)) for n in names]

    async def write(self, names: list[bytes], values: list[np.ndarray]) -> float:
        keys = self._keys(names)
        start = time.perf_counter()
        ok: list[bool] = []
        for ch in _chunks(len(keys), self.call):
            ok += await self.store.put([keys[i] for i in ch], [values[i] for i in ch])
        took = time.perf_counter() - start
        assert all(ok), f"{self.name}: {ok.count(False)} pages not written"
        return took

    async def read(self, names: list[bytes], outs: list[np.ndarray]) -> float:
        keys = self._keys(names)
        start = time.perf_counter()
        ok: list[bool] = []
        for ch in _chunks(len(keys), self.call):
            ok += await self.store.get([keys[i] for i in ch], [outs[i] for i in ch])
        took = time.perf_counter() - start
        assert all(ok), f"{self.name}: {ok.count(False)} pages missing"
        return took

    async def drop(self, names: list[bytes]) -> None:
        await self.store.delete(self._keys(names))

    async def close(self) -> None:
        await self.store.close()


#: Another RedisStore implementation to measure beside (``--compare-store FILE``).
COMPARE: list[tuple[str, Any]] = []


def load_store_class(path: str) -> Any:
    """``RedisStore`` from a file (e.g. ``git show <commit>:backends/remote.py``), loaded
    inside ``kvtier.backends`` so that its relative imports resolve."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvtier.backends._compared_remote", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.RedisStore


def make_clients(depth: int) -> list[Client]:
    extra: list[Client] = []
    for label, cls in COMPARE:
        client = Kvtier(label, depth)
        client.store_class = cls
        extra.append(client)
    return [
        *extra,
        Kvtier("kvtier", depth),
        Kvtier("kvtier-1conn", depth, max_inflight=1, batch_pages=depth),
        Kvtier("kvtier-2conn", depth, batch_pages=max(1, depth // 2)),
        Kvtier("kvtier-4conn", depth, batch_pages=max(1, depth // 4)),
        Kvtier("kvtier-call32", 32),
        Wire(depth),
        RedisPy(depth),
        Glide(depth),
        Coredis(depth),
    ]


async def _usable(client: Client, url: str, port: int, size: int) -> str | None:
    try:
        await client.open(url, port, size)
    except Exception as exc:  # an uninstalled client is reported, not fatal
        return f"{type(exc).__name__}: {exc}"
    return None


def server_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when unknown)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tally:
    """Seconds, client CPU and server CPU of every pass of one client and direction."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.client_cpu: list[float] = []
        self.server_cpu: list[float] = []

    def add(self, wall: float, client_cpu: float, server_cpu: float) -> None:
        self.wall.append(wall)
        self.client_cpu.append(client_cpu)
        self.server_cpu.append(server_cpu)

    def row(self, nbytes: int) -> dict[str, Any]:
        gb = nbytes / 1e9
        return {
            "gbps": gb / min(self.wall),
            "median_gbps": gb / statistics.median(self.wall),
            "client_cpu_s_per_gb": statistics.median(self.client_cpu) / gb,
            "server_cpu_s_per_gb": statistics.median(self.server_cpu) / gb,
            "seconds": self.wall,
        }


async def bench_size(
    url: str, pid: int | None, port: int, size: int, total: int, depth: int, repeats: int,
    wanted: set[str] | None,
) -> dict[str, Any]:  # fmt: skip
    n = max(depth, total // size)
    rng = np.random.default_rng(size)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    outs = [np.zeros(size, np.uint8) for _ in range(n)]
    clients = [c for c in make_clients(depth) if wanted is None or c.name in wanted]
    skipped: dict[str, str] = {}
    live: list[Client] = []
    for c in clients:
        why = await _usable(c, url, port, size)
        if why is None:
            live.append(c)
        else:
            skipped[c.name] = why
    tallies: dict[str, dict[str, Tally]] = {}

    def tally(name: str, op: str) -> Tally:
        return tallies.setdefault(name, {"set": Tally(), "get": Tally()})[op]

    shapes = [(1, depth), PARALLEL_SHAPE]
    c_names = [f"redis-benchmark -c {c} -P {p}" for c, p in shapes]
    have_c = redis_benchmark_path() is not None
    for rep in range(repeats):
        order = live[rep % len(live) :] + live[: rep % len(live)] if live else []
        for c in order:
            names = [f"rc:{c.name}:{uuid.uuid4().hex[:8]}:{i}".encode() for i in range(n)]
            for o in outs:
                o[:] = 0
            for op in ("set", "get"):
                s0, c0 = server_cpu(pid), time.process_time()
                wall = await (c.write(names, values) if op == "set" else c.read(names, outs))
                tally(c.name, op).add(wall, time.process_time() - c0, server_cpu(pid) - s0)
            if isinstance(c, Kvtier | Wire):
                bad = sum(not np.array_equal(a, b) for a, b in zip(outs, values, strict=True))
                assert bad == 0, f"{c.name}: {bad} pages read back wrong"
            await c.drop(names)
        if have_c:
            for name, (clients_, pipe) in zip(c_names, shapes, strict=True):
                s0 = server_cpu(pid)
                run = await run_redis_benchmark(url, "set", size, n, pipe, clients_, SET_KEYSPACE)
                tally(name, "set").add(run.seconds, run.cpu_seconds, server_cpu(pid) - s0)
                await drop_keys(url)
            await populate(url, size, n)
            for name, (clients_, pipe) in zip(c_names, shapes, strict=True):
                s0 = server_cpu(pid)
                run = await run_redis_benchmark(url, "get", size, n, pipe, clients_, n)
                tally(name, "get").add(run.seconds, run.cpu_seconds, server_cpu(pid) - s0)
            await drop_keys(url)
        print(f"  {fmt_size(size)} repeat {rep + 1}/{repeats} done", file=sys.stderr)
    for c in live:
        await c.close()
    nbytes = n * size
    rows = {name: {op: t.row(nbytes) for op, t in ops.items()} for name, ops in tallies.items()}
    baseline = {}
    if have_c:
        for op in ("set", "get"):
            baseline[op] = max(rows[name][op]["gbps"] for name in c_names)
        for row in rows.values():
            for op in ("set", "get"):
                row[op]["ratio"] = row[op]["gbps"] / baseline[op]
    return {"page_bytes": size, "values": n, "depth": depth, "clients": rows,
            "c_client_gbps": baseline, "c_client_rows": c_names if have_c else [],
            "skipped": skipped}  # fmt: skip


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(
            f"\n{fmt_size(r['page_bytes'])} values x {r['values']}, depth {r['depth']}: "
            "best-of-repeats GB/s (ratio to the best C-client shape); median CPU s per GB "
            "of the client and of the server"
        )
        for name, row in r["clients"].items():
            cells = []
            for op in ("set", "get"):
                x = row[op]
                ratio = f"({x['ratio']:.2f})" if "ratio" in x else ""
                cells.append(f"{op} {x['gbps']:5.2f} {ratio:6s} cpu {x['client_cpu_s_per_gb']:.2f}"
                             f"/{x['server_cpu_s_per_gb']:.2f}")  # fmt: skip
            lines.append(f"  {name:26s} " + "   ".join(cells))
        for name, why in r["skipped"].items():
            lines.append(f"  skipped {name}: {why}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    wanted = set(args.clients.split(",")) if args.clients else None
    results = []
    with RedisServer(args.server) as server:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            results.append(await bench_size(
                server.url, server.pid, server.port, size, parse_size(args.total), args.depth,
                args.repeats, wanted,
            ))  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256KiB,4MiB")
    p.add_argument("--total", default="256MiB", help="bytes per pass and client")
    p.add_argument("--depth", type=int, default=8, help="pipeline depth (pages per call)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--server", choices=["valkey", "redis"], default="valkey")
    p.add_argument("--clients", default="", help="comma-separated subset of the clients")
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument(
        "--compare-store",
        default="",
        help="LABEL=FILE: also measure the RedisStore of FILE (e.g. an earlier commit's "
        "backends/remote.py, from git show) under LABEL",
    )
    args = p.parse_args(argv)
    if args.compare_store:
        label, _, path = args.compare_store.partition("=")
        COMPARE.append((label, load_store_class(path)))
    runner: Callable[[], Awaitable[list[dict[str, Any]]]] = lambda: main_async(args)  # noqa: E731
    results = asyncio.run(runner())
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
