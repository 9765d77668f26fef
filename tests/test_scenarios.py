"""The generated workloads: deterministic, prefix-consistent, with well-placed hints; and
the policy suite (``kvtier bench sim --suite``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.sim.scenarios import SCENARIOS
from kvtier.sim.suite import run_suite, suite_traces
from kvtier.sim.workloads import WORKLOADS, workload


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_are_seeded_prefix_consistent_and_hinted(name: str) -> None:
    a = workload(name, n=400, seed=1)
    b = workload(name, n=400, seed=1)
    assert [r.blocks for r in a.requests] == [r.blocks for r in b.requests]
    assert [r.blocks for r in workload(name, n=400, seed=2).requests] != [
        r.blocks for r in a.requests
    ]
    assert len(a.requests) == 400
    times = [r.timestamp_s for r in a.requests]
    assert times == sorted(times)
    parent: dict[PageKey, PageKey | None] = {}
    for r in a.requests:
        prev = None
        for blk in r.blocks:
            assert parent.setdefault(blk, prev) == prev  # an id fixes its whole prefix
            prev = blk
    seen: set[PageKey] = set()
    for h in a.hints:  # every hint is placed before a request and names known pages
        assert 0 <= h.before < len(a.requests)
        if h.hint.kind in ("next_turn", "close"):
            before = {blk for r in a.requests[: h.before] for blk in r.blocks}
            assert set(h.hint.keys) <= before | seen
    assert a.distinct_blocks() < a.total_refs  # something is reused


def test_scan_has_one_hit_prompts_and_rag_shares_chunks() -> None:
    tr = workload("scan", n=1500, seed=0)
    counts: dict[PageKey, int] = {}
    for r in tr.requests:
        for blk in r.blocks:
            counts[blk] = counts.get(blk, 0) + 1
    once = sum(1 for c in counts.values() if c == 1)
    assert once > 0.5 * len(counts)  # the scans
    rag = workload("rag", n=1500, seed=0)
    firsts = {r.blocks[:3] for r in rag.requests}
    assert len(firsts) < 0.5 * len(rag.requests)  # popular topics share their top chunk


def test_all_workloads_are_listed() -> None:
    assert set(SCENARIOS) <= set(WORKLOADS)
    assert {"chat", "docqa", "agent", "zipf"} <= set(WORKLOADS)


def test_suite_halves_do_not_overlap(tmp_path: Path) -> None:
    tune = {t.label for t in suite_traces("tune")}
    held = {t.label for t in suite_traces("held-out")}
    assert tune and held and not tune & held
    fresh = {t.label for t in suite_traces("fresh")}
    assert {t.label for t in suite_traces("all")} == tune | held | fresh
    assert not tune & held and not held & fresh and not tune & fresh
    with pytest.raises(KVTierUsageError, match="unknown suite half"):
        suite_traces("middle")
    with pytest.raises(KVTierUsageError, match="not found"):
        suite_traces("tune", mooncake=tmp_path / "missing.jsonl")


def test_run_suite_reports_gain_over_the_best_classic() -> None:
    traces = [t for t in suite_traces("held-out", requests=300) if t.label == "zipf/s2"]
    rep = run_suite(traces, capacities=[0.05, 0.25])
    assert len(rep["rows"]) == 2
    for row in rep["rows"]:
        classic = {p: row["hit_rate"][p] for p in rep["classic"]}
        best = max(classic.values())
        assert row["gain"] == pytest.approx(row["hit_rate"]["adaptive"] - best)
        assert row["best_classic"] in classic and classic[row["best_classic"]] == best
        assert all(r <= row["min_hit_rate"] + 1e-12 for r in row["hit_rate"].values())
    s = rep["summary"]["held-out"]
    assert s["ahead"] + s["level"] + s["behind"] == s["cells"] == 2


def test_cli_suite_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "suite.png"
    out = CliRunner().invoke(
        get_app(),
        [
            "bench", "sim", "--suite", "--half", "tune", "--requests", "200",
            "--capacity", "5%", "--capacity", "25%", "--json", "--no-progress",
            "--plot", str(png),
        ],
    )  # fmt: skip
    assert out.exit_code == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["half"] == "tune" and rep["policies"][0] == "adaptive"
    assert len(rep["rows"]) == 2 * len(suite_traces("tune"))
    assert png.stat().st_size > 10_000
    bad = CliRunner().invoke(get_app(), ["bench", "sim", "--suite", "--workload", "chat"])
    assert bad.exit_code == 2 and "--suite picks its own workloads" in bad.stderr
    bad = CliRunner().invoke(get_app(), ["bench", "sim", "--suite", "--capacity", "150%"])
    assert bad.exit_code == 2 and "shares in (0, 1]" in bad.stderr
