"""``kvtier bench sim``: replay a trace or a synthetic workload through policies.

Prints, per policy and capacity: the prefix hit rate per tier and in total, Belady MIN's
ceiling at the same total capacity, pages per link, and modeled TTFT and throughput on a
hardware profile. ``--json`` prints one JSON object; ``--plot`` draws hit rate against
capacity with MIN and LRU as reference lines (checked before the replay: the directory
must exist, the suffix must be a format matplotlib writes).

``--suite`` runs the policy suite instead (:mod:`kvtier.sim.suite`, ``cli/bench_suite.py``):
every workload x capacity x policy of the chosen half, a table of hit rate, share of MIN
and the default policy's gain over the best classic policy, and (``--plot``) one figure.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import bench_app
from kvtier.cli.bench_suite import (
    check_suite_plot,
    check_trace_file,
    render_suite,
    run_suite_cli,
)
from kvtier.cli.output import (
    console,
    emit,
    err_console,
    fmt,
    given_options,
    progress,
    run_guarded,
    table,
)
from kvtier.cli.sim_checks import (
    check_admission,
    check_args,
    check_hardware_tiers,
    check_names,
    check_plot_path,
    hardware_profile,
    model_spec,
    parse_codec_options,
)
from kvtier.cli.sim_sizes import codec_page_factors, parse_capacity, tier_pages, unique_capacities

from kvtier.errors import KVTierUsageError
from kvtier.policy.admission import admission_names, make_admission
from kvtier.policy.eviction import make_policy
from kvtier.policy.prefetch import LookaheadPredictor
from kvtier.sim.belady import belady_min
from kvtier.sim.cost import evaluate
from kvtier.sim.replay import WRITE_POLICIES, make_tiers, replay
from kvtier.sim.suite import CLASSIC, DEFAULT_POLICY, plot_suite
from kvtier.sim.trace import Trace, read_mooncake
from kvtier.sim.workloads import WORKLOADS, workload

#: Policies ``bench sim`` replays when none is named: the suite's candidate and the classics.
DEFAULT_POLICIES = [DEFAULT_POLICY, *CLASSIC]
#: Capacities ``bench sim`` replays when none is given.
DEFAULT_CAPACITIES = ["1%", "5%", "10%"]


def _load(trace: Path | None, name: str | None, requests: int | None, block_tokens: int) -> Trace:
    """The trace to replay: ``--trace`` (its first ``requests``) or the generated
    ``--workload``. :class:`KVTierUsageError` naming ``--trace`` for a trace that cannot
    be read or whose requests reference no block (nothing to replay: every row would
    read hit rate 0 beside a MIN of 0)."""
    if (trace is None) == (name is None):
        raise KVTierUsageError("give exactly one of --trace FILE or --workload NAME")
    if name is not None:
        return workload(name, n=requests or 5000, block_tokens=block_tokens)
    assert trace is not None
    check_trace_file(trace)
    try:
        tr = read_mooncake(trace, block_tokens, limit=requests)
    except KVTierUsageError as exc:
        raise KVTierUsageError(f"--trace: {exc}") from None
    if tr.total_refs == 0:
        raise KVTierUsageError(
            f"--trace {trace}: its {len(tr.requests)} request(s) reference no block (every "
            "hash_ids is empty): nothing to replay"
        )
    return tr


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
    codecs: dict[str, str] | None = None,
    hints: bool = False,
) -> dict[str, Any]:
    """Run every (policy, capacity) pair and return the report as plain data.

    ``codecs`` maps tier names to a codec: that tier holds, in the bytes its uncoded
    capacity takes, as many pages as the live cache would (:func:`codec_page_factors`).
    With ``hints``, the trace's engine hints reach hint-aware policies.
    """
    check_names(policies, write_policy, prefetch)
    check_hardware_tiers(hardware, tier_names)
    hw = hardware_profile(hardware)
    spec = model_spec(model)
    factors = codec_page_factors(codecs or {}, tier_names, spec)
    distinct = tr.distinct_blocks()
    blocks = [r.blocks for r in tr.requests]
    runs: list[dict[str, Any]] = []
    n_req = len(tr.requests)
    sizes = [
        tier_pages(c, parse_capacity(c, distinct), tier_scale, tier_names, factors)
        for c in capacities
    ]  # all checked before the first replay
    with progress(show_progress, "replay", len(policies) * len(capacities) * n_req) as adv:
        for cap_text, caps in zip(capacities, sizes, strict=True):
            ceiling = belady_min(blocks, sum(caps))
            for pol in policies:
                t0 = time.perf_counter()
                adm = make_admission(admission) if write_policy == "selective" else None
                tiers = make_tiers(caps, functools.partial(make_policy, pol), tier_names)
                predictor = LookaheadPredictor() if prefetch == "lookahead" else None
                res = replay(
                    tr,
                    tiers,
                    write_policy,
                    predictor=predictor,
                    progress=adv,
                    admission=adm,
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
                        "min_hit_rate": ceiling.ceiling,
                        "of_min": res.prefix_hit_rate / ceiling.ceiling
                        if ceiling.ceiling
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
        "codecs": dict(codecs or {}),
        "codec_page_factors": dict(zip(tier_names, factors, strict=True)),
        "runs": runs,
    }


def make_figure(report: dict[str, Any]) -> Any:
    """The hit-rate-vs-capacity figure of a report (a matplotlib ``Figure``).

    Capacity (log axis) is labelled in percent of the distinct blocks; the hit rate axis
    starts at 0; the reference lines (Belady MIN, LRU) are drawn under the policies, thin
    and translucent, so no policy is hidden; the legend sits outside the plot area; the
    title names the trace, model, hardware, tiers and write policy.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig = Figure(figsize=(9, 4.8))
    ax = fig.add_subplot()
    by_pol: dict[str, list[tuple[float, float]]] = {}
    mins: dict[float, float] = {}
    for r in report["runs"]:
        by_pol.setdefault(r["policy"], []).append((r["capacity_share"], r["hit_rate"]))
        mins[r["capacity_share"]] = r["min_hit_rate"]
    xs = sorted(mins)
    ax.plot(xs, [mins[x] for x in xs], "k--", lw=1.2, alpha=0.7, zorder=1,
            label="Belady MIN (ceiling)")  # fmt: skip
    if "lru" in by_pol:
        pts = sorted(by_pol["lru"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="gray", ls=":", lw=1.5,
                alpha=0.8, marker="x", zorder=2, label="LRU (reference)")  # fmt: skip
    for pol, pts in by_pol.items():
        if pol == "lru":
            continue
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.8, zorder=3,
                label=pol)  # fmt: skip
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x * 100:.3g}%"))
    ax.xaxis.set_minor_locator(NullLocator())  # else minor ticks read 2x10^-2, not percent
    if xs:
        ax.set_xticks(xs)
    ax.set_xlabel("cache capacity, all tiers (% of distinct blocks)")
    ax.set_ylabel("prefix hit rate")
    top = max([1e-9, *mins.values(), *(h for pts in by_pol.values() for _, h in pts)])
    ax.set_ylim(0, min(1.0, top * 1.1) if top < 0.95 else 1.0)
    tiers = " > ".join(report.get("tiers") or [])
    ax.set_title(
        f"{report['trace']}: {report['requests']} requests, {report['refs']} block refs\n"
        f"{report['model']} on {report['hardware']}; tiers {tiers}; "
        f"{report['write_policy']}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot(report: dict[str, Any], path: Path) -> None:
    """Write :func:`make_figure` of ``report`` to ``path`` (format by suffix)."""
    make_figure(report).savefig(path, dpi=110)


def _render(report: dict[str, Any]) -> None:
    rows = []
    for r in report["runs"]:
        c = r["cost"]
        rows.append(
            [
                r["policy"],
                r["capacity"].strip(),
                "/".join(fmt(x) for x in r["capacity_pages"]),
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
        f"{report['trace']} ({fmt(report['requests'])} req, "
        f"{fmt(report['distinct_blocks'])} distinct blocks)"
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


@bench_app.command("sim")
def sim(
    ctx: typer.Context,
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
        str,
        typer.Option(help=f"for --write-policy selective: {' | '.join(admission_names())}"),
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
    half: Annotated[
        str, typer.Option(help="suite part: held-out | tune | fresh | shifts | mixes | all")
    ] = "held-out",
    hardware: Annotated[str, typer.Option(help="hardware profile or .json")] = "h200-gen5",
    model: Annotated[str, typer.Option(help="KVSpec preset for the cost model")] = "llama3-70b",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object on stdout")] = False,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="write a PNG plot")] = None,
    show_progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    codec: Annotated[
        list[str] | None,
        typer.Option(
            help="TIER=CODEC[:key=value,...]: that tier's bytes hold pages encoded so (repeat)"
        ),
    ] = None,
) -> None:
    """Replay a trace through eviction policies; hit rates beside Belady MIN, cost model.
    With --suite: the policy suite (--trace adds the Mooncake trace's two halves)."""

    def body() -> None:
        if suite:
            if workload_name is not None:
                raise KVTierUsageError("--suite picks its own workloads: drop --workload")
            unused = given_options(
                ctx,
                ["tiers", "tier_scale", "block_tokens", "write_policy", "admission",
                 "prefetch", "hints", "hardware", "model", "codec"],
            )  # fmt: skip
            if unused:
                raise KVTierUsageError(
                    "--suite replays one tier of 512-token blocks, without hints, codecs, "
                    f"prefetch or the cost model: drop {', '.join(unused)}"
                )
            if plot_file is not None:
                check_plot_path(plot_file)
                check_suite_plot(policy)
            rep = run_suite_cli(half, requests, trace, policy, capacity, show_progress)
            if plot_file is not None:
                plot_suite(rep, plot_file)
                rep["plot"] = str(plot_file)
            emit(rep, as_json, render_suite)
            return
        if given_options(ctx, ["half"]):
            raise KVTierUsageError("--half chooses a part of the policy suite: add --suite")
        names = [t.strip() for t in tiers.split(",")]
        if any(names) and not all(names):  # none at all: check_args names that
            raise KVTierUsageError(
                f"--tiers {tiers!r} has an empty tier name: give names separated by single "
                "commas (e.g. hbm,dram,nvme)"
            )
        names = [n for n in names if n]
        capacities = capacity or DEFAULT_CAPACITIES
        check_args(requests, block_tokens, tier_scale, names, admission, capacities, plot_file)
        check_admission(bool(given_options(ctx, ["admission"])), write_policy)
        check_hardware_tiers(hardware, names)
        # a policy (or a capacity) named twice is replayed once: it would give the same row
        policies = list(dict.fromkeys(policy)) if policy else DEFAULT_POLICIES
        check_names(policies, write_policy, prefetch)
        codecs = parse_codec_options(codec or [])
        codec_page_factors(codecs, names, model_spec(model))  # bad tier or codec names: now
        tr = _load(trace, workload_name, requests, block_tokens)
        report = run_sim(
            tr,
            policies,
            unique_capacities(capacities),
            names,
            tier_scale,
            write_policy,
            hardware,
            model,
            show_progress,
            admission,
            prefetch,
            codecs,
            hints,
        )
        late = (
            f"{tr.late_hints} hint line(s) after the last request replayed were dropped (a "
            "hint acts on the requests after it)"
        )
        if hints and not report["hints"]:
            what = f"no hint line before a request: {late}" if tr.late_hints else "no hint lines"
            err_console.print(
                f"[yellow]warning:[/] --hints: the trace has {what}; it was replayed without hints",
                highlight=False,
                soft_wrap=True,
            )
        elif hints and tr.late_hints:
            err_console.print(
                f"[yellow]warning:[/] --hints: {late}", highlight=False, soft_wrap=True
            )
        if plot_file is not None:
            plot(report, plot_file)
            report["plot"] = str(plot_file)
        emit(report, as_json, _render)

    run_guarded(body, as_json)
