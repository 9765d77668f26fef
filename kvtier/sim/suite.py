"""The policy suite behind ``kvtier bench sim --suite``: workload x capacity x policy.

Every cell replays one trace at one capacity (a share of its distinct blocks, one tier)
through the default policy and the classic ones, beside Belady MIN, and reports the hit
rate, the share of MIN and the default's gain over the best classic policy of that cell.

The workloads are split in two halves, fixed before any tuning: the *tuning* half (the
first half of the Mooncake trace; ``chat``, ``docqa``, ``toolagent``, ``tenants`` with
seeds 0 and 1) is what the default policy's parameters were chosen on; the *held-out*
half (the second half of the Mooncake trace; ``agent``, ``zipf``, ``rag``, ``bursty``,
``scan`` with seeds 2 and 3) was not looked at while tuning. The *fresh* part (the
held-out workloads with seeds 4 and 5) was first run after the parameters were last
changed, once the held-out half had been seen (no Mooncake part: the trace has only two
halves). The *shifts* part (``shift`` and ``drift``, whose popularity moves over time,
seeds 10 and 11) was added after that, a kind of traffic none of the others has, and
the *mixes* part (:mod:`kvtier.sim.mixes`: tenants in rotation, long conversations,
templates several levels deep, heavy-tailed sizes, no skew; seeds 16 and 17) after an
adversarial probe of the default policy found those shapes missing. Hints
in the generated traces are left out (the suite measures policies without engine help;
see the hint benchmarks).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config.defaults import DEFAULT_EVICTION
from kvtier.errors import KVTierUsageError
from kvtier.policy.eviction import make_policy
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.workloads import workload

#: The default eviction policy the suite measures against the classics (the config
#: default too: ``kvtier.config.defaults.DEFAULT_EVICTION``).
DEFAULT_POLICY = DEFAULT_EVICTION
#: The classic policies it is compared with.
CLASSIC: tuple[str, ...] = ("lru", "lru-k", "arc", "s3-fifo")
#: Capacities, as shares of a trace's distinct blocks.
CAPACITIES: tuple[float, ...] = (0.01, 0.05, 0.10, 0.25)
TUNE_WORKLOADS: tuple[str, ...] = ("chat", "docqa", "toolagent", "tenants")
TUNE_SEEDS: tuple[int, ...] = (0, 1)
HELD_OUT_WORKLOADS: tuple[str, ...] = ("agent", "zipf", "rag", "bursty", "scan")
HELD_OUT_SEEDS: tuple[int, ...] = (2, 3)
#: Seeds of the held-out workloads first run after the parameters were last changed
#: (the ``fresh`` part: never looked at while choosing them).
FRESH_SEEDS: tuple[int, ...] = (4, 5)
#: Workloads whose popularity moves (:mod:`kvtier.sim.shifts`), added on 2026-12-04 after
#: the parameters were last changed (the ``shifts`` part: never used to choose them).
SHIFT_WORKLOADS: tuple[str, ...] = ("shift", "drift")
SHIFT_SEEDS: tuple[int, ...] = (10, 11)
#: Workloads of :mod:`kvtier.sim.mixes`, added on 2026-12-04 (the ``mixes`` part: never
#: used to choose the parameters).
MIX_WORKLOADS: tuple[str, ...] = ("rotation", "longchat", "templates", "sizes", "uniform")
MIX_SEEDS: tuple[int, ...] = (16, 17)
HALVES: tuple[str, ...] = ("held-out", "tune", "fresh", "shifts", "mixes", "all")
#: The parts that replay a half of the Mooncake trace when one is given.
MOONCAKE_PARTS: tuple[str, ...] = ("tune", "held-out")


@dataclass(frozen=True)
class SuiteTrace:
    """One trace of the suite: its label, half and how to build it."""

    label: str
    half: str
    build: Callable[[], Trace]


def suite_traces(
    half: str = "held-out", requests: int = 4000, mooncake: Path | None = None
) -> list[SuiteTrace]:
    """The traces of ``half`` (``held-out``, ``tune``, ``fresh``, ``shifts``, ``mixes`` or
    ``all`` of them); the Mooncake halves only when ``mooncake`` names the trace file
    (``fresh``, ``shifts`` and ``mixes`` have none).
    Raises :class:`KVTierUsageError` for an unknown half or a missing trace file."""
    if half not in HALVES:
        raise KVTierUsageError(f"unknown suite half {half!r}; known: {', '.join(HALVES)}")
    if mooncake is not None and not Path(mooncake).is_file():
        raise KVTierUsageError(
            f"trace file not found: {mooncake}"
            if not Path(mooncake).exists()
            else f"trace {mooncake} is not a file"
        )
    out: list[SuiteTrace] = []
    for name, seeds, which in (
        (TUNE_WORKLOADS, TUNE_SEEDS, "tune"),
        (HELD_OUT_WORKLOADS, HELD_OUT_SEEDS, "held-out"),
        (HELD_OUT_WORKLOADS, FRESH_SEEDS, "fresh"),
        (SHIFT_WORKLOADS, SHIFT_SEEDS, "shifts"),
        (MIX_WORKLOADS, MIX_SEEDS, "mixes"),
    ):
        if half not in (which, "all"):
            continue
        if mooncake is not None and which in MOONCAKE_PARTS:
            part = "a" if which == "tune" else "b"
            out.append(
                SuiteTrace(
                    f"mooncake-{part}", which, functools.partial(mooncake_half, mooncake, part)
                )
            )
        for w in name:
            for seed in seeds:
                build = functools.partial(_generated, w, requests, seed)
                out.append(SuiteTrace(f"{w}/s{seed}", which, build))
    return out


def mooncake_half(path: Path, part: str) -> Trace:
    """The first (``part`` ``"a"``) or second (``"b"``) half of the Mooncake-format trace
    at ``path``, by requests, named ``mooncake-a`` / ``mooncake-b``."""
    tr = read_mooncake(path)
    mid = len(tr.requests) // 2
    half = (
        tr.slice(0, mid, "mooncake-a")
        if part == "a"
        else tr.slice(mid, len(tr.requests), "mooncake-b")
    )
    if half.total_refs == 0:  # an empty cell would count as "level" in the summary
        raise KVTierUsageError(
            f"trace {path}: its {'first' if part == 'a' else 'second'} half "
            f"({len(half.requests)} of {len(tr.requests)} requests) references no block; "
            "the suite replays each half of the trace"
        )
    return half


def _generated(name: str, requests: int, seed: int) -> Trace:
    return workload(name, n=requests, seed=seed).without_hints()


def run_cell(
    trace: Trace,
    share: float,
    policies: Sequence[str],
    blocks: Sequence[Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` at ``share`` of its distinct blocks through each policy; the
    cell's hit rates, MIN and the default's gain over the best classic policy."""
    distinct = trace.distinct_blocks()
    cap = max(1, int(share * distinct))
    blk = blocks if blocks is not None else [r.blocks for r in trace.requests]
    ceiling = belady_min(blk, cap).ceiling
    rates: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for pol in policies:
        t0 = time.process_time()
        res = replay(trace, make_tiers([cap], functools.partial(make_policy, pol)))
        seconds[pol] = time.process_time() - t0
        rates[pol] = res.prefix_hit_rate
    classic = {p: r for p, r in rates.items() if p in CLASSIC}
    best = max(classic, key=classic.__getitem__) if classic else None
    cell: dict[str, Any] = {
        "capacity": share,
        "capacity_pages": cap,
        "min_hit_rate": ceiling,
        "hit_rate": rates,
        "of_min": {p: (r / ceiling if ceiling else None) for p, r in rates.items()},
        "cpu_s": seconds,
        "best_classic": best,
    }
    if best is not None and DEFAULT_POLICY in rates:
        cell["gain"] = rates[DEFAULT_POLICY] - classic[best]
    return cell


