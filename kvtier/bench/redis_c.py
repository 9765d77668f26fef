"""The C client's speed on a Redis-protocol server: ``redis-benchmark``, run as a baseline.

The remote tier is compared with what the server can do for a client without Python in
the way. :func:`c_client_sample` times ``redis-benchmark`` (Debian ``redis-tools`` /
``redis-server``) ``SET`` and ``GET`` of values of the page size, as many as the pages
kvtier moved, on the same server, in two shapes (one connection pipelining
``depth`` commands, and 4 connections pipelining 2 each) and keeps the faster of the two
for each direction, so the baseline is the stronger of them.

Both directions do the server work kvtier's do. ``SET`` draws its keys at random from a
space of 10^9 (``-r``), so nearly every command creates a new key and a new value, as
kvtier's puts of new pages do (overwriting a few keys again and again would let the server
reuse the same, already mapped, memory). ``GET`` must read real values: before it, every
key of a space of as many keys as pages is written (untimed) with a value of the page
size, and ``GET`` picks keys at random from that space, so no reply is a short "nil".
Keys live under ``key:`` (redis-benchmark's names) and are deleted afterwards.

``redis-benchmark`` times a run in whole milliseconds: 16 pages of 64 KiB took "0 ms"
(an infinite rate) or 2-3 ms (a third apart). So each test runs at least
:data:`MIN_RUN_SECONDS` long (more commands of the same shape, up to
:data:`MAX_RUN_BYTES`) and its time is scaled back to the commands asked for.
"""

from __future__ import annotations

import asyncio
import math
import resource
import shutil
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from kvtier.errors import TierIOError

#: The second shape tried besides ``-c 1 -P depth``: connections x pipeline depth.
PARALLEL_SHAPE = (4, 2)
#: Key space of the ``SET`` runs: large enough that nearly every key is new.
SET_KEYSPACE = 10**9
#: Shortest run timed: redis-benchmark's clock ticks in milliseconds (1 % error at 0.1 s).
MIN_RUN_SECONDS = 0.1
#: Most bytes one run may move while it is lengthened to :data:`MIN_RUN_SECONDS`.
MAX_RUN_BYTES = 1 << 30


def redis_benchmark_path() -> str | None:
    """Path of ``redis-benchmark``, or ``None`` when it is not installed."""
    return shutil.which("redis-benchmark")


@dataclass(frozen=True)
class CClientRun:
    """One ``redis-benchmark`` test: seconds for ``requests`` commands of ``value_bytes``."""

    op: str
    clients: int
    pipeline: int
    requests: int
    value_bytes: int
    seconds: float
    cpu_seconds: float = 0.0  # the redis-benchmark process's user + system CPU time

    @property
    def shape(self) -> str:
        return f"-c {self.clients} -P {self.pipeline}"


def _server_args(url: str) -> list[str]:
    parts = urlsplit(url)
    args = ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    db = parts.path.strip("/")
    if db and db != "0":
        args += ["--dbnum", db]
    if parts.password is not None:
        args += ["-a", unquote(parts.password)]
        if parts.username:
            args += ["--user", unquote(parts.username)]
    if parts.scheme == "rediss":
        args += ["--tls"]
    return args


