"""CLI findings of an adversarial audit (bad values that escaped as internal errors or as
invalid JSON, traces a user plausibly has): each is a usage error (exit 2) naming the
option or the trace line, or works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtier.cli.app import get_app
from kvtier.cli.output import dumps
from test_cli_hardening import TRACE, invoke
from typer.testing import CliRunner


def sim_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(get_app(), ["bench", "sim", *args, "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


@pytest.mark.parametrize(
    "args",
    [["bench", "run", "--model", "tiny", "--seed", "-1"],
     ["bench", "io", "--tier", "dram", "--pages", "2", "--seed", "-1"]],
)  # fmt: skip
def test_a_negative_seed_is_a_usage_error(args: list[str]) -> None:
    """Before: numpy refused it deep in the run ("unexpected ValueError ... a kvtier bug")."""
    assert "--seed must be an integer >= 0, got -1" in invoke(*args, code=2)["message"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"flops": 0}, "flops must be a finite number > 0, got 0.0"),
     ({"links": {"dram": {"bandwidth": -1}}}, "links.dram.bandwidth must be a finite number > 0"),
     ({"mem_bw": "nan"}, "mem_bw must be a finite number > 0, got nan")],
)  # fmt: skip
def test_a_hardware_profile_with_impossible_figures_is_refused(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    """Before: flops 0 raised ZeroDivisionError; a zero, negative or NaN bandwidth gave a
    run with negative transfer times and exit 0."""
    profile = {
        "name": "mine", "flops": 2e11, "mem_bw": 2e10, "mem_bytes": 1.6e10,
        "links": {"dram": {"bandwidth": 1e10, "latency_s": 1e-6}},
        "tier_bytes": {"dram": 1.6e10},
    }  # fmt: skip
    profile.update(change)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile))
    args = ["bench", "sim", "--workload", "chat", "--requests", "20", "--tiers", "dram",
            "--no-progress"]  # fmt: skip
    assert needle in invoke(*args, "--hardware", str(path), code=2)["message"]


def test_bad_policy_names_are_refused_before_the_trace_is_read(tmp_path: Path) -> None:
    missing = tmp_path / "not-there.jsonl"
    error = invoke("bench", "sim", "--trace", str(missing), "--policy", "nope", code=2)
    assert error["message"].startswith("--policy: unknown policy 'nope'")
    error = invoke("bench", "sim", "--trace", str(missing), "--write-policy", "nope", code=2)
    assert "--write-policy: unknown write policy 'nope'; known: " in error["message"]


def test_a_trace_saved_with_a_byte_order_mark_replays_like_the_plain_one(tmp_path: Path) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + TRACE.read_bytes())
    args = ["--capacity", "5%", "--policy", "lru"]
    plain, marked = sim_json("--trace", str(TRACE), *args), sim_json("--trace", str(bom), *args)
    assert plain["runs"][0]["hit_rate"] == marked["runs"][0]["hit_rate"]


def test_a_csv_trace_is_named_as_one(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,4808,10\n")
    error = invoke("bench", "sim", "--trace", str(csv), code=2)
    assert ":1: this is a CSV" in error["message"] and "no block ids" in error["message"]


def test_the_suite_refuses_a_trace_half_without_blocks_and_a_fresh_half_with_a_trace(
    tmp_path: Path,
) -> None:
    """Before: an empty half was replayed and counted as a "level" cell (exit 0), and
    ``--half fresh`` ignored ``--trace`` without a word."""
    one = tmp_path / "one.jsonl"
    one.write_text(TRACE.read_text().splitlines()[0] + "\n")
    error = invoke("bench", "sim", "--suite", "--half", "tune", "--trace", str(one), code=2)
    assert "its first half (0 of 1 requests) references no block" in error["message"]
    error = invoke("bench", "sim", "--suite", "--half", "fresh", "--trace", str(TRACE), code=2)
    assert "--half fresh has no Mooncake part" in error["message"]
    for half in ("shifts", "mixes"):
        error = invoke("bench", "sim", "--suite", "--half", half, "--trace", str(TRACE), code=2)
        assert f"--half {half} has no Mooncake part" in error["message"]


def test_json_output_is_strict_json_even_for_non_finite_numbers() -> None:
    text = dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    assert json.loads(text, parse_constant=refuse) == {
        "a": None,
        "b": [None, 1.5],
        "c": {"d": None},
    }


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_to_a_full_disk_fails_without_a_traceback() -> None:
    """Before: the failed write was caught, then the JSON error object was written to the
    same stdout, and two chained OSError tracebacks ended the command."""
    kvtier = Path(sys.executable).parent / "kvtier"
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [str(kvtier), "inspect", "config", "--json"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "No space left" in done.stderr, done.stderr


def test_a_hardware_file_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    """Before: a JSON list said "list indices must be integers or slices, not str"."""
    listed = tmp_path / "hw.json"
    listed.write_text("[1, 2]")
    args = ["bench", "sim", "--workload", "chat", "--requests", "20", "--hardware", str(listed)]
    assert "must be a JSON object of fields" in invoke(*args, code=2)["message"]


def test_a_policy_named_twice_is_replayed_once() -> None:
    report = sim_json("--trace", str(TRACE), "--capacity", "5%", "--policy", "lru",
                      "--policy", "lru")  # fmt: skip
    assert [r["policy"] for r in report["runs"]] == ["lru"]
