"""``kvtier inspect backends`` and ``kvtier inspect config`` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier import registry


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON document on stdout
    assert isinstance(data, dict)
    return data


def test_inspect_backends_json_lists_every_registered_backend(runner: CliRunner) -> None:
    data = _json(runner.invoke(get_app(), ["inspect", "backends", "--json"]))
    rows = {b["name"]: b for b in data["backends"]}
    assert set(rows) == {info.name for info in registry.discover()}
    for row in rows.values():
        assert set(row) >= {"name", "kind", "available", "reason", "origin"}
        assert (row["reason"] is None) == row["available"]
    assert rows["dram"]["available"] and rows["dram"]["kind"] == "arena"
    assert rows["file"]["available"] and rows["file"]["kind"] == "store"
    assert rows["dram"]["origin"].startswith("entry point")


def test_inspect_backends_table(runner: CliRunner) -> None:
    result = runner.invoke(get_app(), ["inspect", "backends"])
    assert result.exit_code == 0, result.stderr
    assert "dram" in result.stdout and "available" in result.stdout


def test_inspect_config_default_sources(runner: CliRunner) -> None:
    data = _json(runner.invoke(get_app(), ["inspect", "config", "--json"], env={}))
    values = {v["key"]: v for v in data["values"]}
    assert values["tiers[0].backend"]["value"] == "dram"
    assert values["pipeline.batch_pages"]["source"] == "default"
    assert data["config"]["tiers"][0]["name"] == "dram"


def test_inspect_config_file_and_env_sources(runner: CliRunner, tmp_path: Path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[pipeline]\nbatch_pages = 7\nwrite_policy = "write-back"\n')
    result = runner.invoke(
        get_app(),
        ["inspect", "config", "--config", str(cfg), "--json"],
        env={"KVTIER_PIPELINE__BATCH_PAGES": "9"},
    )
    values = {v["key"]: v for v in _json(result)["values"]}
    assert values["pipeline.batch_pages"] == {
        "key": "pipeline.batch_pages",
        "value": 9,
        "source": "env:KVTIER_PIPELINE__BATCH_PAGES",
    }
    assert values["pipeline.write_policy"]["value"] == "write-back"
    assert values["pipeline.write_policy"]["source"] == f"file:{cfg}"


def test_inspect_config_bad_key_is_a_usage_error(runner: CliRunner, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[pipeline]\nbatch_pagez = 3\n")
    result = runner.invoke(get_app(), ["inspect", "config", "--config", str(cfg), "--json"])
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]  # --json: the error as one JSON object
    assert error["type"] == "ConfigError" and error["exit_code"] == 2
    assert "pipeline.batch_pagez" in error["message"]
    assert "pipeline.batch_pagez" in result.stderr


def test_inspect_config_bad_size_names_the_key(runner: CliRunner, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[tiers]]\nbackend = "dram"\ncapacity = "lots"\n')
    result = runner.invoke(get_app(), ["inspect", "config", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "tiers[0].capacity" in result.stderr and "lots" in result.stderr


def test_inspect_config_missing_file(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(get_app(), ["inspect", "config", "--config", str(tmp_path / "no.toml")])
    assert result.exit_code == 2
    assert "no.toml" in result.stderr


def test_inspect_config_model_fields_follow_the_preset_source(runner: CliRunner) -> None:
    result = runner.invoke(
        get_app(), ["inspect", "config", "--json"], env={"KVTIER_MODEL__PRESET": "tiny"}
    )
    values = {v["key"]: v for v in _json(result)["values"]}
    assert values["model.num_layers"]["value"] == 2
    assert values["model.num_layers"]["source"] == "preset from env:KVTIER_MODEL__PRESET"
