"""The evict queue: demand-fetch latency of ``kvtier bench run`` (write-back) with and
without the background evictor, in the same run.

    .venv/bin/python benchmarks/evict_queue.py [--rounds 3] [--sessions 16] [--turns 4]
        [--concurrency 4] [--model llama3-8b] [--top-pages N] [--json]

Each round runs the chat workload of ``bench run`` twice on the same configuration
(embedded default: a DRAM arena over the disk tier ``bench run`` picks, ``nvme`` when
available; write-back), once with ``pipeline.background_eviction = true`` and once with
``false``, alternating which goes first. Reported per setting: the fetch latency (each
``load`` of a turn's cached prefix) p50/p99/max over every round, the pages evicted from
the top tier, and the run's wall time; the ratio of the two is the figure (the run
without the background evictor is the baseline measured beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvtier.bench.live import bench_run, default_top_pages
from kvtier.bench.workload import ChatParams
from kvtier.config import load_config


async def one_run(background: bool, params: ChatParams, args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "KVTIER_PIPELINE__WRITE_POLICY": "write-back",
        "KVTIER_PIPELINE__BACKGROUND_EVICTION": "true" if background else "false",
        "KVTIER_MODEL__PRESET": args.model,
    }
    base = load_config(None, env=env)
    spec = base.config.spec
    pages = args.top_pages or default_top_pages(params, spec.page_tokens, base.config.batch_pages)
    with tempfile.TemporaryDirectory(prefix="kvtier-evict-queue-") as tmp:
        result = await bench_run(
            base, params, top_capacity=pages * spec.page_bytes, disk_dir=Path(tmp) / "disk"
        )
    report = result.to_dict()
    if report["mismatches"]:
        raise SystemExit(f"{report['mismatches']} pages read back wrong")
    return {
        "report": report,
        "metrics": result.metrics,
        "disk_backend": result.config["tiers"][1]["backend"],
        "top_pages": pages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--top-pages", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    params = ChatParams(sessions=args.sessions, turns=args.turns, concurrency=args.concurrency)
    runs: dict[str, list[dict[str, Any]]] = {"background": [], "inline": []}
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for background in order:
            out = asyncio.run(one_run(background, params, args))
            runs["background" if background else "inline"].append(out)
    summary: dict[str, Any] = {
        "model": args.model,
        "params": vars(args),
        "disk_backend": runs["inline"][0]["disk_backend"],
        "top_pages": runs["inline"][0]["top_pages"],
    }
    for name, rs in runs.items():
        p50 = [x["report"]["fetch_latency_ms"]["p50"] for x in rs]
        p99 = [x["report"]["fetch_latency_ms"]["p99"] for x in rs]
        mx = [x["report"]["fetch_latency_ms"]["max"] for x in rs]
        top = rs[0]["metrics"]["tiers"]
        top_name = next(iter(top))
        summary[name] = {
            "fetch_p50_ms": statistics.median(p50),
            "fetch_p99_ms": statistics.median(p99),
            "fetch_max_ms": max(mx),
            "loads": sum(x["report"]["fetch_latency_ms"]["count"] for x in rs),
            "evicted_pages": statistics.median(
                x["metrics"]["tiers"][top_name]["evicted_pages"] for x in rs
            ),
            "hit_rate": statistics.median(x["report"]["hit_rate"] for x in rs),
            "wall_s": statistics.median(x["report"]["wall_s"] for x in rs),
        }
    b, i = summary["background"], summary["inline"]
    summary["ratio_background_over_inline"] = {
        "fetch_p50": b["fetch_p50_ms"] / i["fetch_p50_ms"],
        "fetch_p99": b["fetch_p99_ms"] / i["fetch_p99_ms"],
        "wall": b["wall_s"] / i["wall_s"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"model {args.model}, top tier {summary['top_pages']} pages over "
        f"{summary['disk_backend']}, write-back, {args.rounds} rounds"
    )
    print(f"{'evictor':<12}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'evicted':>10}{'hit':>8}")
    for name in ("inline", "background"):
        s = summary[name]
        print(
            f"{name:<12}{s['fetch_p50_ms']:>10.2f}{s['fetch_p99_ms']:>10.2f}"
            f"{s['fetch_max_ms']:>10.2f}{s['evicted_pages']:>10.0f}{s['hit_rate']:>8.3f}"
        )
    ratio = summary["ratio_background_over_inline"]
    print(f"background / inline: p50 {ratio['fetch_p50']:.2f}, p99 {ratio['fetch_p99']:.2f}")


if __name__ == "__main__":
    main()
