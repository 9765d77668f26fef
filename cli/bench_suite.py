"""``kvtier bench sim --suite``: the policy suite's options, run and table.

The command itself is ``kvtier bench sim`` (``cli/bench_sim.py``); with ``--suite`` it
hands over here: every workload x capacity x policy of the chosen half
(:mod:`kvtier.sim.suite`), printed as a table or one JSON object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.cli.output import console, progress, table

from kvtier.errors import KVTierUsageError
from kvtier.policy.eviction import EVICTION_POLICIES
from kvtier.sim.suite import (
    CLASSIC,
    DEFAULT_POLICY,
    HALVES,
    MOONCAKE_PARTS,
    run_suite,
    suite_traces,
)
from kvtier.sim.workloads import MAX_GENERATED_REQUESTS


def check_policies(policies: list[str]) -> None:
    """Every ``--policy`` names an eviction policy: :class:`KVTierUsageError` naming the
    flag and the known ones otherwise (``bench sim``, with or without ``--suite``)."""
    for p in policies:
        if p not in EVICTION_POLICIES:
            known = ", ".join(sorted(EVICTION_POLICIES))
            raise KVTierUsageError(f"--policy: unknown policy {p!r}; known: {known}")


def render_suite(report: dict[str, Any]) -> None:
    """Print the suite report as a table and a summary per half."""
    pols = report["policies"]
    default = report["default"]
    rows = []
    for r in report["rows"]:
        rates = r["hit_rate"]
        best = r.get("best_classic")
        rows.append(
            [
                r["workload"],
                r["half"],
                f"{r['capacity'] * 100:g}%",
                r["capacity_pages"],
                *[rates[p] for p in pols],
                r["min_hit_rate"],
                r["of_min"].get(default),
                best or "",
                f"{r['gain']:+.4f}" if "gain" in r else "",
            ]
        )
    console.print(
        table(
            "policy suite: prefix hit rate per workload and capacity (one tier)",
            [
                "workload",
                "half",
                "cap",
                "pages",
                *pols,
                "MIN",
                f"{default} of MIN",
                "best classic",
                "gain",
            ],
            rows,
        )
    )
    for half, s in report["summary"].items():
        console.print(
            f"{half}: {s['cells']} cells, {default} ahead of the best classic in {s['ahead']}, "
            f"level in {s['level']}, behind in {s['behind']}; mean gain {s['mean_gain']:+.4f}, "
            f"smallest {s['min_gain']:+.4f}"
        )


def check_suite_plot(policies: list[str] | None) -> None:
    """``--suite --plot`` draws the default policy's gain over the best classic one: a
    ``--policy`` list must hold the default and at least one classic policy, else
    :class:`KVTierUsageError` naming both options (before: an empty plot, exit 0)."""
    pols = policies or [DEFAULT_POLICY, *CLASSIC]
    if DEFAULT_POLICY not in pols or not set(CLASSIC) & set(pols):
        raise KVTierUsageError(
            f"--plot draws {DEFAULT_POLICY}'s gain over the best classic policy "
            f"({', '.join(CLASSIC)}): --policy {' --policy '.join(pols)} must name "
            f"{DEFAULT_POLICY} and at least one of them, or drop --plot"
        )


def check_trace_file(trace: Path) -> None:
    """``--trace`` names a file: :class:`KVTierUsageError` naming the option otherwise
    (an empty ``--trace ""`` reaches here as ``.``, the current directory)."""
    if not trace.exists():
        raise KVTierUsageError(f"--trace: trace file not found: {trace}")
    if not trace.is_file():
        hint = " (an empty --trace names the current directory)" if str(trace) == "." else ""
        raise KVTierUsageError(f"--trace: {trace} is not a file{hint}")


def run_suite_cli(
    half: str,
    requests: int | None,
    trace: Path | None,
    policies: list[str] | None,
    capacities: list[str] | None,
    show_progress: bool,
) -> dict[str, Any]:
    """Run the policy suite (:func:`kvtier.sim.suite.run_suite`) on ``half``'s workloads
    (and the Mooncake ``trace``'s halves when given) for the CLI; checks the options
    first (:class:`KVTierUsageError` naming the bad one). The report's ``classic`` lists
    the classic policies that ran (the ones the ``best_classic`` of each row is chosen
    among), not every classic policy."""
    pols = policies or [DEFAULT_POLICY, *CLASSIC]
    if half not in HALVES:
        raise KVTierUsageError(f"--half: unknown suite half {half!r}; known: {', '.join(HALVES)}")
    if requests is not None and not 1 <= requests <= MAX_GENERATED_REQUESTS:
        raise KVTierUsageError(
            f"--requests must be from 1 to {MAX_GENERATED_REQUESTS:,} (requests per "
            f"generated trace), got {requests}"
        )
    if trace is not None and half not in (*MOONCAKE_PARTS, "all"):
        raise KVTierUsageError(
            f"--half {half} has no Mooncake part (the trace has only two halves): drop "
            "--trace, or use --half tune, held-out or all"
        )
    check_policies(pols)
    if trace is not None:
        check_trace_file(trace)
    shares = list(dict.fromkeys(_share(c) for c in capacities)) if capacities else None
    traces = suite_traces(half, requests or 4000, trace)
    kwargs: dict[str, Any] = {"policies": pols}
    if shares is not None:
        kwargs["capacities"] = shares
    n = len(traces) * len(shares or [0, 0, 0, 0])
    with progress(show_progress, "suite", n) as adv:
        report = run_suite(traces, progress=adv, **kwargs)
    report["classic"] = [p for p in CLASSIC if p in pols]
    report["half"] = half
    report["requests"] = requests or 4000
    report["trace"] = str(trace) if trace is not None else None
    return report


def _share(text: str) -> float:
    """A suite capacity: a share of the distinct blocks in (0, 1] (``1%``, ``0.01``);
    :class:`KVTierUsageError` naming ``--capacity`` otherwise."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise KVTierUsageError(f"--capacity: bad suite capacity {text!r}: use 1% or 0.01") from None
    if not 0 < v <= 1:
        raise KVTierUsageError(f"--capacity: suite capacities are shares in (0, 1], got {text!r}")
    return v
