"""``kvtier bench io``: per tier, kvtier's write/read GB/s beside a raw baseline."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import bench_app
from kvtier.cli.output import EXIT_FAILURE, console, emit, fail, progress, run_guarded, table
from rich.markup import escape

from kvtier import registry
from kvtier.bench.io import IOBenchParams, bench_io, check_workdir, default_tiers
from kvtier.config import format_size, parse_size
from kvtier.errors import KVTierError, KVTierUsageError


def _render(data: dict[str, Any]) -> None:
    rows = [
        (
            r["tier"],
            r["kvtier_write_gbps"],
            r["baseline_write_gbps"],
            r["write_ratio"],
            r["kvtier_read_gbps"],
            r["baseline_read_gbps"],
            r["read_ratio"],
            f"{r['verified_pages']}/{r['mismatches']}",
        )
        for r in data["tiers"]
    ]
    title = (
        f"kvtier bench io: {format_size(data['page_bytes'])} pages x {data['pages']}, "
        f"median of {data['repeats']} (GB/s)"
    )
    columns = [
        "tier",
        "write",
        "base write",
        "ratio",
        "read",
        "base read",
        "ratio",
        "checked/bad",
    ]
    console.print(table(title, columns, rows))
    for r in data["tiers"]:
        line = f"baseline of {r['tier']}: {r['baseline_method']}"
        console.print(line, highlight=False, markup=False)
        for name, o in r.get("other_baselines", {}).items():
            line = (f"  also {name}: write {o['write_gbps']:.2f} GB/s (ratio "
                    f"{o['write_ratio']:.2f}), read {o['read_gbps']:.2f} GB/s (ratio "
                    f"{o['read_ratio']:.2f})")  # fmt: skip
            console.print(line, highlight=False, markup=False)
    for skip in data["skipped"]:
        console.print(f"skipped {skip['tier']}: {skip['reason']}", highlight=False, markup=False)
    for bad in data["failed"]:
        what = escape(f"{bad['tier']}: {bad['error']}")
        console.print(f"[red]failed[/] {what}", highlight=False)


def _tiers(requested: list[str] | None) -> tuple[list[str], list[dict[str, str]]]:
    """Tiers to measure, and the ones skipped (only when none was named). A tier named
    twice is a usage error (it would be measured, and reported, twice)."""
    if requested:
        repeated = sorted({n for n in requested if requested.count(n) > 1})
        if repeated:
            raise KVTierUsageError(
                f"--tier {', '.join(repeated)} is given more than once: name each tier once"
            )
        for name in requested:
            registry.resolve(name)  # unknown -> usage error; unavailable -> failure
        return list(requested), []
    return default_tiers()


@bench_app.command("io")
def bench_io_command(
    tier: Annotated[
        list[str] | None,
        typer.Option(
            "--tier",
            "-t",
            help="Backend to measure (repeatable; a registered name or module:Class). "
            "Default: every available arena, and every available store with a bench profile.",
        ),
    ] = None,
    page_size: Annotated[
        str, typer.Option("--page-size", help="Bytes per page, e.g. 256KiB, 4MiB.")
    ] = "4MiB",
    pages: Annotated[int, typer.Option("--pages", help="Pages per repeat.")] = IOBenchParams.pages,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timed repeats (medians are reported).")
    ] = IOBenchParams.repeats,
    batch: Annotated[
        int, typer.Option("--batch", help="Pages per backend call / pipeline depth.")
    ] = IOBenchParams.batch_pages,
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Directory for disk tiers (default: a temp dir)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the page contents.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Measure each tier's write and read GB/s through kvtier's backend path and a raw
    baseline on the same memory, directory or server, in the same run."""

    def body() -> None:
        if directory is not None:
            check_workdir(directory)  # before measuring anything
        params = IOBenchParams(
            page_bytes=parse_size(page_size, "--page-size"),
            pages=pages,
            repeats=repeats,
            batch_pages=batch,
            workdir=directory,
            seed=seed,
        )
        names, skipped = _tiers(tier)
        if not names:
            raise KVTierUsageError("bench io: no available tier to measure (see inspect backends)")
        results = []
        failed: list[dict[str, str]] = []
        with progress(not as_json, "bench io", len(names) * (params.repeats + 1)) as advance:
            for name in names:
                try:
                    results += asyncio.run(bench_io([name], params, lambda: advance(1)))
                except KVTierError as exc:
                    if tier:  # a tier the user named: its failure is the command's
                        raise
                    failed.append({"tier": name, "error": str(exc)})
        data = {
            "page_bytes": params.page_bytes,
            "pages": params.pages,
            "repeats": params.repeats,
            "batch_pages": params.batch_pages,
            "tiers": [r.to_dict() for r in results],
            "skipped": skipped,
            "failed": failed,
        }
        emit(data, as_json, _render)
        bad = sum(r.mismatches for r in results)
        if bad:
            raise fail(f"{bad} pages read back with wrong bytes", EXIT_FAILURE)
        if failed:
            names_failed = ", ".join(f["tier"] for f in failed)
            raise fail(f"bench io failed on {names_failed}", EXIT_FAILURE)

    run_guarded(body, as_json)
