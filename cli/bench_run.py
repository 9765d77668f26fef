"""``kvtier bench run``: a live multi-turn chat workload on the real tiers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import bench_app
from kvtier.cli.bench_speculative import run_speculative_cli
from kvtier.cli.output import (
    console,
    emit,
    given_options,
    progress,
    render_config,
    report_failures,
    run_guarded,
    table,
)

from kvtier.bench.live import bench_run, load_base
from kvtier.bench.speculative import SpeculativeParams
from kvtier.bench.workload import ChatParams
from kvtier.config import format_size, parse_size
from kvtier.errors import KVTierUsageError
from kvtier.spec import preset

_DEFAULTS = ChatParams()
_SPEC_DEFAULTS = SpeculativeParams()


def _render(data: dict[str, Any]) -> None:
    render_config(data["config"], tier_metrics=data.get("metrics", {}).get("tiers"))
    tiers = [t["name"] for t in data["config"]["tiers"]]
    rate = data["hit_rate_by_tier"]
    hits = data["hits_by_tier"]
    rows = [(t, hits.get(t, 0), rate.get(t, 0.0)) for t in tiers]
    rows.append(("(miss)", data["pages_missed"], None))
    rows.append(("all tiers", sum(hits.values()), data["hit_rate"]))
    console.print(table("prompt pages found, by tier", ["tier", "pages", "hit rate"], rows))
    links = [
        (name, link["pages"], format_size(int(link["bytes"])), link["gb_per_s"])
        for name, link in data["links"].items()
    ]
    console.print(table("transfers per link", ["link", "pages", "bytes", "GB/s"], links))
    lat = data["fetch_latency_ms"]
    load = data["load_latency_ms"]
    console.print(
        f"turns {data['turns']}, wall {data['wall_s']:.2f} s; fetch latency (lookup + load) "
        f"p50 {_ms(lat['p50'])} p99 {_ms(lat['p99'])} over {lat['count']} fetches; "
        f"load alone p50 {_ms(load['p50'])} p99 {_ms(load['p99'])}",
        highlight=False,
    )
    pred = data.get("predictor")
    if pred is not None:
        pages = pred["pages"]
        console.print(
            f"predictor {pred['predictor']}: issued {pages['issued']}, arrived "
            f"{pages['arrived']}, late {pages['late']}, missing {pages['missing']}, "
            f"useful {pages['useful']}, wasted {pages['wasted']}",
            highlight=False,
        )
    console.print(
        f"pages stored {data['pages_stored']} (failed {data['store_failed']}), loaded "
        f"{data['pages_loaded']}, checked {data['checked_pages']}, "
        f"mismatches {data['mismatches']}",
        highlight=False,
    )
    if data["disk_dir"] is not None:  # else no file/nvme tier: no disk directory of its own
        where = "kept" if data["disk_kept"] else "removed"
        line = f"disk tier directory {data['disk_dir']} ({where})"
        console.print(line, highlight=False, markup=False)
    for failed in data["failed_tiers"]:
        console.print(f"failed: {failed['error']}", highlight=False, markup=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


@bench_app.command("run")
def bench_run_command(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="TOML file (default: $KVTIER_CONFIG or embedded)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model preset, e.g. llama3-8b, tiny.")
    ] = None,
    dram_capacity: Annotated[
        str | None,
        typer.Option(
            "--dram-capacity",
            help="Top tier capacity, e.g. 256MiB (default: the config's; when the config "
            "leaves the embedded default, a third of the workload's working set, so the run "
            "spills to disk).",
        ),
    ] = None,
    nvme_dir: Annotated[
        Path | None,
        typer.Option(
            "--nvme-dir",
            help="Directory of the disk tier, kept after the run (default: a temp dir, "
            "removed). Backend nvme when available, else file.",
        ),
    ] = None,
    sessions: Annotated[int, typer.Option("--sessions", help="Conversations.")] = (
        _DEFAULTS.sessions
    ),
    turns: Annotated[int, typer.Option("--turns", help="Turns per conversation.")] = (
        _DEFAULTS.turns
    ),
    system_prompts: Annotated[
        int, typer.Option("--system-prompts", help="Distinct shared system prompts.")
    ] = _DEFAULTS.system_prompts,
    system_tokens: Annotated[
        int, typer.Option("--system-tokens", help="Tokens per system prompt.")
    ] = _DEFAULTS.system_tokens,
    turn_tokens: Annotated[
        int,
        typer.Option("--turn-tokens", help="Mean new tokens per turn, user and reply each."),
    ] = sum(_DEFAULTS.user_tokens) // 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", help="Turns running at once.")
    ] = _DEFAULTS.concurrency,
    seed: Annotated[int, typer.Option("--seed", help="Seed of every token stream.")] = 0,
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            help="chat (multi-turn sessions) or speculative (forks and speculative steps; "
            "--sessions sets the sequences).",
        ),
    ] = "chat",
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps", help=f"speculative: decode steps per sequence [{_SPEC_DEFAULTS.steps}]."
        ),
    ] = None,
    draft_tokens: Annotated[
        int | None,
        typer.Option(
            "--draft-tokens",
            help=f"speculative: tokens proposed per step [{_SPEC_DEFAULTS.draft_tokens}].",
        ),
    ] = None,
    accept_rate: Annotated[
        float | None,
        typer.Option(
            "--accept-rate",
            help="speculative: probability each draft token passes "
            f"[{_SPEC_DEFAULTS.accept_rate}].",
        ),
    ] = None,
    fork_every: Annotated[
        int | None,
        typer.Option(
            "--fork-every",
            help=f"speculative: fork every N steps, 0: never [{_SPEC_DEFAULTS.fork_every}].",
        ),
    ] = None,
    predictor: Annotated[
        str,
        typer.Option(
            help="chat: live prefetch predictor: none | prefix | lookahead | prefix+lookahead"
        ),
    ] = "none",
    queue_delay_ms: Annotated[
        float, typer.Option(help="chat: wait between a turn's lookup and its load (queueing)")
    ] = 0.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Play multi-turn chat sessions through KVCache on the real tiers, checking every
    page read back; report hits per tier, link bandwidth and fetch latency."""

    def body() -> None:
        if workload not in ("chat", "speculative"):
            raise KVTierUsageError(f"--workload must be chat or speculative, got {workload!r}")
        if model is not None:
            try:
                preset(model)
            except KVTierUsageError as exc:  # named as the flag, not as a config key
                raise KVTierUsageError(f"--model: {exc}") from None
        if workload == "chat":
            given = given_options(ctx, ["steps", "draft_tokens", "accept_rate", "fork_every"])
            if given:
                raise KVTierUsageError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to "
                    "--workload speculative "
                    "(the chat workload has no speculative steps)"
                )
        if workload == "speculative":
            chat_only = given_options(
                ctx,
                ["turns", "system_prompts", "system_tokens", "turn_tokens", "concurrency",
                 "predictor", "queue_delay_ms"],
            )  # fmt: skip
            if chat_only:
                raise KVTierUsageError(
                    f"{', '.join(chat_only)} {'applies' if len(chat_only) == 1 else 'apply'} "
                    "only to --workload chat "
                    "(the speculative workload has no turns; --sessions sets its sequences)"
                )
            try:
                spec_params = SpeculativeParams(
                    sequences=sessions,
                    steps=_SPEC_DEFAULTS.steps if steps is None else steps,
                    draft_tokens=(
                        _SPEC_DEFAULTS.draft_tokens if draft_tokens is None else draft_tokens
                    ),
                    accept_rate=_SPEC_DEFAULTS.accept_rate if accept_rate is None else accept_rate,
                    fork_every=_SPEC_DEFAULTS.fork_every if fork_every is None else fork_every,
                    seed=seed,
                )
            except KVTierUsageError as exc:  # named as the flag, not as the field
                raise KVTierUsageError(_as_flag(str(exc))) from None
            run_speculative_cli(
                config=config,
                model=model,
                dram_capacity=dram_capacity,
                nvme_dir=nvme_dir,
                params=spec_params,
                as_json=as_json,
            )
            return
        if turn_tokens < 1:
            raise KVTierUsageError(f"--turn-tokens must be >= 1, got {turn_tokens}")
        spread = turn_tokens // 2
        params = ChatParams(
            sessions=sessions,
            turns=turns,
            system_prompts=system_prompts,
            system_tokens=system_tokens,
            user_tokens=(turn_tokens - spread, turn_tokens + spread),
            reply_tokens=(turn_tokens - spread, turn_tokens + spread),
            concurrency=concurrency,
            seed=seed,
            queue_delay_ms=queue_delay_ms,
        )
        pred = None if predictor == "none" else predictor
        if pred is not None:
            from kvtier.prefetcher import PREDICTORS

            if pred not in PREDICTORS:
                raise KVTierUsageError(
                    f"--predictor: unknown predictor {pred!r}; known: none, {', '.join(PREDICTORS)}"
                )
        top = parse_size(dram_capacity, "--dram-capacity") if dram_capacity else None
        base = load_base(config, model)
        with progress(not as_json, "bench run", params.sessions * params.turns) as advance:
            result = asyncio.run(
                bench_run(
                    base,
                    params,
                    model=model,
                    top_capacity=top,
                    disk_dir=nvme_dir,
                    on_turn=lambda: advance(1),
                    predictor=pred,
                )
            )
        data = result.to_dict()
        data["params"] = {
            "sessions": params.sessions,
            "turns": params.turns,
            "system_prompts": params.system_prompts,
            "system_tokens": params.system_tokens,
            "user_tokens": list(params.user_tokens),
            "reply_tokens": list(params.reply_tokens),
            "concurrency": params.concurrency,
            "seed": params.seed,
            "queue_delay_ms": params.queue_delay_ms,
            "predictor": predictor,
        }
        emit(data, as_json, _render)
        problems = [f["error"] for f in data["failed_tiers"]]
        if data["mismatches"]:
            problems.append(f"{data['mismatches']} pages read back with wrong bytes")
        report_failures(problems)  # the report is out: exit 1 naming what failed

    run_guarded(body, as_json)


#: The ``bench run`` flag that sets each field of the speculative workload.
_SPEC_FLAGS = {
    "sequences": "--sessions",
    "steps": "--steps",
    "draft_tokens": "--draft-tokens",
    "accept_rate": "--accept-rate",
    "fork_every": "--fork-every",
}


def _as_flag(message: str) -> str:
    """A speculative workload's refusal (``speculative workload: accept_rate must ...``)
    with the field named as the option that sets it (``--accept-rate must ...``)."""
    prefix = "speculative workload: "
    if message.startswith(prefix):
        field, _, rest = message[len(prefix) :].partition(" ")
        if field in _SPEC_FLAGS:
            return f"{_SPEC_FLAGS[field]} {rest}"
    return message
