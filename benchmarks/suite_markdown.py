"""The policy suite's JSON (``kvtier bench sim --suite --json``) as the markdown tables of
docs/benchmarks.md, one per part, with each part's summary line.

Several JSON files (the parts run as separate processes, side by side) are merged; the
summary lines are counted again from the merged rows (:func:`kvtier.sim.suite.summarise`).
``--plot`` draws the merged gains with :func:`kvtier.sim.suite.plot_suite`.

    for h in tune held-out fresh shifts mixes; do
      .venv/bin/kvtier bench sim --suite --half $h --json --no-progress \\
        $([ $h = tune ] || [ $h = held-out ] && echo --trace "$TRACE") > /tmp/suite-$h.json &
    done; wait
    .venv/bin/python benchmarks/suite_markdown.py /tmp/suite-*.json --plot docs/img/policy_suite.png

A formatter, not a benchmark: it replays nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.sim.suite import plot_suite, summarise


def merge(paths: list[Path]) -> dict[str, Any]:
    """The reports at ``paths`` as one (rows concatenated; they must agree on the
    policies, the classic ones and the default)."""
    merged: dict[str, Any] | None = None
    for path in paths:
        rep = json.loads(path.read_text())
        if merged is None:
            merged = {**rep, "rows": list(rep["rows"])}
            continue
        for field in ("policies", "classic", "default"):
            if rep[field] != merged[field]:
                raise SystemExit(f"{path}: {field} {rep[field]!r} differs from {merged[field]!r}")
        merged["rows"] += rep["rows"]
    if merged is None:
        raise SystemExit("give at least one suite JSON file")
    merged["summary"] = summarise(merged["rows"])
    return merged


def tables(report: dict[str, Any]) -> str:
    """One markdown table per part, the best classic rate in bold, and a summary line."""
    default, classic = report["default"], report["classic"]
    lines: list[str] = []
    for half in dict.fromkeys(r["half"] for r in report["rows"]):  # in the files' order
        s = report["summary"].get(half)
        if s is None:  # no gain: the default policy was not replayed
            continue
        lines += [
            f"| workload | cap | pages | MIN | {default} (of MIN) | "
            + " | ".join(classic)
            + " | best classic | gain |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(classic) + "---|---:|",
        ]
        for r in (r for r in report["rows"] if r["half"] == half):
            rates, best = r["hit_rate"], r["best_classic"]
            cells = [f"**{rates[c]:.4f}**" if c == best else f"{rates[c]:.4f}" for c in classic]
            gain = r["gain"]
            mark = " (behind)" if gain < 0 else ""
            lines.append(
                f"| {r['workload']} | {r['capacity'] * 100:g}% | {r['capacity_pages']} | "
                f"{r['min_hit_rate']:.4f} | {rates[default]:.4f} ({r['of_min'][default]:.2f}) | "
                + " | ".join(cells)
                + f" | {best} | {gain:+.4f}{mark} |"
            )
        lines += [
            "",
            f"{half}: {s['cells']} cells; {default} ahead in {s['ahead']}, level in "
            f"{s['level']}, behind in {s['behind']}; mean gain {s['mean_gain']:+.4f}, "
            f"smallest {s['min_gain']:+.4f}.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="suite JSON files")
    ap.add_argument("--plot", type=Path, help="also draw the merged gains here (PNG)")
    args = ap.parse_args()
    report = merge(args.reports)
    print(tables(report))
    if args.plot:
        plot_suite(report, args.plot)


if __name__ == "__main__":
    main()
