"""The speculative workload (forks + speculative steps) on a real KVCache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvtier.bench.speculative import SpeculativeParams, run_speculative, token_kv
from kvtier.cache import KVCache
from kvtier.config import KVTierConfig, TierConfig
from kvtier.errors import KVTierUsageError
from kvtier.keys import Namespace
from kvtier.spec import KVSpec

SPEC = KVSpec(2, 2, 16, "bfloat16", 8, name="spec-bench")


def config(tmp_path: Path, dram_pages: int) -> KVTierConfig:
    pb = SPEC.page_bytes
    return KVTierConfig(
        spec=SPEC,
        namespace=Namespace.for_spec(SPEC),
        tiers=[
            TierConfig("dram", "dram", dram_pages * pb, 0.8, 0.6),
            TierConfig("disk", "file", 2000 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
        write_policy="write-back",
    )


async def test_speculative_run_reports_rollbacks_and_zero_mismatches(tmp_path: Path) -> None:
    params = SpeculativeParams(
        sequences=3,
        prompt_tokens=70,
        steps=8,
        draft_tokens=5,
        accept_rate=0.5,
        fork_every=3,
        max_live=4,
        fault_batch=2,
        seed=3,
    )
    steps = []
    async with KVCache(config(tmp_path, 64), configure_log=False) as cache:
        report = await run_speculative(cache, params, on_step=lambda: steps.append(1))
        assert cache.directory.count("dram") >= 0
        tiers = cache.metrics.snapshot()["tiers"]
    assert len(steps) == 8 and report["steps"] == 8
    assert report["mismatches"] == 0 and report["checked_pages"] > 0
    assert report["unverified_pages_stored"] == 0
    resolved = report["rollbacks"] + report["partial_accepts"] + report["full_accepts"]
    assert resolved == report["tokens_proposed"] // 5 and report["rollbacks"] > 0
    assert report["forks"] == 2 and report["cow_copies"] > 0
    assert report["pages_discarded"]["dram"] > 0 and report["pages_discarded"]["disk"] == 0
    assert 0 < report["accept_rate_observed"] < 1
    # pages went down while the run went on, and faults brought them back from disk
    assert tiers["dram"]["evicted_pages"] > 0 and tiers["disk"]["hits"] > 0


def test_token_kv_differs_by_token_and_position() -> None:
    a = token_kv(SPEC, [5, 6], 0)
    assert a.dtype.is_floating_point and a.shape == (2, 2, 2, 2, 16)
    assert not a.isnan().any()
    assert not (token_kv(SPEC, [5], 1) == a[:, :, 0:1]).all()  # position matters
    assert not (token_kv(SPEC, [6], 0) == a[:, :, 0:1]).all()  # token matters
    assert (token_kv(SPEC, [6], 1) == a[:, :, 1:2]).all()


def test_bad_params() -> None:
    with pytest.raises(KVTierUsageError, match="accept_rate"):
        SpeculativeParams(accept_rate=1.5)
    with pytest.raises(KVTierUsageError, match="draft_tokens"):
        SpeculativeParams(draft_tokens=0)


def test_cli_bench_run_speculative_json(tmp_path: Path) -> None:
    import json

    from kvtier.cli.app import get_app
    from typer.testing import CliRunner

    args = ["bench", "run", "--workload", "speculative", "--model", "tiny", "--sessions", "3"]
    args += ["--steps", "4", "--accept-rate", "0.5", "--fork-every", "2", "--json"]
    args += ["--nvme-dir", str(tmp_path / "disk")]
    try:
        result = CliRunner().invoke(get_app(), args)
    finally:  # the kept disk tier preallocates a 1 GiB slab: do not leave it in /tmp
        shutil.rmtree(tmp_path / "disk", ignore_errors=True)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["workload"] == "speculative" and data["steps"] == 4 and data["forks"] == 2
    assert data["mismatches"] == 0 and data["unverified_pages_stored"] == 0
    assert data["checked_pages"] > 0 and data["params"]["accept_rate"] == 0.5
    assert set(data["pages_discarded"]) == {t["name"] for t in data["config"]["tiers"]}
    assert data["metrics"]["tiers"][data["config"]["tiers"][1]["name"]]["hits"] > 0

    bad = CliRunner().invoke(get_app(), ["bench", "run", "--workload", "nope"])
    assert bad.exit_code == 2 and "chat or speculative" in bad.output
    bad = CliRunner().invoke(
        get_app(), ["bench", "run", "--workload", "speculative", "--accept-rate", "2"]
    )
    assert bad.exit_code == 2 and "--accept-rate must lie in [0, 1], got 2" in bad.output
    for flag, value in (("--draft-tokens", "0"), ("--fork-every", "-1")):
        bad = CliRunner().invoke(
            get_app(), ["bench", "run", "--workload", "speculative", flag, value]
        )
        assert bad.exit_code == 2 and f"error: {flag} must be" in bad.output, bad.output


@pytest.mark.parametrize("rate", ["0.5", None, True])
def test_speculative_accept_rate_of_the_wrong_type_is_named(rate: object) -> None:
    from kvtier.bench.speculative import SpeculativeParams

    with pytest.raises(KVTierUsageError, match="accept_rate must be a number"):
        SpeculativeParams(accept_rate=rate)  # type: ignore[arg-type]
