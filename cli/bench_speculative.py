"""``kvtier bench run --workload speculative``: forks and speculative steps on real tiers.

Called by :mod:`kvtier.cli.bench_run` (it adds no command of its own).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvtier.cli.output import console, emit, progress, render_config, report_failures, table

from kvtier.bench.live import load_base
from kvtier.bench.speculative import SpeculativeParams, bench_speculative
from kvtier.config import format_size, parse_size


def _render(data: dict[str, Any]) -> None:
    render_config(data["config"], tier_metrics=data.get("metrics", {}).get("tiers"))
    rate = data["accept_rate_observed"]
    console.print(
        table(
            "speculative steps",
            ["steps", "proposed", "accepted", "accept rate", "rollbacks", "partial", "full"],
            [
                (
                    data["steps"],
                    data["tokens_proposed"],
                    data["tokens_accepted"],
                    rate,
                    data["rollbacks"],
                    data["partial_accepts"],
                    data["full_accepts"],
                )
            ],
        )
    )
    discarded = data["pages_discarded"]
    console.print(table("pages discarded, by tier", ["tier", "pages"], list(discarded.items())))
    links = [
        (name, link["pages"], format_size(int(link["bytes"])), link["gb_per_s"])
        for name, link in data["links"].items()
    ]
    console.print(table("transfers per link", ["link", "pages", "bytes", "GB/s"], links))
    console.print(
        f"sequences {data['sequences_created']} + forks {data['forks']}, copy-on-write "
        f"copies {data['cow_copies']}, pages stored {data['pages_published']}, "
        f"faults {data['resident_calls']} ({data['pages_loaded']} pages), "
        f"wall {data['seconds']:.2f} s",
        highlight=False,
    )
    console.print(
        f"checked pages {data['checked_pages']}, mismatches {data['mismatches']}, "
        f"unverified pages found stored {data['unverified_pages_stored']}",
        highlight=False,
    )
    for failed in data["failed_tiers"]:
        console.print(f"failed: {failed['error']}", highlight=False, markup=False)


def run_speculative_cli(
    *,
    config: Path | None,
    model: str | None,
    dram_capacity: str | None,
    nvme_dir: Path | None,
    params: SpeculativeParams,
    as_json: bool,
) -> None:
    """Run the workload and print its report (then exit 1 on a mismatch, a stored
    unverified page or a tier unreachable for the whole run). Raises kvtier errors for
    the caller's ``run_guarded``."""
    top = parse_size(dram_capacity, "--dram-capacity") if dram_capacity else None
    base = load_base(config, model)
    with progress(not as_json, "bench run (speculative)", params.steps) as advance:
        result = asyncio.run(
            bench_speculative(
                base,
                params,
                model=model,
                top_capacity=top,
                disk_dir=nvme_dir,
                on_step=lambda: advance(1),
            )
        )
    data = result.to_dict()
    data["params"] = {
        "sequences": params.sequences,
        "prompt_tokens": params.prompt_tokens,
        "steps": params.steps,
        "draft_tokens": params.draft_tokens,
        "accept_rate": params.accept_rate,
        "fork_every": params.fork_every,
        "max_live": params.max_live,
        "seed": params.seed,
    }
    emit(data, as_json, _render)
    problems = [f["error"] for f in data["failed_tiers"]]
    if data["mismatches"] or data["unverified_pages_stored"]:
        problems.append(
            f"{data['mismatches']} pages read back with wrong bytes, "
            f"{data['unverified_pages_stored']} unverified pages stored"
        )
    report_failures(problems)
