"""``kvtier bench sim``: replay a trace or a synthetic workload through policies.

Prints, per policy and capacity: the prefix hit rate per tier and in total, Belady MIN's
ceiling at the same total capacity, pages per link, and modeled TTFT and throughput on a
hardware profile. ``--json`` prints one JSON object; ``--plot`` draws hit rate against
capacity with MIN and LRU as reference lines.

``--suite`` runs the policy suite instead (:mod:`kvtier.sim.suite`): every workload x
capacity x policy of the chosen half, a table of hit rate, share of MIN and the default
policy's gain over the best classic policy, and (``--plot``) one figure of it.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import bench_app
from kvtier.cli.output import console, emit, progress, run_guarded, table

from kvtier.errors import KVTierUsageError
from kvtier.policy.admission import FrequencyAdmission, ReusePredictor
from kvtier.policy.base import AdmissionPolicy
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy
from kvtier.policy.prefetch import LookaheadPredictor
from kvtier.sim.belady import belady_min
from kvtier.sim.cost import evaluate
from kvtier.sim.hardware import profile
from kvtier.sim.replay import WRITE_POLICIES, make_tiers, replay
from kvtier.sim.suite import CLASSIC, DEFAULT_POLICY, plot_suite, run_suite, suite_traces
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.workloads import WORKLOADS, workload
from kvtier.spec import preset

#: Policies ``bench sim`` replays when none is named: the default and the classics.
DEFAULT_POLICIES = [DEFAULT_POLICY, *CLASSIC]


def parse_capacity(text: str, distinct: int) -> int:
    """``"1%"`` or ``"0.01"`` (a share of distinct blocks) or ``"2000"`` (pages)."""
    t = text.strip()
    try:
        if t.endswith("%"):
            return max(1, int(float(t[:-1]) / 100 * distinct))
        v = float(t)
    except ValueError:
        raise KVTierUsageError(f"bad capacity {text!r}: use 1%, 0.01 or a page count") from None
    if v <= 0:
        raise KVTierUsageError(f"capacity must be > 0, got {text!r}")
    if v < 1:
        return max(1, int(v * distinct))
    if v != int(v):
        raise KVTierUsageError(f"absolute capacity must be a whole number of pages: {text!r}")
    return int(v)


def make_admission(name: str) -> AdmissionPolicy:
    """The admission policy ``name`` (``reuse`` or ``frequency``) for selective writes."""
    if name == "reuse":
        return ReusePredictor()
    if name == "frequency":
        return FrequencyAdmission()
    raise KVTierUsageError(f"unknown admission policy {name!r}; known: frequency, reuse")


def _load(trace: Path | None, name: str | None, requests: int | None, block_tokens: int) -> Trace:
    if (trace is None) == (name is None):
        raise KVTierUsageError("give exactly one of --trace FILE or --workload NAME")
    if trace is not None:
        return read_mooncake(trace, block_tokens, limit=requests)
    assert name is not None
    return workload(name, n=requests or 5000, block_tokens=block_tokens)


def run_sim(
    tr: Trace,
    policies: list[str],
    capacities: list[str],
    tier_names: list[str],
    tier_scale: float,
    write_policy: str,
    hardware: str,
    model: str,
    show_progress: bool,
    admission: str = "reuse",
    prefetch: str | None = None,
    hints: bool = False,
) -> dict[str, Any]:
    """Run every (policy, capacity) pair and return the report as plain data. With
    ``hints``, the trace's engine hints reach hint-aware policies."""
    for p in policies:
        if p not in EVICTION_POLICIES:
            known = ", ".join(sorted(EVICTION_POLICIES))
            raise KVTierUsageError(f"unknown policy {p!r}; known: {known}")
    if prefetch not in (None, "lookahead"):
        raise KVTierUsageError(f"unknown prefetch predictor {prefetch!r}; known: lookahead")
    if write_policy not in WRITE_POLICIES:
        raise KVTierUsageError(f"unknown write policy {write_policy!r}; known: {WRITE_POLICIES}")
    hw = profile(hardware)
    spec = preset(model)
    distinct = tr.distinct_blocks()
    blocks = [r.blocks for r in tr.requests]
    runs: list[dict[str, Any]] = []
    n_req = len(tr.requests)
    with progress(show_progress, "replay", len(policies) * len(capacities) * n_req) as adv:
        for cap_text in capacities:
            top = parse_capacity(cap_text, distinct)
            caps = [top] + [int(top * tier_scale**i) for i in range(1, len(tier_names))]
            ceiling = belady_min(blocks, sum(caps))
            for pol in policies:
                t0 = time.perf_counter()
                adm = (
                    {i: make_admission(admission) for i in range(1, len(caps))}
                    if write_policy == "selective"
                    else None
                )
                tiers = make_tiers(caps, functools.partial(make_policy, pol), tier_names, adm)
                predictor = LookaheadPredictor() if prefetch == "lookahead" else None
                res = replay(
                    tr,
                    tiers,
                    write_policy,  # type: ignore[arg-type]
                    predictor=predictor,
                    progress=adv,
                    hints=hints,
                )
                secs = time.perf_counter() - t0
                cost = evaluate(res, spec, hw)
                runs.append(
                    {
                        "policy": pol,
                        "capacity": cap_text,
                        "capacity_pages": caps,
                        "capacity_share": sum(caps) / distinct if distinct else 0.0,
                        "hit_rate": res.prefix_hit_rate,
                        "hit_rate_per_tier": res.tier_hit_rates(),
                        "min_hit_rate": ceiling.prefix_hit_rate,
                        "of_min": res.prefix_hit_rate / ceiling.prefix_hit_rate
                        if ceiling.prefix_hit_rate
                        else None,
                        "pages_moved": res.pages_moved,
                        "bytes_moved": {
                            k: v
                            * spec.bytes_per_token_per_layer
                            * spec.num_layers
                            * tr.block_tokens
                            for k, v in res.pages_moved.items()
                        },
                        "replay_s": secs,
                        "prefetch": res.prefetch,
                        "cost": cost.to_dict(),
                    }
                )
    return {
        "trace": tr.name,
        "requests": n_req,
        "refs": tr.total_refs,
        "distinct_blocks": distinct,
        "block_tokens": tr.block_tokens,
        "tiers": tier_names,
        "write_policy": write_policy,
        "hardware": hw.name,
        "model": spec.name,
        "admission": admission if write_policy == "selective" else None,
        "prefetch": prefetch,
        "hints": hints and bool(tr.hints),
        "runs": runs,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Hit rate vs capacity per policy, with MIN (and LRU) as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_pol: dict[str, list[tuple[float, float]]] = {}
    mins: dict[float, float] = {}
    for r in report["runs"]:
        by_pol.setdefault(r["policy"], []).append((r["capacity_share"], r["hit_rate"]))
        mins[r["capacity_share"]] = r["min_hit_rate"]
    xs = sorted(mins)
    ax.plot(xs, [mins[x] for x in xs], "k--", lw=2, label="Belady MIN (ceiling)")
    for pol, pts in by_pol.items():
        if pol == "lru":
            continue
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
    if "lru" in by_pol:  # the reference line, drawn last so no policy hides it
        pts = sorted(by_pol["lru"])
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color="gray",
            ls=":",
            lw=3,
            marker="x",
            ms=8,
            label="LRU (reference)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (share of distinct blocks, all tiers)")
    ax.set_ylabel("prefix hit rate")
    ax.set_title(f"{report['trace']}: {report['requests']} requests, {report['refs']} block refs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _render(report: dict[str, Any]) -> None:
    rows = []
    for r in report["runs"]:
        c = r["cost"]
        rows.append(
            [
                r["policy"],
                r["capacity"],
                "/".join(str(x) for x in r["capacity_pages"]),
                " ".join(f"{v:.3f}" for v in r["hit_rate_per_tier"].values()),
                r["hit_rate"],
                r["min_hit_rate"],
                r["of_min"],
                c["ttft_mean_s"],
                c["throughput_tok_s"],
                f"{c['fetches_hidden']}/{c['fetches']}",
            ]
        )
    title = (
        f"{report['trace']} ({report['requests']} req, {report['distinct_blocks']} distinct blocks)"
        f" - {report['model']} on {report['hardware']}, {report['write_policy']}"
    )
    console.print(
        table(
            title,
            [
                "policy",
                "cap",
                "pages",
                "hit/tier",
                "hit",
                "MIN",
                "of MIN",
                "TTFT s",
                "tok/s",
                "hidden",
            ],
            rows,
        )
    )


def _render_suite(report: dict[str, Any]) -> None:
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


def _suite(
    half: str,
    requests: int | None,
    trace: Path | None,
    policies: list[str] | None,
    capacities: list[str] | None,
    show_progress: bool,
) -> dict[str, Any]:
    pols = policies or DEFAULT_POLICIES
    for p in pols:
        if p not in EVICTION_POLICIES:
            raise KVTierUsageError(
                f"unknown policy {p!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
            )
    shares = [_share(c) for c in capacities] if capacities else None
    traces = suite_traces(half, requests or 4000, trace)
    kwargs: dict[str, Any] = {"policies": pols}
    if shares is not None:
        kwargs["capacities"] = shares
    n = len(traces) * len(shares or [0, 0, 0, 0])
    with progress(show_progress, "suite", n) as adv:
        report = run_suite(traces, progress=adv, **kwargs)
    report["half"] = half
    report["requests"] = requests or 4000
    report["trace"] = str(trace) if trace is not None else None
    return report


def _share(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise KVTierUsageError(f"bad suite capacity {text!r}: use 1% or 0.01") from None
    if not 0 < v <= 1:
        raise KVTierUsageError(f"suite capacities are shares in (0, 1], got {text!r}")
    return v


@bench_app.command("sim")
def sim(
    trace: Annotated[Path | None, typer.Option(help="Mooncake-format JSONL trace")] = None,
    workload_name: Annotated[
        str | None, typer.Option("--workload", help=" | ".join(WORKLOADS))
    ] = None,
    requests: Annotated[int | None, typer.Option(help="replay only the first N requests")] = None,
    block_tokens: Annotated[int, typer.Option(help="tokens per trace block")] = 512,
    capacity: Annotated[
        list[str] | None, typer.Option(help="top-tier capacity: 1%, 0.01 or pages (repeat)")
    ] = None,
    policy: Annotated[list[str] | None, typer.Option(help="eviction policy (repeat)")] = None,
    tiers: Annotated[str, typer.Option(help="tier names, top first, comma-separated")] = "hbm",
    tier_scale: Annotated[float, typer.Option(help="each lower tier = this x the one above")] = 4.0,
    write_policy: Annotated[str, typer.Option(help=", ".join(WRITE_POLICIES))] = "write-back",
    admission: Annotated[
        str, typer.Option(help="for --write-policy selective: reuse | frequency")
    ] = "reuse",
    prefetch: Annotated[
        str | None, typer.Option(help="lookahead: run the lookahead prefetch predictor")
    ] = None,
    hints: Annotated[
        bool, typer.Option("--hints/--no-hints", help="give the trace's engine hints to policies")
    ] = False,
    suite: Annotated[
        bool, typer.Option("--suite", help="run the policy suite (workload x capacity x policy)")
    ] = False,
    half: Annotated[str, typer.Option(help="suite half: held-out | tune | all")] = "held-out",
    hardware: Annotated[str, typer.Option(help="hardware profile or .json")] = "h200-gen5",
    model: Annotated[str, typer.Option(help="KVSpec preset for the cost model")] = "llama3-70b",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object on stdout")] = False,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="write a PNG plot")] = None,
    show_progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Replay a trace through eviction policies; hit rates beside Belady MIN, cost model.
    With --suite: the policy suite (--trace adds the Mooncake trace's two halves)."""

    def body() -> None:
        if suite:
            if workload_name is not None:
                raise KVTierUsageError("--suite picks its own workloads: drop --workload")
            rep = _suite(half, requests, trace, policy, capacity, show_progress)
            if plot_file is not None:
                plot_suite(rep, plot_file)
                rep["plot"] = str(plot_file)
            emit(rep, as_json, _render_suite)
            return
        tr = _load(trace, workload_name, requests, block_tokens)
        names = [t.strip() for t in tiers.split(",") if t.strip()]
        report = run_sim(
            tr,
            policy or DEFAULT_POLICIES,
            capacity or ["1%", "5%", "10%"],
            names,
            tier_scale,
            write_policy,
            hardware,
            model,
            show_progress,
            admission,
            prefetch,
            hints,
        )
        if plot_file is not None:
            plot(report, plot_file)
            report["plot"] = str(plot_file)
        emit(report, as_json, _render)

    run_guarded(body)
