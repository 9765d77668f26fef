"""Hardware profiles read from JSON (``kvtier bench sim --hardware FILE.json``): every
figure is a JSON number within a physical range, and anything else is a usage error naming
the file, the field and the value (never an OverflowError or RecursionError, never a
profile that makes the cost model's times infinite or NaN)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.errors import KVTierUsageError
from kvtier.sim.hardware import MAX_GPUS, load_profile

GOOD: dict[str, Any] = {
    "name": "mine", "gpus": 1, "flops": 2e11, "mem_bw": 2e10, "mem_bytes": 1.6e10,
    "links": {"dram": {"bandwidth": 1e10, "latency_s": 1e-6}},
    "tier_bytes": {"dram": 1.6e10},
}  # fmt: skip


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hw.json"
    path.write_text(text)
    return path


def test_a_good_profile_loads(tmp_path: Path) -> None:
    hw = load_profile(_write(tmp_path, json.dumps(GOOD)))
    assert (hw.gpus, hw.flops, hw.links["dram"].bandwidth) == (1, 2e11, 1e10)
    no_gpu = load_profile(_write(tmp_path, json.dumps({**GOOD, "gpus": 0})))  # a CPU node
    assert no_gpu.gpus == 0


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        # before: OverflowError (int(inf), float(10**400)), reported as a kvtier bug
        ({"gpus": "__inf__"}, "gpus must be an integer from 0 to 1048576, got inf"),
        ({"flops": "__big__"}, "flops must be a finite number > 0, got a 401-digit integer"),
        ({"links": {"dram": {"bandwidth": "__big__"}}},
         "links.dram.bandwidth must be a finite number > 0, got a 401-digit integer"),
        # before: accepted, then inf/NaN times and numpy RuntimeWarnings in the cost model
        ({"flops": 5e-324}, "flops must be at least 1 per second, got 5e-324"),
        ({"mem_bw": 5e-324}, "mem_bw must be at least 1 per second, got 5e-324"),
        ({"links": {"dram": {"bandwidth": 5e-324}}},
         "links.dram.bandwidth must be at least 1 per second, got 5e-324"),
        ({"links": {"dram": {"bandwidth": 1e10, "latency_s": 1.7e308}}},
         "links.dram.latency_s must be at most 3600 s (an hour), got 1.7e+308"),
        # before: read as 1.0, 1e15, 2 and -5
        ({"flops": True}, "flops must be a finite number > 0, got true (a boolean)"),
        ({"flops": "1e15"}, "flops must be a finite number > 0, got 1e15 (a string"),
        ({"gpus": 2.7}, "gpus must be an integer from 0 to 1048576, got 2.7"),
        ({"gpus": -5}, "gpus must be an integer from 0 to 1048576, got -5"),
        ({"gpus": MAX_GPUS + 1}, "gpus must be an integer from 0 to 1048576, got 1048577"),
        ({"mem_bytes": None}, "mem_bytes must be a finite number > 0, got null"),
        ({"tier_bytes": {"dram": "big"}}, "tier_bytes.dram must be a finite number >= 0"),
        # before: accepted; --tiers then said "its tiers are : ... e.g. --tiers "
        ({"links": {}}, "links must be a JSON object of at least one tier"),
        ({"links": [1]}, "links must be a JSON object of at least one tier"),
        ({"links": {"dram": 5}}, "links.dram must be a JSON object"),
        ({"links": {"dram": {"latency_s": 0}}}, "missing field 'links.dram.bandwidth'"),
        ({"tier_bytes": [1]}, "tier_bytes must be a JSON object"),
    ],
)  # fmt: skip
def test_a_bad_figure_is_named_with_its_file_field_and_value(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    text = json.dumps({**GOOD, **change})
    text = text.replace('"__inf__"', "1e999").replace('"__big__"', "1" + "0" * 400)
    path = _write(tmp_path, text)
    with pytest.raises(KVTierUsageError, match=re.escape(f"hardware profile {path}: {needle}")):
        load_profile(path)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
     ("{not json", "invalid JSON: Expecting property name")],
    ids=["deep", "not-json"],
)  # fmt: skip
def test_a_file_that_is_no_profile_is_named(tmp_path: Path, text: str, needle: str) -> None:
    """Before: 100000 nested lists raised RecursionError, reported as a kvtier bug."""
    path = _write(tmp_path, text)
    with pytest.raises(KVTierUsageError, match=re.escape(needle)):
        load_profile(path)


def test_bench_sim_names_the_hardware_option(tmp_path: Path) -> None:
    """Through the CLI: exit 2 and a message that starts with --hardware, for each kind of
    failure that used to be "unexpected ... (a kvtier bug)", exit 1."""
    for text in ("[" * 100_000 + "]" * 100_000, json.dumps({**GOOD, "flops": 10**400})):
        path = _write(tmp_path, text)
        args = ["bench", "sim", "--workload", "chat", "--requests", "20", "--tiers", "dram",
                "--no-progress", "--json", "--hardware", str(path)]  # fmt: skip
        result = CliRunner().invoke(get_app(), args)
        assert result.exit_code == 2, result.output
        message = json.loads(result.stdout)["error"]["message"]
        assert message.startswith(f"--hardware: hardware profile {path}: "), message
