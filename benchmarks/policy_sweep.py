"""Prefix hit rate of eviction policies (and parameter variants) beside Belady MIN.

Replays the Mooncake conversation trace and/or the synthetic workloads through
:func:`kvtier.sim.replay.replay` (one tier) at capacities given as shares of the distinct
blocks, and prints ``hit rate (share of MIN)`` per policy and capacity. A policy is a
config name, optionally with parameters: ``density`` or ``density:ghost_factor=2.0``.

    .venv/bin/python benchmarks/policy_sweep.py --trace ../shared/traces/\
mooncake_fast25_conversation_trace.jsonl --workload chat --policy lru --policy density

Hit rates are exact and repeatable (no timing); the CPU seconds per replay are printed
for the replay-speed goal and depend on the machine.
"""

from __future__ import annotations

import argparse
import functools
import time

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.policy.eviction import make_policy
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.workloads import workload


def _policy_spec(spec: str) -> tuple[str, dict[str, object]]:
    name, _, args = spec.partition(":")
    params: dict[str, object] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        params[key] = float(value) if "." in value else int(value)
    return name, params


def sweep(trace: Trace, policies: list[str], shares: list[float]) -> None:
    """Print one row per policy: hit rate (share of MIN) per capacity, and CPU seconds."""
    blocks = [r.blocks for r in trace.requests]
    distinct = trace.distinct_blocks()
    caps = [max(int(s * distinct), 1) for s in shares]
    mins = [belady_min(blocks, c).ceiling for c in caps]
    head = " ".join(f"{s * 100:g}%".rjust(15) for s in shares)
    print(f"\n{trace.name}: {len(blocks)} requests, {trace.total_refs} refs, {distinct} distinct")
    print(f"{'policy':32} {head}   cpu s")
    for spec in policies:
        name, params = _policy_spec(spec)
        factory = functools.partial(make_policy, name, **params)
        cells, cpu = [], 0.0
        for cap, ceiling in zip(caps, mins, strict=True):
            t = time.process_time()
            res = replay(trace, make_tiers([cap], factory))
            cpu += time.process_time() - t
            rate = res.prefix_hit_rate
            cells.append(f"{rate:.3f} ({rate / ceiling if ceiling else 0:.2f})".rjust(15))
        print(f"{spec:32} {' '.join(cells)}   {cpu / len(caps):.2f}")
    print(f"{'MIN':32} {' '.join(f'{m:.3f}'.rjust(15) for m in mins)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", default=[], help="Mooncake JSONL file")
    ap.add_argument("--workload", action="append", default=[], help="chat|docqa|agent|zipf")
    ap.add_argument("--requests", type=int, default=5000, help="requests per workload")
    ap.add_argument("--policy", action="append", default=[], help="name[:k=v,...]")
    ap.add_argument("--capacity", action="append", type=float, default=[], help="share, 0.05")
    a = ap.parse_args()
    policies = a.policy or ["lru", "arc", "session", "density"]
    shares = a.capacity or [0.01, 0.05, 0.10]
    for path in a.trace:
        sweep(read_mooncake(path), policies, shares)
    for name in a.workload:
        sweep(workload(name, n=a.requests), policies, shares)


if __name__ == "__main__":
    main()
