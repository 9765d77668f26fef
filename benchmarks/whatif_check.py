"""What-if sizing against replays: the estimator's error at -50 .. +100 % capacity.

For each trace and base capacity, :class:`kvtier.sim.whatif.WhatIf` is fed the requests
once (as the live cache feeds it every lookup) and its estimates at every factor are
compared with a real replay at that capacity (one tier, the given policy). Prints one row
per (trace, base capacity) with the largest absolute error over the factors and the
sampling rate used; exits 1 when an error passes ``--bound``.

    .venv/bin/python benchmarks/whatif_check.py \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --workload chat --workload rag --policy adaptive --capacity 0.01 --capacity 0.05
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.policy.eviction import make_policy
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.whatif import FACTORS, TierModel, WhatIf, factor_label
from kvtier.sim.workloads import workload


def check(trace: Trace, policy: str, share: float, mini_pages: int) -> tuple[float, float, str]:
    """(largest absolute error, sampling rate, per-factor detail) for one base capacity."""
    cap = max(1, int(share * trace.distinct_blocks()))
    w = WhatIf([TierModel("t", cap, functools.partial(make_policy, policy))], mini_pages=mini_pages)
    for r in trace.requests:
        w.on_time(r.timestamp_s)  # as the live cache ticks its clock on every lookup
        w.on_request(r.blocks)
    est = w.estimates()["t"]
    worst = 0.0
    parts = []
    for f in (1.0, *FACTORS):
        truth = replay(
            trace, make_tiers([max(round(cap * f), 1)], functools.partial(make_policy, policy))
        ).prefix_hit_rate
        got = est["hit_rate"][factor_label(f)]
        assert got is not None
        worst = max(worst, abs(got - truth))
        parts.append(f"{factor_label(f)} {got:.3f}/{truth:.3f}")
    return worst, est["sample_rate"], ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", default=[], help="Mooncake JSONL trace")
    ap.add_argument("--workload", action="append", default=[], help="generated workload")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--capacity", action="append", type=float, default=[])
    ap.add_argument("--mini-pages", type=int, default=4096)
    ap.add_argument("--bound", type=float, default=0.02)
    args = ap.parse_args()
    traces = [read_mooncake(p) for p in args.trace] + [
        workload(w, n=args.requests, seed=args.seed).without_hints() for w in args.workload
    ]
    bad = 0
    print(f"policy {args.policy}, mini_pages {args.mini_pages}; estimate/replay per factor")
    for tr in traces:
        for share in args.capacity or [0.01, 0.05, 0.10]:
            t = time.process_time()
            worst, rate, detail = check(tr, args.policy, share, args.mini_pages)
            bad += worst > args.bound
            print(
                f"{tr.name:12} {share * 100:4g}%  max |error| {worst:.4f}  rate {rate:g}  "
                f"({time.process_time() - t:.0f} s)  {detail}",
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
