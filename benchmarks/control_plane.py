"""Control-plane cost per page: the Python bookkeeping of ``KVCache`` beside the data time.

The bookkeeping of a page (key hashing, directory, prefix tree, policy, admission,
metrics, pipeline batches, backend slot books) does not depend on the page's size; the
data time does. So the cache is run with pages of ``--page-bytes`` (256 B by default),
whose copies cost next to nothing, and the time per page of each operation is the
bookkeeping; it is then set beside the data time of a 2 MiB page (llama3-8b) measured in
the same run: a single-threaded memcpy of 2 MiB (the cheapest data path there is, so the
share is an upper bound).

The cache: a DRAM arena over a second DRAM arena, write-through, leaf-first LRU
(``--eviction`` names another policy for both tiers; kvtier's default is ``adaptive``,
whose victim search costs far more per page, see docs/benchmarks.md). It is
first filled with ``--pages`` pages (chains of ``--chain`` pages, one ``store`` per
chain), so every operation below runs against a directory of that size:

* ``store``: new chains (the top tier evicts to make room, pages are written through to
  the second tier in the background; the time includes draining that background work);
* ``lookup``: the longest cached prefix of chains that are cached;
* ``load+release (top)``: chains whose pages are in the top tier (pinned, then released);
* ``load+release (fault)``: chains only in the second tier (moved up);
* ``page_keys``: hashing the tokens into chained page keys.

``--profile`` adds a cProfile of the ``store`` and ``load (fault)`` phases summed by
module (self time), in microseconds per page. ``--json OUT`` writes the figures.
``--rescan`` measures leaf-first eviction as it was before its one-pass walk.
``--eviction-params JSON`` sets both tiers' ``eviction_params``.

Usage::

    .venv/bin/python benchmarks/control_plane.py --pages 1000000 --profile

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvtier.cache import KVCache
from kvtier.keys import PageKey

DATA_PAGE_BYTES = 2 << 20  # llama3-8b: 32 layers x 2 x 16 tokens x 8 heads x 128 x bf16


def spec_for(page_bytes: int) -> dict[str, Any]:
    """A model whose pages are ``page_bytes`` (16 tokens of one layer, fp16)."""
    head_dim = max(1, page_bytes // (2 * 16 * 2))
    return {"num_layers": 1, "num_kv_heads": 1, "head_dim": head_dim, "dtype": "float16",
            "page_tokens": 16, "name": "control-plane"}  # fmt: skip


def memcpy_seconds(nbytes: int, pages: int = 64, repeat: int = 5) -> float:
    """Median single-threaded copy time of one page of ``nbytes``, copying ``pages``
    distinct pre-faulted pages into ``pages`` distinct destinations (so the copies come
    from memory, not from the CPU cache); best pass of ``repeat``."""
    src = [np.ones(nbytes, np.uint8) for _ in range(pages)]
    dst = [np.zeros(nbytes, np.uint8) for _ in range(pages)]
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
        best = min(best, (time.perf_counter() - t) / pages)
    return best


class Run:
    """The cache under test and the token chains it holds."""

    def __init__(
        self,
        pages: int,
        chain: int,
        page_bytes: int,
        eviction: str = "lru",
        eviction_params: dict[str, Any] | None = None,
    ) -> None:
        self.chain = chain
        self.page_bytes = page_bytes
        self.rng = np.random.default_rng(0)
        top = int(pages * 0.5)  # the top tier holds half: older chains live below only
        config = {
            "model": spec_for(page_bytes),
            "pipeline": {"batch_pages": 64},
            "tiers": [
                {"name": "dram", "backend": "dram", "capacity": top * page_bytes,
                 "eviction": eviction},
                {"name": "dram2", "backend": "dram", "capacity": (pages * 2) * page_bytes,
                 "high_watermark": 1.0, "eviction": eviction},
            ],
            "log": {"level": "warning"},
        }  # fmt: skip
        if eviction_params:
            for tier in config["tiers"]:  # type: ignore[attr-defined]
                tier["eviction_params"] = eviction_params
        self.cache = KVCache(config)
        self.chains: list[np.ndarray] = []
        self.page = np.zeros((chain, page_bytes), np.uint8)

    def tokens(self) -> np.ndarray:
        return self.rng.integers(0, 128_000, self.chain * 16, dtype=np.int64)

    async def fill(self, pages: int) -> float:
        start = time.perf_counter()
        for _ in range(pages // self.chain):
            toks = self.tokens()
            await self.cache.store(toks, self.page)
            self.chains.append(toks)
        await self.cache.pipeline.drain()
        return time.perf_counter() - start

    def keys(self, toks: np.ndarray) -> list[PageKey]:
        return self.cache.page_keys(toks)


async def timed(fn: Callable[[], Awaitable[int]]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the whole process, pages) of one phase. CPU time
    does not depend on the load of a shared machine; wall time beyond it is waiting (on
    background work, or for a core)."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    n = await fn()
    return time.perf_counter() - start, time.process_time() - cpu, n


def by_module(prof: cProfile.Profile, pages: int) -> dict[str, float]:
    """Self time per module (µs per page), kvtier modules by name, the rest grouped."""
    stats = pstats.Stats(prof)
    out: dict[str, float] = defaultdict(float)
    for (path, _line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        tottime = row[2]
        if "kvtier" in path:
            mod = path.split("kvtier/", 1)[-1]
        elif "asyncio" in path or "_contextvars" in name or "select." in name:
            mod = "asyncio (event loop, task steps, futures)"
        elif "numpy" in path or "numpy" in name:
            mod = "numpy"
        elif path == "~":
            mod = "builtins (dict, list, set operations)"
        else:
            mod = "other Python"
        out[mod] += tottime * 1e6 / pages
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    params = json.loads(args.eviction_params) if args.eviction_params else None
    run = Run(args.pages, args.chain, args.page_bytes, args.eviction, params)
    results: dict[str, Any] = {"pages": args.pages, "chain": args.chain,
                               "page_bytes": args.page_bytes,
                               "eviction": args.eviction,
                               "eviction_params": params}  # fmt: skip
    async with run.cache as cache:
        fill_s = await run.fill(args.pages)
        results["fill_us_per_page"] = fill_s / args.pages * 1e6
        results["directory_pages"] = len(cache.directory)
        k = args.sample  # chains per measured phase
        old = run.chains[:k]  # evicted from the top tier: only in dram2
        recent = run.chains[-k:]  # in the top tier

        async def store() -> int:
            for _ in range(k):
                toks = run.tokens()
                await cache.store(toks, run.page)
                run.chains.append(toks)
            await cache.pipeline.drain()
            return k * run.chain

        async def lookup() -> int:
            for toks in recent:
                await cache.lookup(toks)
            return k * run.chain

        async def load(chains: list[np.ndarray], faults: bool) -> int:
            for toks in chains:
                keys = run.keys(toks)
                res = await cache.load(keys)
                assert not res.missing
                cache.release(keys)
            if faults:  # the pages brought up push others down: count that work too
                await cache.pipeline.drain()
            return k * run.chain

        async def only_in_dram2(candidates: list[np.ndarray]) -> list[np.ndarray]:
            """``k`` chains wholly cached in dram2 alone (faults again, whatever the
            eviction policy dropped or moved meanwhile)."""
            out = []
            for toks in candidates:
                hit = await cache.lookup(toks)
                if len(hit.keys) == run.chain and set(hit.tiers) == {"dram2"}:
                    out.append(toks)
                    if len(out) == k:
                        return out
            raise SystemExit(f"profile: fewer than {k} chains left only in dram2")

        async def hashing() -> int:
            for toks in recent:
                run.keys(toks)
            return k * run.chain

        phases: dict[str, Callable[[], Awaitable[int]]] = {
            "store": store,
            "lookup": lookup,
            "load+release (top)": lambda: load(recent, False),
            "load+release (fault from dram2)": lambda: load(old, True),
            "page_keys": hashing,
        }
        rows, cpu_rows = {}, {}
        for name, fn in phases.items():
            seconds, cpu_seconds, n = await timed(fn)
            rows[name] = seconds / n * 1e6
            cpu_rows[name] = cpu_seconds / n * 1e6
        results["us_per_page"] = rows
        results["cpu_us_per_page"] = cpu_rows
        if args.profile:
            profiles = {}
            for name in ("store", "load+release (fault from dram2)"):
                fn = phases[name]
                if name.startswith("load"):
                    old[:] = await only_in_dram2(run.chains[k:])
                prof = cProfile.Profile()
                prof.enable()
                n = await fn()
                prof.disable()
                profiles[name] = by_module(prof, n)
                if args.profile_dump:
                    prof.dump_stats(f"{args.profile_dump}.{name.split()[0]}.prof")
            results["profile_us_per_page"] = profiles
    data_s = memcpy_seconds(DATA_PAGE_BYTES)
    results["data_us_per_2mib_page"] = data_s * 1e6
    results["share_of_data_time"] = {
        name: us / (data_s * 1e6) for name, us in results["us_per_page"].items()
    }
    return results


def render(r: dict[str, Any]) -> str:
    lines = [
        f"directory: {r['directory_pages']} pages ({r['page_bytes']} B each, chains of "
        f"{r['chain']}, eviction {r['eviction']}); filling took {r['fill_us_per_page']:.1f} "
        "us/page",
        f"data time of one 2 MiB page (memcpy from memory, 1 thread): "
        f"{r['data_us_per_2mib_page']:.0f} us",
        f"{'operation':34s} {'us/page':>8s} {'share of 2 MiB data time':>26s} {'CPU us/page':>12s}",
    ]
    for name, us in r["us_per_page"].items():
        lines.append(
            f"{name:34s} {us:8.2f} {r['share_of_data_time'][name] * 100:25.2f}% "
            f"{r['cpu_us_per_page'][name]:12.2f}"
        )
    for phase, mods in r.get("profile_us_per_page", {}).items():
        lines.append(f"\nprofile of {phase} (self time, us per page, cProfile):")
        for mod, us in list(mods.items())[:14]:
            lines.append(f"  {us:7.2f}  {mod}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=1_000_000, help="directory size to fill")
    p.add_argument("--chain", type=int, default=256, help="pages per stored chain")
    p.add_argument("--sample", type=int, default=32, help="chains per measured phase")
    p.add_argument("--page-bytes", type=int, default=256)
    p.add_argument(
        "--eviction",
        default="lru",
        help="eviction policy of both tiers (leaf-first on top of it, kvtier's default); "
        "default lru, as in the documented figures (kvtier's own default is adaptive)",
    )
    p.add_argument(
        "--eviction-params",
        default="",
        help='the tiers\' eviction_params as JSON, e.g. \'{"experts": ["s3-fifo"]}\'',
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--profile-dump",
        default="",
        help="with --profile: also write each phase's cProfile stats to PREFIX.PHASE.prof",
    )
    p.add_argument("--json", default="")
    p.add_argument(
        "--rescan",
        action="store_true",
        help="leaf-first eviction without the one-pass walk of the LRU order (every call "
        "rescans it, as before commit c7f8ba9), for comparison",
    )
    args = p.parse_args(argv)
    if args.rescan:
        from kvtier.policy.eviction import LRUPolicy

        LRUPolicy.ordered_keys = None  # type: ignore[assignment,method-assign]
    results = asyncio.run(main_async(args))
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
