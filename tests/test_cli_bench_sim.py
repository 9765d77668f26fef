"""``kvtier bench sim`` fed input an adversarial probe found escaping: each is a usage error
(exit 2) naming the option and the value, or now does what the docs say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from kvtier.cli.app import get_app
from test_cli_hardening import TRACE, invoke
from typer.testing import CliRunner

from kvtier.policy.admission import admission_names

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def sim_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(get_app(), ["bench", "sim", *args, "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def test_a_huge_block_size_of_a_trace_is_refused() -> None:
    """Before: accepted without a word (with --workload: OverflowError, a kvtier bug)."""
    error = invoke("bench", "sim", "--trace", str(TRACE), "--block-tokens",
                   "99999999999999999999999", "--policy", "lru", code=2)  # fmt: skip
    assert "--block-tokens must be at most 1,048,576" in error["message"]


def test_a_trace_whose_requests_reference_no_block_is_refused(tmp_path: Path) -> None:
    """Before: replayed, every row hit 0 beside a MIN of 0 (exit 0), and --plot warned
    that the data could not be log-scaled; the suite already refused such a trace."""
    trace = tmp_path / "empty-ids.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}\n'
        '{"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": []}\n'
    )
    error = invoke("bench", "sim", "--trace", str(trace), "--policy", "lru", code=2)
    assert f"--trace {trace}: its 2 request(s) reference no block" in error["message"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--trace", ""], "--trace: . is not a file (an empty --trace names the current"),
     (["--trace", "/nonexistent/t.jsonl", "--policy", "lru"],
      "--trace: trace file not found: /nonexistent/t.jsonl"),
     (["--suite", "--half", "x"], "--half: unknown suite half 'x'; known: held-out"),
     (["--suite", "--half", "tune", "--trace", ""], "--trace: . is not a file"),
     (["--suite", "--half", "tune", "--capacity", "2"], "--capacity: suite capacities are")],
)  # fmt: skip
def test_errors_name_the_option(args: list[str], needle: str) -> None:
    """Before: "unknown suite half 'x'", "trace . is not a file": no option named."""
    assert needle in invoke("bench", "sim", "--no-progress", *args, code=2)["message"]


def test_a_capacity_given_twice_is_replayed_once() -> None:
    """Before: ``1%`` and ``0.01`` (or ``10`` and ``10.0``) gave identical rows."""
    report = sim_json("--trace", str(TRACE), "--policy", "lru", "--capacity", "1%",
                      "--capacity", "0.01", "--capacity", "10", "--capacity", "10.0",
                      "--capacity", "5%")  # fmt: skip
    assert [r["capacity"] for r in report["runs"]] == ["1%", "10", "5%"]


def test_admission_is_used_with_selective_writes_and_all_its_names_are_documented() -> None:
    """Before: help and docs said ``reuse | frequency`` though ``all`` is accepted too."""
    report = sim_json("--workload", "chat", "--requests", "20", "--policy", "lru", "--capacity",
                      "5%", "--write-policy", "selective", "--admission", "all")  # fmt: skip
    assert report["admission"] == "all"
    command = typer.main.get_command(get_app()).commands["bench"].commands["sim"]  # type: ignore[attr-defined]
    (option,) = [p for p in command.params if p.name == "admission"]
    synopsis = [line for line in DOCS.read_text().splitlines() if "[--admission " in line]
    for name in admission_names():
        assert name in option.help.split(": ")[1].split(" | ")
        assert name in synopsis[0].split("[--admission ")[1].split("]")[0].split("|")


def test_a_suite_plot_needs_the_default_policy_and_a_classic_one(tmp_path: Path) -> None:
    """Before: an empty plot titled "adaptive (default) vs the best of lru, lru-k, arc,
    s3-fifo" though neither ran, exit 0."""
    for policies in (["lru"], ["adaptive"]):
        args = [a for p in policies for a in ("--policy", p)]
        error = invoke("bench", "sim", "--suite", "--half", "fresh", "--requests", "20",
                       "--capacity", "1%", *args, "--plot", str(tmp_path / "x.png"),
                       "--no-progress", code=2)  # fmt: skip
        assert "--plot draws adaptive's gain over the best classic policy" in error["message"]
        assert f"--policy {policies[0]} must name adaptive" in error["message"]
    assert not (tmp_path / "x.png").exists()


def test_the_suite_report_lists_the_classic_policies_that_ran(tmp_path: Path) -> None:
    """Before: ``classic`` listed all four whatever ran (and so did the plot's title)."""
    plot = tmp_path / "s.png"
    report = sim_json("--suite", "--half", "fresh", "--requests", "20", "--capacity", "5%",
                      "--policy", "adaptive", "--policy", "lru", "--policy", "arc",
                      "--plot", str(plot))  # fmt: skip
    assert report["classic"] == ["lru", "arc"] and report["policies"] == ["adaptive", "lru", "arc"]
    assert {r["best_classic"] for r in report["rows"]} <= {"lru", "arc"}
    assert plot.stat().st_size > 1000


def test_hints_asked_of_a_trace_without_hint_lines_are_warned_about() -> None:
    """Before: the replay ran without hints and said nothing (only ``"hints": false``)."""
    args = ["bench", "sim", "--trace", str(TRACE), "--policy", "lru", "--capacity", "1%"]
    result = CliRunner().invoke(get_app(), [*args, "--hints", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["hints"] is False
    assert "--hints: the trace has no hint lines" in " ".join(result.stderr.split())
    quiet = CliRunner().invoke(get_app(), [*args, "--json", "--no-progress"])
    assert "hint lines" not in quiet.stderr


def test_hint_lines_after_the_last_request_are_named_when_dropped(tmp_path: Path) -> None:
    """A hint after the last request acts on nothing and is dropped; the warning said
    "the trace has no hint lines" of a trace that had one."""
    trace = tmp_path / "late.jsonl"
    req = '{"timestamp": %d, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}\n'
    hint = '{"timestamp": %d, "hint": "close", "hash_ids": [0, 1], "value": null}\n'
    args = ["bench", "sim", "--policy", "hinted", "--capacity", "5", "--hints", "--json"]
    for lines, kept in (([req % 0, req % 1, hint % 2], False), ([req % 0, hint % 1, req % 2,
                                                              hint % 3], True)):  # fmt: skip
        trace.write_text("".join(lines))
        result = CliRunner().invoke(get_app(), [*args, "--trace", str(trace), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["hints"] is kept
        said = " ".join(result.stderr.split())
        assert "1 hint line(s) after the last request replayed were dropped" in said, said
        assert ("no hint line before a request" in said) is not kept
