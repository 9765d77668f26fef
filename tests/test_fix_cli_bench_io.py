"""``kvtier bench io`` and ``kvtier inspect topology``: ``threads`` reports what kvtier's
path used, and bad or contradictory options are refused by name with exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.bench.io import IOBenchParams
from kvtier.errors import KVTierUsageError


def invoke(*args: str) -> Any:
    return CliRunner().invoke(get_app(), [*args, "--json"])


def usage_error(*args: str) -> str:
    """The message of a command that must exit 2 with a JSON error, no traceback."""
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "kvtier bug" not in result.output
    return str(json.loads(result.stdout)["error"]["message"])


def dram_result(*args: str) -> dict[str, Any]:
    result = invoke("bench", "io", "--tier", "dram", "--repeats", "1", *args)
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout)["tiers"][0])


def test_threads_is_one_for_calls_dram_copies_on_one_thread() -> None:
    """8 pages of 64 KiB per call: 512 KiB, below dram's 8 MiB split threshold, so the
    call runs on one thread, and the main baseline too (before: "threads": 2, the
    arena's I/O threads, beside "numpy memcpy, 1 thread")."""
    r = dram_result("--pages", "8", "--page-size", "64KiB")
    assert r["threads"] == 1 and r["baseline_method"] == "numpy memcpy, 1 thread"


def test_threads_follow_the_call_not_the_batch_option() -> None:
    """3 pages of 2 MiB with --batch 8: each call holds the 3 pages (6 MiB, one thread);
    the baseline matched a call of 8 pages (16 MiB, two threads) before."""
    r = dram_result("--pages", "3", "--batch", "8", "--page-size", "2MiB")
    assert r["threads"] == 1 and r["baseline_method"] == "numpy memcpy, 1 thread"
    # a call dram splits (16 MiB): its I/O threads (4 by default), at most one per core
    r = dram_result("--pages", "4", "--batch", "4", "--page-size", "4MiB")
    want = min(4, os.cpu_count() or 1)
    assert r["threads"] == want and r["baseline_method"].startswith(f"numpy memcpy, {want} ")


def test_a_tier_named_twice_is_refused() -> None:
    message = usage_error("bench", "io", "--tier", "dram", "--tier", "dram", "--repeats", "1")
    assert message == "--tier dram is given more than once: name each tier once"


def test_repeats_have_an_upper_bound() -> None:
    """Before: no bound (a run of 99999999999999 repeats started). Checked on the
    parameters first, so that this test fails rather than hangs without the bound."""
    IOBenchParams(repeats=10_000, pages=1, page_bytes=4096)
    with pytest.raises(KVTierUsageError, match="--repeats must be at most"):
        IOBenchParams(repeats=10_001, pages=1, page_bytes=4096)
    message = usage_error("bench", "io", "--tier", "dram", "--repeats", "99999999999999")
    assert message == "bench io: --repeats must be at most 10,000, got 99999999999999"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--root", "{file}"], "is not a directory"),
        (["--placement", "none", "--numa-node", "0"], "--numa-node 0 with --placement none"),
    ],
)
def test_inspect_topology_refuses_what_it_would_ignore(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    (tmp_path / "f").write_text("")
    args = [a.replace("{file}", str(tmp_path / "f")) for a in args]
    assert needle in usage_error("inspect", "topology", "--no-nvml", *args)


def test_inspect_topology_refuses_a_root_that_does_not_exist(tmp_path: Path) -> None:
    """Before: a machine with no NUMA, GPU or NVMe information, exit 0. An existing root
    without sysfs files is still read (as a machine without NUMA information)."""
    missing = tmp_path / "missing"
    message = usage_error("inspect", "topology", "--no-nvml", "--root", str(missing))
    assert message == f"--root {missing}: no such directory"
    result = invoke("inspect", "topology", "--no-nvml", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["topology"]["nodes"] == []
