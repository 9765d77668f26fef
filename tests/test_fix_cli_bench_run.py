"""``kvtier bench run --model``: the preset replaces the model before the configuration is
validated, so capacities are checked against a page of the model the run uses (before: a
1 MiB top tier was refused as smaller than one page of llama3-8b, the model --model
replaced, though a ``tiny`` page is 512 bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.bench.live import load_base
from kvtier.errors import ConfigError

RUN = ["bench", "run", "--model", "tiny", "--sessions", "2", "--turns", "2", "--json"]


def small_toml(tmp_path: Path, extra: str = "") -> Path:
    """A config whose 1 MiB DRAM tier is below one llama3-8b page (2 MiB)."""
    cfg = tmp_path / "small.toml"
    cfg.write_text(
        extra + '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "1MiB"\n\n'
        '[[tiers]]\nname = "file"\nbackend = "file"\ncapacity = "4MiB"\n'
        f'options = {{ path = "{tmp_path / "f"}" }}\n'
    )
    return cfg


def test_model_applies_before_a_capacity_from_the_environment_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTIER_TIERS__DRAM__CAPACITY", "1MiB")
    result = CliRunner().invoke(get_app(), RUN)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["model"]["name"] == "tiny" and data["mismatches"] == 0
    assert data["config"]["tiers"][0]["capacity"] == 1 << 20


@pytest.mark.parametrize("workload", ["chat", "speculative"])
def test_model_applies_before_a_capacity_from_the_file_is_checked(
    tmp_path: Path, workload: str
) -> None:
    args = [*RUN, "--config", str(small_toml(tmp_path)), "--workload", workload]
    if workload == "speculative":
        args.remove("--turns")
        args.remove("2")  # the speculative workload has no turns
    result = CliRunner().invoke(get_app(), args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["model"]["name"] == "tiny"


def test_load_base_names_where_values_came_from(tmp_path: Path) -> None:
    """Sources stay as ``load_config`` names them; --model wins over the file and
    ``KVTIER_MODEL__*``; a namespace model id equal to the replaced model's name goes."""
    cfg = small_toml(
        tmp_path, '[model]\npreset = "llama3-70b"\n[namespace]\nmodel_id = "llama3-70b"\n'
    )
    env = {"KVTIER_MODEL__PAGE_TOKENS": "64", "KVTIER_PIPELINE__BATCH_PAGES": "8"}
    base = load_base(cfg, "tiny", env=env)
    assert base.config.spec.name == "tiny" and base.config.spec.page_tokens == 4
    assert base.config.namespace.model_id == "tiny"
    assert base.sources["model.preset"] == "--model"
    assert base.sources["tiers[0].capacity"] == f"file:{cfg}"
    assert base.sources["pipeline.batch_pages"] == "env:KVTIER_PIPELINE__BATCH_PAGES"
    from_env = load_base(None, "tiny", env={"KVTIER_CONFIG": str(cfg)})
    assert from_env.sources["tiers[0].capacity"] == f"env:KVTIER_CONFIG={cfg}"


def test_load_base_still_refuses_a_capacity_below_the_chosen_models_page(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"smaller than one page of llama3-8b.*file:"):
        load_base(small_toml(tmp_path), "llama3-8b", env={"KVTIER_MODEL__PRESET": "tiny"})