ProgressFn = Callable[[int], None]


def run_suite(
    traces: Sequence[SuiteTrace],
    capacities: Sequence[float] = CAPACITIES,
    policies: Sequence[str] = (DEFAULT_POLICY, *CLASSIC),
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Every trace x capacity x policy (see :func:`run_cell`), plus a summary per half:
    cells, cells where the default is ahead of / level with / behind the best classic,
    the mean and smallest gain."""
    rows: list[dict[str, Any]] = []
    for st in traces:
        tr = st.build()
        blocks = [r.blocks for r in tr.requests]
        info = {
            "workload": st.label,
            "half": st.half,
            "requests": len(tr.requests),
            "refs": tr.total_refs,
            "distinct_blocks": tr.distinct_blocks(),
        }
        for share in capacities:
            cell = run_cell(tr, share, policies, blocks)
            rows.append({**info, **cell})
            if progress is not None:
                progress(1)
    return {
        "default": DEFAULT_POLICY,
        "classic": list(CLASSIC),
        "policies": list(policies),
        "capacities": list(capacities),
        "rows": rows,
        "summary": summarise(rows),
    }


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per half (sorted by name), over the rows with a ``gain``: cells, cells where the
    default is ahead of / level with / behind the best classic, the mean and smallest
    gain. Halves without a gain (the default not replayed) are left out."""
    summary: dict[str, dict[str, Any]] = {}
    for half in sorted({r["half"] for r in rows}):
        gains = [r["gain"] for r in rows if r["half"] == half and "gain" in r]
        if not gains:
            continue
        summary[half] = {
            "cells": len(gains),
            "ahead": sum(g > 0 for g in gains),
            "level": sum(g == 0 for g in gains),
            "behind": sum(g < 0 for g in gains),
            "mean_gain": sum(gains) / len(gains),
            "min_gain": min(gains),
        }
    return summary


def plot_suite(report: dict[str, Any], path: Path) -> None:
    """One PNG: the default policy's gain over the best classic policy of each cell, in
    points of prefix hit rate, against capacity, one line per workload (seeds averaged);
    above zero the default is ahead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in report["rows"]:
        if "gain" in r:
            groups.setdefault(r["workload"].split("/")[0], []).append(r)
    caps = sorted(report["capacities"])
    fig, ax = plt.subplots(figsize=(9, 5.2))
    markers = "osD^vP*Xhp<>"
    for i, (name, rows) in enumerate(groups.items()):
        xs, ys = [], []
        for share in caps:
            gains = [r["gain"] for r in rows if r["capacity"] == share]
            if gains:
                xs.append(share)
                ys.append(100 * sum(gains) / len(gains))
        half = "/".join(sorted({r["half"] for r in rows}))
        ax.plot(xs, ys, marker=markers[i % len(markers)], lw=1.6, label=f"{name} ({half})")
    ax.axhline(0.0, color="black", lw=1, ls="--")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(caps))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v * 100:g}%"))
    ax.set_xlabel("cache capacity (share of the trace's distinct blocks, one tier)")
    ax.set_ylabel(f"{report['default']} minus best classic\n(prefix hit rate, points)")
    ax.set_title(
        f"{report['default']} (default) vs the best of {', '.join(report['classic'])} in each cell",
        fontsize=11,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
