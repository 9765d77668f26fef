"""``kvtier inspect stats --url URL``: a running cache's tiers and links, from its
Prometheus endpoint."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import console, emit, fmt, run_guarded, size, table

from kvtier.metrics_scrape import cache_stats, capacity_order, parse_prometheus, scrape


def stats_report(url: str, timeout_s: float) -> dict[str, Any]:
    """:func:`~kvtier.metrics_scrape.cache_stats` of the endpoint at ``url``."""
    return cache_stats(parse_prometheus(scrape(url, timeout_s), url), url)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _render(data: dict[str, Any]) -> None:
    rows = [
        (
            name,
            f"{fmt(t['used_pages'])} / {fmt(t['capacity_pages'])}",
            _pct(t["occupancy"]),
            fmt(t["hits"]),
            fmt(t["misses"]),
            _pct(t["hit_rate"]),
            fmt(t["stored_pages"]),
            fmt(t["evicted_pages"]),
            fmt(t["dropped_pages"]),
            fmt(t["failed_pages"]),
        )
        for name, t in data["tiers"].items()
    ]
    columns = [
        "tier", "pages used", "occupancy", "hits", "misses", "hit rate", "stored", "evicted",
        "dropped", "errors",
    ]  # fmt: skip
    console.print(table(f"kvtier tiers at {data['source']}", columns, rows))
    links = [
        (name, fmt(lk["pages"]), size(lk["bytes"]), lk["gb_per_s"], fmt(lk["failed_pages"]))
        for name, lk in data["links"].items()
    ]
    console.print(table("links", ["link", "pages", "bytes", "GB/s", "errors"], links))
    lat = data["fetch_latency_s"]
    mean = "-" if lat["mean"] is None else f"{lat['mean'] * 1e3:.2f} ms"
    console.print(f"fetches {fmt(lat['count'])}, mean latency {mean}", highlight=False)
    whatif = data["whatif"]
    if whatif:
        labels = sorted({c for w in whatif.values() for c in w["estimates"]}, key=capacity_order)
        rows = [
            (name, _pct(w["measured"]), *(_pct(w["estimates"].get(c)) for c in labels))
            for name, w in whatif.items()
        ]
        title = "what-if: hit rate at or above the tier with its capacity changed by"
        console.print(table(title, ["tier", "measured", *labels], rows))


@inspect_app.command("stats")
def inspect_stats(
    url: Annotated[
        str,
        typer.Option(
            "--url",
            help="Prometheus endpoint of a process running a KVCache, e.g. "
            "http://127.0.0.1:8080/metrics (the example server's).",
        ),
    ],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 5.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show a running cache's per-tier occupancy, hit rates and errors, and per-link GB/s,
    read from its Prometheus endpoint."""
    run_guarded(lambda: emit(stats_report(url, timeout), as_json, _render), as_json)
