"""Fair room: many concurrent ``store`` callers on a small DRAM tier over the disk tier.

    .venv/bin/python benchmarks/room_fairness.py [--callers 20,240] [--seconds 20] [--rounds 3]
        [--pages 1] [--model llama3-8b] [--dram-pages 128] [--disk-pages 4096]
        [--background both|on|off|unset] [--json]

For each caller count, in the same run and on the same configuration (a ``dram`` tier of
``--dram-pages`` pages over the disk tier ``bench run`` picks, ``nvme`` when available,
default write-through), that many tasks store new sequences of ``--pages`` pages back to
back for ``--seconds``. Reported per caller count: store latency p50/p99/max (from the
call to its return, waiting for room included), stores per second, and the oldest store
still waiting when the load stopped. The figure is the ratio between the caller counts:
the goal is a p99 of at most 2 s under the larger load, and a throughput at least the
smaller load's. With ``--rounds`` above 1 every setting runs once per round, in an order
that alternates between rounds, and the medians over rounds are reported (the machine is
shared: one run alone is noisy). ``--background unset`` leaves
``pipeline.background_eviction`` out of the configuration (to run the script against a
kvtier that predates it, as a baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.live import disk_backend
from kvtier.cache import KVCache


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(np.ceil(q * len(s))) - 1))]


async def phase(
    callers: int, seconds: float, pages: int, cfg: dict[str, Any], seed: int
) -> dict[str, Any]:
    async with KVCache(cfg, env={}) as cache:
        pt = cache.spec.page_tokens
        pb = cache.spec.page_bytes
        data = np.zeros((pages, pb), dtype=np.uint8)
        rng = np.random.default_rng(seed)
        # fill the top tier first: every store of the measured phase needs room
        for _ in range(cfg["tiers"][0]["capacity"] // pb // pages + 1):
            await cache.store(rng.integers(0, 1 << 30, pages * pt), data)
        await cache.pipeline.drain()
        lat: list[float] = []
        started: dict[int, float] = {}
        stop = time.perf_counter() + seconds
        counter = iter(range(1 << 62))

        async def caller(c: int) -> None:
            r = np.random.default_rng(seed * 1000 + c)
            while time.perf_counter() < stop:
                tokens = r.integers(0, 1 << 30, pages * pt)
                me = next(counter)
                t0 = started[me] = time.perf_counter()
                res = await cache.store(tokens, data)
                del started[me]
                lat.append(time.perf_counter() - t0)
                assert all(res.stored)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(caller(c)) for c in range(callers)]
        await asyncio.sleep(seconds)
        oldest = max((time.perf_counter() - t for t in started.values()), default=0.0)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        evicted = cache.metrics.snapshot()["tiers"]["dram"]["evicted_pages"]
    return {
        "callers": callers,
        "stores": len(lat),
        "stores_per_s": len(lat) / wall,
        "p50_s": _pct(lat, 0.50),
        "p99_s": _pct(lat, 0.99),
        "max_s": max(lat),
        "oldest_waiting_at_stop_s": oldest,
        "wall_s": wall,
        "evicted_pages": evicted,
    }


def _mode(background: bool | None) -> str:
    return {True: "background", False: "inline", None: "(unset)"}[background]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--callers", default="20,240")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pages", type=int, default=1)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--dram-pages", type=int, default=128)
    ap.add_argument("--disk-pages", type=int, default=4096)
    ap.add_argument("--write-policy", default="write-through")
    ap.add_argument("--background", choices=["both", "on", "off", "unset"], default="both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(c) for c in args.callers.split(",")]
    choices: dict[str, list[bool | None]] = {
        "both": [True, False],
        "on": [True],
        "off": [False],
        "unset": [None],
    }
    modes = choices[args.background]
    disk = disk_backend()
    out: dict[str, Any] = {"params": vars(args), "disk_backend": disk, "runs": []}
    settings = [(b, n) for b in modes for n in counts]
    samples: dict[tuple[bool | None, int], list[dict[str, Any]]] = {k: [] for k in settings}
    for r in range(args.rounds):
        for background, n in settings if r % 2 == 0 else list(reversed(settings)):
            with tempfile.TemporaryDirectory(prefix="kvtier-fairness-") as tmp:
                from kvtier.spec import preset

                pb = preset(args.model).page_bytes
                cfg: dict[str, Any] = {
                    "model": {"preset": args.model},
                    "pipeline": {"write_policy": args.write_policy},
                    "log": {"level": "warning"},
                    "tiers": [
                        {"name": "dram", "backend": "dram", "capacity": args.dram_pages * pb},
                        {
                            "name": "disk",
                            "backend": disk,
                            "capacity": args.disk_pages * pb,
                            "options": {"path": str(Path(tmp) / "disk")},
                        },
                    ],
                }
                if background is not None:
                    cfg["pipeline"]["background_eviction"] = background
                samples[(background, n)].append(
                    asyncio.run(phase(n, args.seconds, args.pages, cfg, seed=n + 1000 * r))
                )
    for (background, n), rs in samples.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "callers"}
        med["max_s"] = max(x["max_s"] for x in rs)
        out["runs"].append({"callers": n, "background_eviction": background, **med})
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{args.model} ({args.pages} page(s) per store), dram {args.dram_pages} pages over "
        f"{disk}, {args.write_policy}, {args.seconds:g} s per caller count"
    )
    print(
        f"{'evictor':<11}{'callers':>8}{'stores/s':>10}{'p50 s':>8}{'p99 s':>8}{'max s':>8}"
        f"{'oldest s':>10}"
    )
    for r in out["runs"]:
        print(
            f"{_mode(r['background_eviction']):<11}{r['callers']:>8}"
            f"{r['stores_per_s']:>10.1f}{r['p50_s']:>8.3f}{r['p99_s']:>8.3f}{r['max_s']:>8.3f}"
            f"{r['oldest_waiting_at_stop_s']:>10.3f}"
        )


if __name__ == "__main__":
    main()
