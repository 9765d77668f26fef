"""``kvtier bench run``: the chat workload, its config overrides, and the live command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.bench import live
from kvtier.bench.workload import ChatParams, conversation_tokens, footprint, page_content
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.spec import preset

# Small enough to run in a few seconds, big enough to spill: tiny pages, a top tier that
# holds two turns' worth of pinned context but not every session's pages.
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
    "--dram-capacity",
    "48MiB",
]


def test_page_content_is_a_function_of_the_key() -> None:
    a = page_content(b"\x01" * 16, 4096)
    assert a.dtype == np.uint8 and a.shape == (4096,)
    assert np.array_equal(a, page_content(b"\x01" * 16, 4096))
    b = page_content(b"\x01" * 15 + b"\x02", 4096)
    words_a, words_b = a.view(np.uint64), b.view(np.uint64)
    assert np.all(words_a != words_b)  # another key differs in every word
    assert len(np.unique(words_a)) == len(words_a)  # a shifted read never matches
    assert page_content(b"\x05" * 16, 1001).shape == (1001,)


def test_conversations_are_deterministic_and_share_system_prompts() -> None:
    params = ChatParams(sessions=4, turns=2, system_prompts=2, system_tokens=32, seed=3)
    one, two = conversation_tokens(params), conversation_tokens(params)
    for s1, s2 in zip(one, two, strict=True):
        for (u1, r1), (u2, r2) in zip(s1, s2, strict=True):
            assert np.array_equal(u1, u2) and np.array_equal(r1, r2)
    assert np.array_equal(one[0][0][0][:32], one[2][0][0][:32])  # same system prompt
    assert not np.array_equal(one[0][0][0][:32], one[1][0][0][:32])
    assert not np.array_equal(one[0][0][0][32:40], one[2][0][0][32:40])
    other = conversation_tokens(ChatParams(sessions=4, turns=2, system_tokens=32, seed=4))
    assert not np.array_equal(one[0][1][0], other[0][1][0])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sessions": 0}, "sessions"),
        ({"user_tokens": (5, 2)}, "user_tokens"),
        ({"system_tokens": -1}, "--system-tokens"),
    ],
)
def test_chat_params_reject_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(KVTierUsageError, match=needle):
        ChatParams(**kwargs)


def test_run_config_overrides(tmp_path: Path) -> None:
    base = load_config(None, env={})
    cfg = live.run_config(base, model="tiny", top_capacity=1 << 20, disk_dir=tmp_path)
    assert cfg.spec == preset("tiny")
    assert cfg.namespace.model_id == "tiny"
    assert cfg.tiers[0].capacity_bytes == 1 << 20
    disk = cfg.tiers[1]
    assert disk.backend == live.disk_backend()
    assert disk.options["path"] == str(tmp_path)


def test_run_config_errors_name_the_problem(tmp_path: Path) -> None:
    base = load_config(None, env={})
    with pytest.raises(KVTierUsageError, match="no-such-model"):
        live.run_config(base, model="no-such-model")
    with pytest.raises(ConfigError, match="smaller than one page"):
        live.run_config(base, top_capacity=1024)
    dram_only = load_config({"tiers": [{"backend": "dram", "capacity": "64MiB"}]}, env={})
    with pytest.raises(ConfigError, match="no disk tier"):
        live.run_config(dram_only, disk_dir=tmp_path)
    # Without a user-named directory a config without a disk tier is fine.
    assert len(live.run_config(dram_only, disk_dir=tmp_path, disk_required=False).tiers) == 1


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dram-capacity", "12 bananas"], "--dram-capacity"),
        (["--dram-capacity", "1KiB"], "smaller than one page"),
        (["--dram-capacity", "1KiB"], "(from --dram-capacity)"),
        # named as the flag it came from (before: "model.preset: ... (from python)")
        (["--model", "gpt-17"], "--model: unknown KVSpec preset 'gpt-17'"),
        (["--model", "gpt-17", "--workload", "speculative"], "--model: unknown KVSpec preset"),
        (["--sessions", "0"], "sessions"),
        (["--turn-tokens", "0"], "--turn-tokens"),
    ],
)
def test_bench_run_usage_errors_exit_2(runner: CliRunner, args: list[str], needle: str) -> None:
    result = runner.invoke(get_app(), ["bench", "run", *args, "--json"])
    assert result.exit_code == 2, result.stderr
    assert json.loads(result.stdout)["error"]["exit_code"] == 2  # the error, as JSON
    assert needle in result.stderr
    assert "(from python)" not in result.stderr


def test_bench_run_bad_config_key_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[[tiers]]\nbackend = "dram"\ncapacity = "64MiB"\nwatermark = 0.5\n')
    result = runner.invoke(get_app(), ["bench", "run", "--config", str(cfg), "--json"])
    assert result.exit_code == 2
    assert "tiers[0].watermark" in result.stderr


@pytest.mark.parametrize("page_tokens", [4, 16, 64])
def test_default_top_tier_spills_but_holds_a_wave(page_tokens: int) -> None:
    params = ChatParams()
    fp = footprint(params, page_tokens)
    top = live.default_top_pages(params, page_tokens, batch_pages=32)
    assert fp.max_wave_pages + 32 <= top < fp.working_set_pages


def test_footprint_counts_the_pages_a_run_stores() -> None:
    params = ChatParams(sessions=3, turns=2, system_prompts=2, system_tokens=32, seed=1)
    convo = conversation_tokens(params)
    finals = [sum(len(u) + len(r) for u, r in turns) for turns in convo]
    fp = footprint(params, 8)
    assert fp.working_set_pages == 2 * 4 + sum(n // 8 - 4 for n in finals)
    assert fp.max_wave_pages == max(finals[0] // 8 + finals[1] // 8, finals[2] // 8)


def test_run_config_keeps_a_disk_backend_the_config_chose(tmp_path: Path) -> None:
    chosen = load_config(
        {
            "tiers": [
                {"backend": "dram", "capacity": "64MiB"},
                {"name": "disk", "backend": "file", "capacity": "1GiB"},
            ]
        },
        env={},
    )
    cfg = live.run_config(chosen, disk_dir=tmp_path)
    assert (cfg.tiers[1].name, cfg.tiers[1].backend) == ("disk", "file")
    assert cfg.tiers[1].options == {"path": str(tmp_path)}


def test_a_run_without_a_disk_tier_reports_no_disk_directory(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Two DRAM tiers (no file/nvme tier to put the run's directory on): no directory is
    reported, in the JSON or the text; the default layout reports the one it used."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "256KiB"\n'
        '[[tiers]]\nname = "dram2"\nbackend = "dram"\ncapacity = "4MiB"\n'
    )
    args = ["bench", "run", "--config", str(cfg), "--sessions", "2", "--turns", "3"]
    result = runner.invoke(get_app(), [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["disk_dir"] is None and data["disk_kept"] is False
    text = runner.invoke(get_app(), args)
    assert text.exit_code == 0 and "disk tier directory" not in text.stdout
    small = ["--model", "tiny", "--sessions", "2", "--turns", "3", "--json"]
    default = runner.invoke(get_app(), ["bench", "run", *small])
    assert default.exit_code == 0, default.stderr
    assert json.loads(default.stdout)["disk_dir"] is not None