async def run_redis_benchmark(
    url: str, op: str, value_bytes: int, requests: int, pipeline: int, clients: int,
    keyspace: int,
) -> CClientRun:  # fmt: skip
    """Run ``redis-benchmark -t op`` over ``keyspace`` random keys and return its time for
    ``requests`` commands (``requests / rps``).

    When ``requests`` commands finish in under :data:`MIN_RUN_SECONDS` (or in "0 ms"), the
    test is run again with more commands, so the rate is measured over a run the
    program's millisecond clock can time; the time and CPU are scaled back to ``requests``.

    Raises :class:`~kvtier.errors.TierIOError` when the program is missing or fails.
    """
    if requests < 1:
        raise TierIOError(f"redis-benchmark needs at least 1 request, not {requests}")
    most = max(requests, MAX_RUN_BYTES // max(1, value_bytes))
    run = requests
    while True:
        rps, cpu = await _timed_run(url, op, value_bytes, run, pipeline, clients, keyspace)
        seconds = run / rps if math.isfinite(rps) else 0.0
        if seconds >= MIN_RUN_SECONDS or run >= most:
            break
        grow = 2 * MIN_RUN_SECONDS / seconds if seconds > 0 else 20.0
        run = min(most, max(run + 1, math.ceil(run * grow)))
    if not math.isfinite(rps):
        raise TierIOError(f"redis-benchmark {op} ran {run} commands too fast to time (rate {rps})")
    scale = requests / run
    return CClientRun(op, clients, pipeline, requests, value_bytes, requests / rps, cpu * scale)


async def _timed_run(
    url: str, op: str, value_bytes: int, requests: int, pipeline: int, clients: int,
    keyspace: int,
) -> tuple[float, float]:  # fmt: skip
    """One ``redis-benchmark`` process: its reported rate (possibly ``inf``) and CPU time."""
    exe = redis_benchmark_path()
    if exe is None:
        raise TierIOError("redis-benchmark is not installed (apt-get install redis-tools)")
    args = [*_server_args(url), "-t", op, "-d", str(value_bytes), "-n", str(requests),
            "-P", str(pipeline), "-c", str(clients), "-r", str(keyspace), "--csv"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        exe, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    text = out.decode(errors="replace")
    for line in text.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] == op.upper() and len(cells) > 1:
            try:
                rps = float(cells[1])
            except ValueError:
                break
            if rps > 0:  # inf passes: the caller runs longer; nan does not
                return rps, cpu
    raise TierIOError(
        f"redis-benchmark {op} gave no rate (exit {proc.returncode}): "
        f"{(text + err.decode(errors='replace'))[-300:]}"
    )


async def populate(url: str, value_bytes: int, keys: int) -> None:
    """Write ``key:<12 digits>`` for every key of the space (what ``-r`` draws from)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    value = bytes(value_bytes)
    try:
        depth = max(1, (16 << 20) // max(1, value_bytes))
        for start in range(0, keys, depth):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(keys, start + depth)):
                pipe.set(b"key:%012d" % i, value)
            await pipe.execute()
    finally:
        await client.aclose()


async def drop_keys(url: str) -> None:
    """Delete every ``key:<12 digits>`` (what the runs wrote)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        batch: list[bytes] = []
        async for name in client.scan_iter(match=b"key:" + b"[0-9]" * 12, count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                await client.unlink(*batch)
                batch.clear()
        if batch:
            await client.unlink(*batch)
    finally:
        await client.aclose()


@dataclass(frozen=True)
class CClientSample:
    """The faster shape of each direction, and every run behind it."""

    write_seconds: float
    read_seconds: float
    write_shape: str
    read_shape: str
    runs: tuple[CClientRun, ...]

    @property
    def method(self) -> str:
        return (f"redis-benchmark (C client) SET {self.write_shape} / GET {self.read_shape}, "
                "best of two shapes")  # fmt: skip


async def c_client_sample(url: str, value_bytes: int, requests: int, depth: int) -> CClientSample:
    """Time ``SET`` then ``GET`` of ``requests`` values of ``value_bytes`` on ``url`` with
    ``redis-benchmark`` in the shapes ``-c 1 -P depth`` and ``-c 4 -P 2``; keep the faster
    of each direction. The key space is written before the ``GET`` runs and dropped after.
    """
    shapes = [(1, max(1, depth)), PARALLEL_SHAPE]
    runs: list[CClientRun] = []
    try:
        for clients, pipeline in shapes:
            runs.append(await run_redis_benchmark(
                url, "set", value_bytes, requests, pipeline, clients, SET_KEYSPACE
            ))  # fmt: skip
            await drop_keys(url)
        await populate(url, value_bytes, requests)
        for clients, pipeline in shapes:
            runs.append(await run_redis_benchmark(
                url, "get", value_bytes, requests, pipeline, clients, requests
            ))  # fmt: skip
    finally:
        await drop_keys(url)
    best_w = min((r for r in runs if r.op == "set"), key=lambda r: r.seconds)
    best_r = min((r for r in runs if r.op == "get"), key=lambda r: r.seconds)
    return CClientSample(best_w.seconds, best_r.seconds, best_w.shape, best_r.shape, tuple(runs))
