"""``kvtier bench run`` end to end on the real tiers (DRAM over the disk store)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier import registry
from kvtier.bench import live
from kvtier.spec import preset

# llama3-8b pages (2 MiB); a 48 MiB top tier (24 pages) holds one turn's pinned context but
# not the ~70 pages the four sessions write, so pages spill to disk and come back.
SMALL_RUN = [
    "--model",
    "llama3-8b",
    "--sessions",
    "4",
    "--turns",
    "3",
    "--system-tokens",
    "64",
    "--turn-tokens",
    "40",
    "--concurrency",
    "1",
    "--dram-capacity",
    "48MiB",
]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _run(runner: CliRunner, *extra: str) -> dict:
    result = runner.invoke(get_app(), ["bench", "run", *SMALL_RUN, *extra, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_bench_run_spills_and_reads_back_every_page(runner: CliRunner) -> None:
    data = _run(runner)
    top, disk = (t["name"] for t in data["config"]["tiers"])
    assert data["config"]["tiers"][1]["backend"] == live.disk_backend()
    assert data["turns"] == 12
    # Hits on both tiers: the shared system prompt stays hot, older turns come from disk.
    assert data["hits_by_tier"][top] > 0
    assert data["hits_by_tier"][disk] > 0
    assert data["hit_rate"] == pytest.approx(
        sum(data["hits_by_tier"].values()) / data["pages_looked_up"]
    )
    assert data["mismatches"] == 0
    assert data["checked_pages"] == data["pages_loaded"] > 0
    assert data["checked_pages"] == sum(data["hits_by_tier"].values())
    assert data["pages_stored"] > 0 and data["store_failed"] == 0
    # Pages went down and came back up over real links.
    assert data["links"][f"{top}->{disk}"]["pages"] > 0
    assert data["links"][f"{disk}->{top}"]["pages"] >= data["hits_by_tier"][disk]
    lat = data["fetch_latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert data["disk_kept"] is False and not Path(data["disk_dir"]).exists()
    assert data["params"]["sessions"] == 4
    # counts and byte sizes are JSON integers (docs/cli.md); before: 66.0 pages
    for link in [*data["links"].values(), *data["metrics"]["links"].values()]:
        for key in ("pages", "bytes", "failed_pages"):
            assert type(link[key]) is int, (key, link)
        assert type(link["seconds"]) is float
    for tier in data["metrics"]["tiers"].values():
        assert all(type(v) is int for v in tier.values()), tier
    assert all(type(v) is int for v in data["metrics"]["queues"].values())


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A kept disk-tier directory, removed after the test: its slab is preallocated to
    1 GiB, which pytest's kept temp dirs would otherwise hold on disk."""
    yield tmp_path
    for child in list(tmp_path.iterdir()):
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def test_bench_run_keeps_nvme_dir_and_second_run_finds_pages(
    runner: CliRunner, disk_dir: Path
) -> None:
    tmp_path = disk_dir
    first = _run(runner, "--nvme-dir", str(tmp_path))
    assert first["disk_kept"] is True and any(tmp_path.iterdir())
    second = _run(runner, "--nvme-dir", str(tmp_path))
    disk = second["config"]["tiers"][1]["name"]
    # Every prompt page was stored by the first run: nothing is recomputed.
    assert first["pages_missed"] > 0
    assert second["pages_missed"] == 0
    assert second["hits_by_tier"][disk] > first["hits_by_tier"][disk]
    assert second["mismatches"] == 0 and second["checked_pages"] == second["pages_looked_up"]


def test_bench_run_locked_disk_dir_exits_1(runner: CliRunner, tmp_path: Path) -> None:
    holder = registry.create(
        live.disk_backend(),
        page_bytes=preset("llama3-8b").page_bytes,
        capacity_pages=8,
        path=str(tmp_path),
    )
    loop = asyncio.new_event_loop()  # not running: the command runs its own loop
    try:
        loop.run_until_complete(holder.open())
        result = runner.invoke(get_app(), ["bench", "run", "--nvme-dir", str(tmp_path), "--json"])
        loop.run_until_complete(holder.close())
    finally:
        loop.close()
    assert result.exit_code == 1, result.stderr
    assert json.loads(result.stdout)["error"]["exit_code"] == 1  # the error, as JSON
    assert str(tmp_path) in result.stderr


def test_bench_run_json_stdout_is_one_object_in_a_real_process(tmp_path: Path) -> None:
    kvtier = Path(sys.executable).with_name("kvtier")
    proc = subprocess.run(
        [str(kvtier), "bench", "run", *SMALL_RUN, "--sessions", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # logs must go to stderr, never stdout
    assert data["mismatches"] == 0
