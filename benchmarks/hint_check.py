"""Engine hints on chat-like workloads: exact, half wrong, and none.

For each generated workload (its generator writes the hints an engine could give: pinned
system prompts, ``next_turn`` with the true gap, ``close``) and capacity, prints the prefix
hit rate and share of Belady MIN of the default policy without hints, with exact hints
and with half of the hints wrong (:func:`kvtier.sim.hintnoise.corrupt_hints`), and of the
``hinted`` policy alone (prefix cuts on, no fallback to the miniatures' judgement).

    .venv/bin/python benchmarks/hint_check.py --workload chat --workload tenants \\
        --workload bursty --workload toolagent --capacity 0.01 --capacity 0.05
"""

from __future__ import annotations

import argparse
import functools

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.policy.eviction import make_policy
from kvtier.policy.prefix_cut import PrefixCutPolicy
from kvtier.sim.belady import belady_min
from kvtier.sim.hintnoise import corrupt_hints
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace
from kvtier.sim.workloads import workload


def rate(trace: Trace, cap: int, factory: object, hints: bool) -> float:
    return replay(trace, make_tiers([cap], factory), hints=hints).prefix_hit_rate  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", default=[])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--capacity", action="append", type=float, default=[])
    args = ap.parse_args()
    default = functools.partial(make_policy, args.policy)

    def hinted() -> PrefixCutPolicy:
        return PrefixCutPolicy(make_policy("hinted"))

    print("workload capacity | MIN | no hints | exact | half wrong | hinted alone (exact)")
    for name in args.workload or ["chat", "tenants", "bursty", "toolagent"]:
        tr = workload(name, n=args.requests, seed=args.seed)
        wrong = corrupt_hints(tr, 0.5, seed=args.seed + 1)
        for share in args.capacity or [0.01, 0.05]:
            cap = max(1, int(share * tr.distinct_blocks()))
            ceiling = belady_min([r.blocks for r in tr.requests], cap).ceiling
            cells = [
                rate(tr, cap, default, False),
                rate(tr, cap, default, True),
                rate(wrong, cap, default, True),
                rate(tr, cap, hinted, True),
            ]
            shown = " | ".join(f"{c:.4f} ({c / ceiling:.2f})" for c in cells)
            print(f"{name} {share * 100:g}% | {ceiling:.4f} | {shown}", flush=True)


if __name__ == "__main__":
    main()
