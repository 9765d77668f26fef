"""The generated workloads: deterministic, prefix-consistent, with well-placed hints; and
the policy suite (``kvtier bench sim --suite``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.sim.mixes import MIXES
from kvtier.sim.scenarios import SCENARIOS
from kvtier.sim.shifts import SHIFTS
from kvtier.sim.suite import run_suite, suite_traces
from kvtier.sim.trace import Request
from kvtier.sim.workloads import WORKLOADS, workload


@pytest.mark.parametrize("name", sorted({**SCENARIOS, **SHIFTS, **MIXES}))
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


def _share_of_top(requests: list[Request], among: list[Request], first_block: int) -> float:
    """The share of ``requests`` asking for the 5 documents ``among`` asks for most (a
    document named by its first block after the system prompt, ``first_block``)."""
    counts = Counter(r.blocks[first_block] for r in among)
    top = {doc for doc, _ in counts.most_common(5)}
    return sum(r.blocks[first_block] in top for r in requests) / len(requests)


def test_shift_moves_to_new_documents_and_drift_reorders_one_pool() -> None:
    tr = workload("shift", n=3000, seed=0)  # three phases of 1,000 requests
    first, last = tr.requests[:1000], tr.requests[2000:]
    assert all(r.blocks[:2] == tr.requests[0].blocks[:2] for r in tr.requests)
    assert _share_of_top(first, first, 2) > 0.2
    old = {r.blocks[2] for r in first}
    late = sum(1 for r in last if r.blocks[2] in old) / len(last)
    assert 0 < late < 0.1  # only a tail of the first pool (carry 0.1 over two pools)
    dr = workload("drift", n=4000, seed=0)
    early, final = dr.requests[:1000], dr.requests[3000:]
    assert _share_of_top(final, early, 1) < 0.25 * _share_of_top(early, early, 1)
    still = workload("drift", n=4000, seed=0, swaps=0)  # no drift: the favourites stay
    early, final = still.requests[:1000], still.requests[3000:]
    assert _share_of_top(final, early, 1) > 0.5 * _share_of_top(early, early, 1)
    assert len({r.blocks[1] for r in dr.requests}) <= 800  # one pool of 800 documents


def test_all_workloads_are_listed() -> None:
    assert set(SCENARIOS) | set(SHIFTS) | set(MIXES) <= set(WORKLOADS)
    assert {"chat", "docqa", "agent", "zipf"} <= set(WORKLOADS)


def test_suite_halves_do_not_overlap(tmp_path: Path) -> None:
    tune = {t.label for t in suite_traces("tune")}
    held = {t.label for t in suite_traces("held-out")}
    assert tune and held and not tune & held
    fresh = {t.label for t in suite_traces("fresh")}
    shifts = {t.label for t in suite_traces("shifts")}
    assert shifts == {"shift/s10", "shift/s11", "drift/s10", "drift/s11"}
    mixes = {t.label for t in suite_traces("mixes")}
    assert mixes == {f"{w}/s{s}" for w in MIXES for s in (16, 17)}
    assert {t.label for t in suite_traces("all")} == tune | held | fresh | shifts | mixes
    assert not tune & held and not held & fresh and not tune & fresh
    assert not shifts & (tune | held | fresh) and not mixes & (tune | held | fresh | shifts)
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


def test_suite_markdown_merges_parts_into_the_docs_tables(tmp_path: Path) -> None:
    """``benchmarks/suite_markdown.py``: the JSON of parts run apart becomes one table per
    part, the best classic in bold, and summary lines counted as the suite counts them."""
    import subprocess
    import sys

    reports = []
    for half in ("shifts", "fresh"):
        out = CliRunner().invoke(
            get_app(),
            [
                "bench", "sim", "--suite", "--half", half, "--requests", "150",
                "--capacity", "5%", "--json", "--no-progress",
            ],
        )  # fmt: skip
        assert out.exit_code == 0, out.stderr
        path = tmp_path / f"{half}.json"
        path.write_text(out.stdout)
        reports.append(json.loads(out.stdout))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_markdown.py"
    png = tmp_path / "merged.png"
    proc = subprocess.run(
        [sys.executable, str(script), *(str(tmp_path / f"{h}.json") for h in ("shifts", "fresh")),
         "--plot", str(png)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and "/s" in line]
    assert len(rows) == sum(len(r["rows"]) for r in reports)
    for rep in reports:
        for half, s in rep["summary"].items():
            want = (
                f"{half}: {s['cells']} cells; adaptive ahead in {s['ahead']}, level in "
                f"{s['level']}, behind in {s['behind']}; mean gain {s['mean_gain']:+.4f}, "
                f"smallest {s['min_gain']:+.4f}."
            )
            assert want in lines
        for r in rep["rows"]:
            line = next(x for x in rows if x.startswith(f"| {r['workload']} |"))
            assert f"**{r['hit_rate'][r['best_classic']]:.4f}**" in line
            assert line.endswith(f"{r['gain']:+.4f}{' (behind)' if r['gain'] < 0 else ''} |")
    assert png.stat().st_size > 10_000
