"""A concurrent fuzz of :class:`~kvtier.cache.KVCache` over real tiers.

One *run* (one seed) draws a hierarchy: DRAM over one to three stores (file, NVMe-compat or
flaky file stores, some with a codec, the last one large; a flaky store fails 1-20 % of
its calls, :class:`FlakyFileStore`; given a Redis-protocol server, half the runs put one
of the stores there). It draws an eviction policy, a write policy, background eviction on
or off and a batch size. Then one to six tasks share the cache and each makes 40 random
calls on a few token sequences that share prefixes: ``store``, ``load`` then ``release``,
``read``, ``prefetch``, ``demote``, ``delete``, ``lookup``, ``hint``, ``flush``,
``reserve_private`` then ``release_private`` (an engine's working slots), and a ``store``,
``load`` or ``read`` cancelled 0-3 ms in. In half the runs with a remote tier a
second cache, DRAM over that remote tier alone, takes part of the tasks: two servers
sharing a pool, as a prefill and a decode server do. A page's bytes are a function of its
tokens, so every read can be checked.

A run fails (:class:`FuzzFailure`) when:

* a read or a reopened cache serves a byte that is not the page's (a miss is allowed);
* a call raises anything but :class:`CapacityError` (a pinned-full tier) or
  :class:`KVTierUsageError` (a delete or demote of a page another task pinned);
* a background pipeline task fails (logged ``pipeline task failed``, a kvtier bug);
* the calls, or the close, take longer than ``hang_s`` (the report names where each task
  waits);
* a page is still pinned once every task is done (each released what it loaded; a cancelled
  load must leave no pin), or a backend still holds a reservation once the pipeline is idle
  (each batch committed or aborted, each private slot given back).

After the close, the cache is opened again on the same directories: the stores recover
their pages, and every page still found must read back right.

``python tests/cache_fuzz.py FIRST LAST`` runs seeds ``FIRST`` to ``LAST - 1`` and prints a
summary; ``--outages`` also restarts (its data lost) or freezes the Valkey server at random
while a run with a remote tier makes its calls. ``tests/test_cache_fuzz.py`` runs a few
seeds in CI, some with outages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import structlog
from hang_watch import await_chain
from kvtier.backends.filestore import FileStore

from kvtier.cache import KVCache
from kvtier.errors import CapacityError, KVTierUsageError, TierIOError
from kvtier.keys import PageKey
from kvtier.spec import preset
from kvtier.testing.servers import RedisServer, unavailable_reason

SPEC = preset("tiny")
PAGE = SPEC.page_bytes
PT = SPEC.page_tokens
POLICIES = (
    "adaptive", "lru", "lru-k", "arc", "s3-fifo", "prefix-lru", "session", "density",
    "interval", "hinted",
)  # fmt: skip
OPS_PER_TASK = 40


class FlakyFileStore(FileStore):
    """A file store whose calls fail at random, as a device or a link that comes and goes
    does: a whole call raises :class:`TierIOError` before doing anything, or (``get``,
    ``delete``) some pages answer ``False`` and are left as they were. ``rate`` is the
    chance per call; ``rng`` is drawn per run from its seed."""

    rate: ClassVar[float] = 0.0
    rng: ClassVar[random.Random] = random.Random(0)
    injected: ClassVar[int] = 0

    def _fails(self) -> bool:
        fails = type(self).rng.random() < type(self).rate
        type(self).injected += fails
        return fails

    def _raise_maybe(self, what: str) -> None:
        if self._fails():
            raise TierIOError(f"injected: {what} failed")

    async def reserve(self, keys: Any, namespace: str = "") -> Any:
        self._raise_maybe("reserve")
        return await super().reserve(keys, namespace)

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        self._raise_maybe("write")
        return await super().write(reservations, data)

    async def commit(self, reservations: Any) -> list[bool]:
        self._raise_maybe("commit")
        return await super().commit(reservations)

    async def contains(self, keys: Any) -> list[bool]:
        self._raise_maybe("contains")
        return await super().contains(keys)

    async def get(self, keys: Any, out: Any) -> list[bool]:
        self._raise_maybe("get")
        served = [i for i in range(len(keys)) if not self._fails()]
        got = await super().get([keys[i] for i in served], [out[i] for i in served])
        answer = [False] * len(keys)
        for i, g in zip(served, got, strict=True):
            answer[i] = g
        return answer

    async def delete(self, keys: Any) -> list[bool]:
        self._raise_maybe("delete")
        kept = {i for i in range(len(keys)) if self._fails()}
        gone = await super().delete([k for i, k in enumerate(keys) if i not in kept])
        answer = iter(gone)
        return [False if i in kept else next(answer) for i in range(len(keys))]


class FuzzFailure(AssertionError):
    """A run broke a promise; the message says which, with the seed and its config."""


def page_bytes(prefix: np.ndarray) -> np.ndarray:
    """The bytes of the page ending ``prefix`` (smooth float16 KV, so codecs compress)."""
    digest = hashlib.blake2b(prefix.astype(np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    base = rng.standard_normal((1, 1, 1, SPEC.num_kv_heads, SPEC.head_dim))
    x = base + 0.01 * rng.standard_normal(SPEC.page_shape)
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(PAGE)


def draw_config(
    r: random.Random, root: Path, remote_url: str | None = None, label: str = "fuzz"
) -> dict[str, Any]:
    """A random small hierarchy under ``root``; with ``remote_url``, half the time one of
    the stores is a Redis-protocol tier there (its keys under ``label``)."""
    tiers: list[dict[str, Any]] = [
        {"name": "dram", "backend": "dram", "capacity": r.choice([4, 6, 8, 16]) * PAGE}
    ]
    for i in range(r.randint(1, 3)):
        backend = r.choice(["file", "file", "nvme", "cache_fuzz:FlakyFileStore"])
        options: dict[str, Any] = {"path": str(root / f"t{i}")}
        if backend == "nvme":
            options["slab_bytes"] = 1 << 20
        tier = {"name": f"t{i}", "backend": backend, "options": options,
                "capacity": r.choice([12, 24, 48, 256]) * PAGE}  # fmt: skip
        codec = r.choice([None, None, "zstd", "lz4"])
        if codec is not None:
            tier["codec"] = codec
        tiers.append(tier)
    if remote_url is not None and r.random() < 0.5:
        tier = r.choice(tiers[1:])
        tier["backend"] = "redis"
        tier["options"] = {"url": remote_url, "key_prefix": f"kvtier-{label}"}
    tiers[-1]["capacity"] = 1024 * PAGE
    FlakyFileStore.rate = r.choice([0.01, 0.05, 0.2])
    FlakyFileStore.rng = random.Random(r.random())
    FlakyFileStore.injected = 0
    eviction = r.choice(POLICIES)
    for tier in tiers:
        tier["eviction"] = eviction
    return {
        "model": {"preset": "tiny"},
        "tiers": tiers,
        "pipeline": {
            "write_policy": r.choice(["write-back", "write-through"]),
            "background_eviction": r.choice([True, False]),
            "batch_pages": r.choice([1, 2, 4]),
        },
    }


def draw_sequences(r: random.Random) -> list[np.ndarray]:
    """Two to eight token sequences of 1-12 pages; about half continue an earlier one."""
    seqs: list[np.ndarray] = []
    for _ in range(r.randint(2, 8)):
        tail = [r.randrange(50_000) for _ in range(r.randint(1, 12) * PT)]
        if seqs and r.random() < 0.5:
            base = r.choice(seqs)
            head = list(base[: r.randint(1, len(base) // PT) * PT])
            tail = head + tail
        seqs.append(np.array(tail, dtype=np.int64))
    return seqs


def check_pages(tokens: np.ndarray, out: np.ndarray, ok: list[bool], what: str) -> int:
    """Raise on a page read back wrong; returns the pages read."""
    for i, got in enumerate(ok):
        if got and not np.array_equal(out[i], page_bytes(tokens[: (i + 1) * PT])):
            raise FuzzFailure(f"{what}: page {i} of a {len(ok)}-page sequence read back wrong")
    return sum(ok)


async def calls(cache: KVCache, r: random.Random, seqs: list[np.ndarray], seen: Counter) -> None:
    """One task's random calls."""
    for _ in range(OPS_PER_TASK):
        seq = r.choice(seqs)
        n = r.randint(1, len(seq) // PT)
        tokens = seq[: n * PT]
        keys = cache.page_keys(tokens)
        some = keys[: r.randint(1, min(3, n))]
        op = r.choices(
            ["store", "load", "read", "prefetch", "demote", "delete", "lookup", "hint", "flush",
             "cancelled", "private"],
            [30, 15, 22, 5, 8, 5, 5, 5, 5, 6, 4],
        )[0]  # fmt: skip
        try:
            if op == "private":  # an engine's working pages: top-tier slots, never committed
                private = [PageKey(r.randbytes(16)) for _ in range(r.randint(1, 2))]
                slots = await cache.reserve_private(private)
                await asyncio.sleep(r.random() * 0.002)
                await cache.release_private(slots)
            elif op == "cancelled":  # a caller that gives up: a store, load or read cut short
                kind = r.choice(["store", "load", "read"])
                out = np.zeros((n, PAGE), np.uint8)
                if kind == "store":
                    rows = np.stack([page_bytes(tokens[: (i + 1) * PT]) for i in range(n)])
                    task = asyncio.ensure_future(cache.store(tokens, rows))
                else:
                    task = asyncio.ensure_future(
                        cache.load(some) if kind == "load" else cache.read(keys, out)
                    )
                await asyncio.sleep(r.random() * 0.003)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, CapacityError, KVTierUsageError):
                    got = await task  # it finished before the cancel:
                    if kind == "load":
                        cache.release(some)  # its pins are the caller's
                    elif kind == "read":
                        check_pages(tokens, out, got, "read before its cancel")
            elif op == "store":
                rows = np.stack([page_bytes(tokens[: (i + 1) * PT]) for i in range(n)])
                await cache.store(tokens, rows)
            elif op == "load":
                await cache.load(some)
                await asyncio.sleep(r.random() * 0.002)
                cache.release(some)
            elif op == "read":
                out = np.zeros((n, PAGE), np.uint8)
                seen["pages read"] += check_pages(tokens, out, await cache.read(keys, out), "read")
            elif op == "prefetch":
                await cache.prefetch(some, r.choice([0.0, 0.01, 1.0]))
            elif op == "demote":
                await cache.demote(r.choice([t.name for t in cache.tiers]), some)
            elif op == "delete":
                await cache.delete(some)
            elif op == "lookup":
                await cache.lookup(tokens)
            elif op == "hint":
                kind, value = r.choice([("open", None), ("close", None), ("next_turn", 0.5),
                                        ("ttl", 2.0), ("priority", 3.0), ("pin", None),
                                        ("unpin", None)])  # fmt: skip
                cache.hint(kind, some, value)
            else:
                await cache.flush()
            seen[op] += 1
        except (CapacityError, KVTierUsageError) as exc:
            seen[type(exc).__name__] += 1


