"""``adaptive``'s parts, each alone, and policy variants against the best classic policy.

For each cell (a trace at one capacity share, one tier, as in ``kvtier bench sim
--suite``), replays the four classic policies and the ``--policy`` specs, and prints each
spec's prefix hit rate minus the best classic's. ``--parts`` adds every point and expert
of the default ``adaptive`` alone, wrapped in the prefix cuts ``adaptive`` applies
(``p<bonus>:<order>``, ``x-<expert>``): where one of them is ahead of the best classic,
``adaptive`` trailing there is the cost of choosing online; where none is, no choice
among them can be ahead. A spec is a policy name, optionally with its parameters as a
JSON object: ``adaptive:{"start": "inf:kth"}``, ``adaptive:{"experts": ["s3-fifo"]}``.

Cells: ``WORKLOAD/sSEED@SHARE`` (a generated trace of ``--requests`` requests),
``mooncake-a@SHARE`` / ``mooncake-b@SHARE`` (the halves of ``--trace``) or
``mwLO@SHARE`` (requests ``LO`` to ``LO + --requests`` of ``--trace``).

    .venv/bin/python benchmarks/policy_parts.py \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --cell zipf/s4@0.1 --cell mw8000@0.05 --parts --policy adaptive \\
        --policy 'adaptive:{"start": "inf:kth"}' --jobs 2

Hit rates are exact and repeatable. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.errors import ConfigError
from kvtier.policy.adaptive import DEFAULT_EXPERTS, DEFAULT_POINTS
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.prefix_cut import PrefixCutPolicy
from kvtier.policy.twoclass import TwoClassPolicy
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.suite import CLASSIC, mooncake_half
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.workloads import workload


def _cut_point(bonus: float, order: str) -> EvictionPolicy:
    return PrefixCutPolicy(TwoClassPolicy(bonus, order, 8.0))


def _cut_expert(name: str) -> EvictionPolicy:
    return PrefixCutPolicy(make_policy(name))


def parts() -> dict[str, Callable[[], EvictionPolicy]]:
    """The default ``adaptive``'s points and experts, each alone with prefix cuts."""
    out: dict[str, Callable[[], EvictionPolicy]] = {}
    for point in DEFAULT_POINTS:
        bonus, _, order = point.partition(":")
        out[f"p{point}"] = functools.partial(_cut_point, float(bonus), order)
    for name in DEFAULT_EXPERTS:
        out[f"x-{name}"] = functools.partial(_cut_expert, name)
    return out


def factory(spec: str) -> Callable[[], EvictionPolicy]:
    """A policy factory for ``spec``: a part's label, or ``name[:{JSON parameters}]``."""
    known = parts()
    if spec in known:
        return known[spec]
    name, sep, args = spec.partition(":")
    params: Any = {}
    if sep:
        try:
            params = json.loads(args)
        except json.JSONDecodeError:
            params = None
        if not isinstance(params, dict):
            raise SystemExit(f"policy spec {spec!r}: after ':' give a JSON object")
    return functools.partial(make_policy, name, **params)


@functools.cache
def _trace_requests(trace: Path) -> int:
    return len(read_mooncake(trace).requests)


@functools.cache
def _note(text: str) -> None:
    """Print ``text`` on stderr once."""
    print(text, file=sys.stderr)


def check_label(label: str, trace: Path | None, requests: int = 4000) -> None:
    """Exit with a message naming the problem if ``label`` names no trace (see the module
    docstring) or a window ``mwLO`` past the end of ``trace`` (a window cut short by the
    end is noted on stderr); run before the replays start (a worker process cannot stop
    the pool)."""
    if label in ("mooncake-a", "mooncake-b") or (label.startswith("mw") and label[2:].isdigit()):
        if trace is None:
            raise SystemExit(f"cell {label!r} needs --trace")
        if label.startswith("mw"):
            lo, total = int(label[2:]), _trace_requests(trace)
            if lo >= total:
                raise SystemExit(
                    f"cell {label!r}: {trace} has {total} requests; a window from request "
                    f"{lo} holds none"
                )
            if lo + requests > total:
                _note(f"note: cell {label!r} holds {total - lo} requests, not {requests}: {trace}")
        return
    _, sep, seed = label.partition("/s")
    if not sep or not seed.isdigit():
        raise SystemExit(f"cell {label!r}: use WORKLOAD/sSEED, mooncake-a|b or mwLO")


def build(label: str, requests: int, trace: Path | None) -> Trace:
    """The trace a cell label names (checked by :func:`check_label`)."""
    if label.startswith("mooncake-") and trace is not None:
        return mooncake_half(trace, label[-1])
    if label.startswith("mw") and trace is not None:
        lo = int(label[2:])
        return read_mooncake(trace).slice(lo, lo + requests, label)
    name, _, seed = label.partition("/s")
    return workload(name, n=requests, seed=int(seed)).without_hints()


#: One cell's work: its label, capacity share, policy specs, requests and trace file.
Job = tuple[str, float, Sequence[str], int, Path | None]


def run_cell(job: Job) -> tuple[str, float, dict[str, float]]:
    """One cell's prefix hit rates, by spec."""
    label, share, specs, requests, trace = job
    tr = build(label, requests, trace)
    cap = max(1, int(share * tr.distinct_blocks()))
    return (
        label,
        share,
        {s: replay(tr, make_tiers([cap], factory(s))).prefix_hit_rate for s in specs},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", action="append", required=True, help="LABEL@SHARE (repeat)")
    ap.add_argument("--policy", action="append", default=[], help="policy spec (repeat)")
    ap.add_argument("--parts", action="store_true", help="add adaptive's parts, each alone")
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    specs = [*CLASSIC, *args.policy, *(parts() if args.parts else ())]
    for spec in specs:  # a bad spec stops here, before any replay
        try:
            factory(spec)()
        except ConfigError as exc:
            raise SystemExit(f"policy spec {spec!r}: {exc}") from None
    jobs: list[Job] = []
    for cell in args.cell:
        label, sep, share = cell.rpartition("@")
        if not sep:
            raise SystemExit(f"cell {cell!r}: use LABEL@SHARE")
        check_label(label, args.trace, args.requests)
        jobs.append((label, float(share), specs, args.requests, args.trace))
    gains: dict[str, list[float]] = {s: [] for s in specs if s not in CLASSIC}
    with Pool(max(1, args.jobs)) as pool:
        for label, share, rates in pool.imap(run_cell, jobs):
            best = max(rates[c] for c in CLASSIC)
            row = []
            for s, g in gains.items():
                g.append(rates[s] - best)
                row.append(f"{s} {g[-1]:+.4f}")
            print(
                f"{label} {share * 100:g}% best classic {best:.4f}: " + ", ".join(row), flush=True
            )
    for s, g in gains.items():
        mean = math.fsum(g) / len(g)
        ahead = sum(x > 0 for x in g)
        print(f"{s}: ahead in {ahead} of {len(g)}, mean {mean:+.4f}, min {min(g):+.4f}")


if __name__ == "__main__":
    main()