def _where_tasks_wait() -> str:
    """Each pending task's await chain (for a hang report)."""
    lines = []
    for task in asyncio.all_tasks():
        lines.append(f"task {task.get_name()}:")
        lines.extend(f"  {line}" for line in await_chain(task))
    return "\n".join(lines)


async def _within(aws: list[Any], hang_s: float, what: str) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    _, pending = await asyncio.wait(tasks, timeout=hang_s)
    if pending:
        raise FuzzFailure(f"{what} still running after {hang_s} s:\n{_where_tasks_wait()}")
    for t in tasks:
        try:
            t.result()
        except FuzzFailure as exc:
            raise FuzzFailure(f"{what}: {exc}") from exc
        except Exception as exc:
            raise FuzzFailure(f"{what} raised {exc!r}") from exc


class _TaskFailures:
    """A structlog processor that records ``pipeline task failed`` events."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("event") == "pipeline task failed":
            self.events.append(str(event.get("error")))
        return event


async def _outages(server: RedisServer, r: random.Random, stop: asyncio.Event) -> int:
    """Restart ``server`` (its data lost) or freeze it for 0.05-0.5 s, every 0.01-0.2 s,
    until ``stop``; returns how many times."""
    count = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), r.uniform(0.01, 0.2))
        if stop.is_set():
            break  # the calls ended: no outage after them
        count += 1
        if r.random() < 0.5:
            await asyncio.to_thread(server.restart)
        else:
            server.pause()
            await asyncio.sleep(r.uniform(0.05, 0.5))
            server.resume()
    return count


async def run_one(
    seed: int,
    remote_url: str | None = None,
    hang_s: float = 60.0,
    outages: RedisServer | None = None,
) -> Counter:
    """One fuzz run (a Redis-protocol tier at ``remote_url`` in some); returns what it
    did (calls by kind, errors by type, pages read, failures injected). With
    ``outages`` (the server at ``remote_url``), a run with a remote tier has that server
    restarted or frozen at random while its calls run."""
    r = random.Random(seed)
    failures = _TaskFailures()
    before = structlog.get_config()["processors"]
    structlog.configure(processors=[failures, *before])
    seen: Counter = Counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-fuzz-") as tmp:
            cfg = draw_config(r, Path(tmp), remote_url, f"fuzz-{seed}-{Path(tmp).name}")
            where = f"seed {seed} ({cfg})"
            seqs = draw_sequences(r)
            caches = [KVCache(cfg, env={}, configure_log=False)]
            remote = [t for t in cfg["tiers"] if t["backend"] == "redis"]
            if remote and r.random() < 0.5:  # a peer sharing the remote tier (P/D, fleet)
                peer = {**cfg, "tiers": [{**cfg["tiers"][0]}, {**remote[0]}]}
                caches.append(KVCache(peer, env={}, configure_log=False))
                seen["runs with a peer cache"] += 1
            for cache in caches:
                await cache.start()
            try:
                workers = [
                    calls(caches[w % len(caches)], random.Random(seed * 1000 + w), seqs, seen)
                    for w in range(r.randint(len(caches), 6))
                ]
                stop = asyncio.Event()
                down = None
                if outages is not None and remote:
                    down = asyncio.ensure_future(_outages(outages, random.Random(~seed), stop))
                try:
                    await _within(workers, hang_s, f"{where}: the calls")
                finally:
                    stop.set()
                    if down is not None:
                        seen["remote outages"] += await down
                for cache in caches:
                    await _within([cache.pipeline.drain()], hang_s, f"{where}: drain")
                    tiers = cache.stats()["tiers"]
                    pinned = {t["name"]: t["pinned_pages"] for t in tiers}
                    if any(pinned.values()):  # every load was released, or cancelled
                        raise FuzzFailure(f"{where}: pins left after the calls: {pinned}")
                    held = {t["name"]: t["backend_stats"].get("reserved_pages", 0) for t in tiers}
                    if any(held.values()):  # every batch committed or aborted, slots given back
                        raise FuzzFailure(f"{where}: reservations left once idle: {held}")
            finally:
                closes = [cache.close() for cache in caches]
                await _within(closes, hang_s, f"{where}: close")
            reopened = KVCache(cfg, env={}, configure_log=False)
            await reopened.start()
            try:
                for tokens in seqs:
                    n = len(tokens) // PT
                    out = np.zeros((n, PAGE), np.uint8)
                    ok = await reopened.read(reopened.page_keys(tokens), out)
                    seen["pages after reopen"] += check_pages(tokens, out, ok, f"{where}: reopen")
            finally:
                await reopened.close()
            seen["injected failures"] += FlakyFileStore.injected
            seen["runs with a remote tier"] += any(t["backend"] == "redis" for t in cfg["tiers"])
            if failures.events:
                raise FuzzFailure(f"{where}: pipeline tasks failed: {failures.events[:3]}")
    finally:
        structlog.configure(processors=before)
    return seen


async def main(first: int, last: int, outages: bool = False) -> int:
    reason = unavailable_reason("valkey")
    if reason:
        print(f"no Redis-protocol tier in these runs: {reason}", flush=True)
    with contextlib.ExitStack() as stack:
        server = None if reason else stack.enter_context(RedisServer("valkey"))
        url = None if server is None else server.url
        down = server if outages else None
        return await run_seeds(
            range(first, last), lambda seed: run_one(seed, url, 90.0 if down else 60.0, down)
        )


async def run_seeds(seeds: range, one: Callable[[int], Awaitable[Counter]]) -> int:
    """``one(seed)`` for each seed: prints each failure and a summary; 1 if any failed."""
    total: Counter = Counter()
    bad = 0
    for seed in seeds:
        try:
            total += await one(seed)
        except FuzzFailure as exc:
            bad += 1
            print(f"FAIL {exc}", flush=True)
    print(f"seeds {seeds.start}-{seeds.stop - 1}: {bad} failed; {dict(sorted(total.items()))}")
    return 1 if bad else 0


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    args = [a for a in sys.argv[1:] if a != "--outages"]
    if len(args) != 2:
        sys.exit("usage: python tests/cache_fuzz.py FIRST_SEED LAST_SEED [--outages]")
    import cache_fuzz  # the module the config's "cache_fuzz:FlakyFileStore" names

    outages = "--outages" in sys.argv
    sys.exit(asyncio.run(cache_fuzz.main(int(args[0]), int(args[1]), outages)))
