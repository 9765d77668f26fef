"""Configuration: default, TOML files, dicts, KVTierConfig objects, KVTIER_* variables,
sources of every value, and a ConfigError naming the key for every kind of mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.config import (
    DEFAULT_STORE_DIR,
    KVTierConfig,
    default_config,
    load_config,
    parse_size,
    register_admission,
)
from kvtier.errors import ConfigError
from kvtier.policy.base import AdmitAll
from kvtier.spec import PRESETS

TOML = """
[model]
preset = "llama3-8b"
page_tokens = 32

[namespace]
model_id = "meta-llama/Llama-3.1-8B"
revision = "abc123"

[pipeline]
write_policy = "write-back"
batch_pages = 8

[log]
format = "json"

[[tiers]]
name = "dram"
backend = "dram"
capacity = "1GiB"

[[tiers]]
name = "nvme"
backend = "file"
capacity = "16GiB"
eviction = "lru-k"
[tiers.eviction_params]
k = 3
[tiers.options]
path = "/tmp/kv"

[[tiers]]
name = "remote"
backend = "redis"
capacity = "64GiB"
"""


def _file(tmp_path: Path, text: str = TOML) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def test_default_config_is_dram_over_a_local_file_store():
    cfg = default_config()
    assert [t.backend for t in cfg.tiers] == ["dram", "file"]
    assert cfg.tiers[1].options == {"path": DEFAULT_STORE_DIR}
    assert (cfg.tiers[0].high_watermark, cfg.tiers[0].low_watermark) == (0.80, 0.70)
    # Watermarks by role: the file tier is the last one, it fills to 90 % (issue 12: as
    # "second" it dropped pages at 70 %, leaving 30 % of the disk unused).
    assert (cfg.tiers[1].high_watermark, cfg.tiers[1].low_watermark) == (0.90, 0.80)
    assert [t.on_open_error for t in cfg.tiers] == ["fail", "skip"]
    assert cfg.write_policy == "write-through"
    assert cfg.spec == PRESETS["llama3-8b"]
    assert cfg.namespace.model_id == "llama3-8b"
    resolved = load_config(None, env={})
    assert set(resolved.sources.values()) == {"default"}


@pytest.mark.parametrize(
    ("count", "highs"),
    [(1, [0.80]), (2, [0.80, 0.90]), (3, [0.80, 0.70, 0.90]), (4, [0.80, 0.70, 0.70, 0.90])],
)
def test_default_watermarks_by_role(count: int, highs: list[float]) -> None:
    tiers = [{"name": f"t{i}", "backend": "dram", "capacity": "1MiB"} for i in range(count)]
    cfg = load_config({"model": {"preset": "tiny"}, "tiers": tiers}, env={}).config
    assert [t.high_watermark for t in cfg.tiers] == highs
    assert [t.low_watermark for t in cfg.tiers] == [round(h - 0.1, 6) for h in highs]


def test_toml_file_values_and_sources(tmp_path):
    path = _file(tmp_path)
    resolved = load_config(path, env={})
    cfg = resolved.config
    assert cfg.spec.page_tokens == 32 and cfg.spec.num_layers == 32
    assert cfg.namespace.model_id == "meta-llama/Llama-3.1-8B"
    assert cfg.namespace.page_tokens == 32  # the namespace follows the spec
    assert cfg.write_policy == "write-back" and cfg.batch_pages == 8
    assert cfg.max_inflight_per_link == 4  # untouched default
    assert [t.name for t in cfg.tiers] == ["dram", "nvme", "remote"]
    assert cfg.tiers[0].capacity_bytes == 1 << 30
    assert cfg.tiers[1].eviction == "lru-k" and cfg.tiers[1].eviction_params == {"k": 3}
    # default watermarks by role: top 0.80 / middle 0.70 / last 0.90, low = high - 0.10
    assert [t.high_watermark for t in cfg.tiers] == [0.80, 0.70, 0.90]
    assert [t.low_watermark for t in cfg.tiers] == [0.70, 0.60, 0.80]
    src = resolved.sources
    assert src["pipeline.write_policy"] == f"file:{path}"
    assert src["tiers[1].options.path"] == f"file:{path}"
    assert src["pipeline.max_inflight_per_link"] == "default"
    rows = {key: (value, origin) for key, value, origin in resolved.as_rows()}
    assert rows["tiers[2].capacity"] == (64 << 30, f"file:{path}")
    assert rows["model.preset"] == ("llama3-8b", f"file:{path}")
    assert rows["model.num_layers"] == (32, f"file:{path}")  # from the file's preset
    assert rows["pipeline.max_inflight_per_link"] == (4, "default")


def test_env_overrides_file_and_records_its_source(tmp_path):
    path = _file(tmp_path)
    env = {
        "KVTIER_TIERS__DRAM__CAPACITY": "2GiB",
        "KVTIER_TIERS__1__HIGH_WATERMARK": "0.5",
        "KVTIER_TIERS__1__LOW_WATERMARK": "0.25",
        "KVTIER_TIERS__NVME__OPTIONS__PATH": "/mnt/kv",
        "KVTIER_PIPELINE__WRITE_POLICY": "write-through",
        "KVTIER_LOG__LEVEL": "debug",
        "KVTIER_SOMETHING_ELSE": "ignored: no double underscore",
    }
    resolved = load_config(path, env=env)
    cfg = resolved.config
    assert cfg.tiers[0].capacity_bytes == 2 << 30
    assert (cfg.tiers[1].high_watermark, cfg.tiers[1].low_watermark) == (0.5, 0.25)
    assert cfg.tiers[1].options == {"path": "/mnt/kv"}
    assert cfg.write_policy == "write-through"
    assert cfg.log_level == "debug"
    assert resolved.sources["tiers[0].capacity"] == "env:KVTIER_TIERS__DRAM__CAPACITY"
    assert resolved.sources["tiers[1].options.path"] == "env:KVTIER_TIERS__NVME__OPTIONS__PATH"
    assert resolved.sources["tiers[0].backend"] == f"file:{path}"


@pytest.mark.parametrize(
    ("name", "meant"),
    [("KVTIER_PIPELINE_BATCH_PAGES", "KVTIER_PIPELINE__BATCH_PAGES"),
     ("KVTIER_LOG_LEVEL", "KVTIER_LOG__LEVEL"),
     ("KVTIER_TIERS_DRAM_CAPACITY", "KVTIER_TIERS__<name or index>__<key>")],
)  # fmt: skip
def test_a_setting_misspelt_with_single_underscores_is_named(name: str, meant: str) -> None:
    """Before: dropped without a word (only names with ``__`` were read as settings)."""
    with pytest.raises(ConfigError, match=re.escape(f"did you mean {meant}?")):
        load_config(None, env={name: "8"})
    # the variables of kvtier's scripts and tests stay theirs
    load_config(None, env={"KVTIER_POLICY_RC_D": "x", "KVTIER_SKIP_VLLM": "1",
                           "KVTIER_TEST_HANG_S": "3", "KVTIER_RUNTIME_DIR": "/tmp"})  # fmt: skip


def test_kvtier_config_env_names_the_file(tmp_path):
    path = _file(tmp_path)
    resolved = load_config(None, env={"KVTIER_CONFIG": str(path)})
    assert [t.name for t in resolved.config.tiers] == ["dram", "nvme", "remote"]
    assert resolved.sources["tiers[0].capacity"] == f"env:KVTIER_CONFIG={path}"


def test_dict_and_object_sources_round_trip():
    raw = {
        "model": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "fp16"},
        "tiers": [{"name": "mem", "backend": "dram", "capacity": "8MiB", "high_watermark": 0.9}],
    }
    resolved = load_config(raw, env={})
    cfg = resolved.config
    assert cfg.spec.dtype == "float16" and cfg.spec.num_layers == 4
    assert cfg.tiers[0].low_watermark == pytest.approx(0.8)  # high - 0.10
    assert resolved.sources["model.num_layers"] == "python"
    assert "model.preset" not in resolved.sources  # explicit geometry replaces the preset
    again = load_config(cfg, env={}).config
    assert again == cfg
    assert isinstance(cfg, KVTierConfig) and cfg.validate() is cfg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("4GiB", 4 << 30),
        ("4 GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("512m", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("2GB", 2_000_000_000),
        ("64KiB", 65536),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["four", "-1", "4XB", "", "5i", "5iB", True, -5, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity"):
        parse_size(bad, "tiers[0].capacity")


def _tiers(**first) -> dict:
    tier = {"name": "dram", "backend": "dram", "capacity": "64MiB", **first}
    return {"model": {"preset": "tiny"}, "tiers": [tier]}


@pytest.mark.parametrize(
    ("raw", "env", "match"),
    [
        ({"modle": {}}, {}, r"modle: unknown section"),
        ({"pipeline": {"batch_page": 4}}, {}, r"pipeline\.batch_page: unknown key"),
        (_tiers(capacty="1GiB"), {}, r"tiers\[0\]\.capacty: unknown key"),
        (_tiers(capacity=100), {}, r"tiers\[0\]\.capacity: 100 bytes .* smaller than one page"),
        (_tiers(capacity="lots"), {}, r"tiers\[0\]\.capacity: cannot parse 'lots'"),
        (_tiers(high_watermark=1.5), {}, r"tiers\[0\]\.high_watermark: must be a fraction"),
        (
            _tiers(high_watermark=0.5, low_watermark=0.6),
            {},
            r"tiers\[0\]\.low_watermark: 0\.6 is above high_watermark 0\.5",
        ),
        (_tiers(eviction="mru"), {}, r"tiers\[0\]\.eviction: .*unknown eviction policy 'mru'"),
        (
            _tiers(eviction="lru-k", eviction_params={"k": 0}),
            {},
            r"tiers\[0\]\.eviction_params: lru-k: k must be",
        ),
        (_tiers(options="x"), {}, r"tiers\[0\]\.options: must be a table"),
        ({"pipeline": {"write_policy": "sometimes"}}, {}, r"pipeline\.write_policy: must be one"),
        ({"pipeline": {"admission": "oracle"}}, {}, r"pipeline\.admission: unknown admission"),
        (
            {"pipeline": {"batch_pages": 0}},
            {},
            r"pipeline\.batch_pages: must be an integer in \[1, 1048576\]",
        ),
        ({"pipeline": {"max_inflight_per_link": "4"}}, {}, r"max_inflight_per_link: must be"),
        ({"log": {"format": "xml"}}, {}, r"log\.format: must be 'console' or 'json'"),
        ({"log": {"level": "loud"}}, {}, r"log\.level: unknown level 'loud'"),
        ({"model": {"preset": "gpt5"}}, {}, r"model\.preset: unknown KVSpec preset 'gpt5'"),
        ({"model": {"num_layers": 2}}, {}, r"model: give a preset or every geometry field"),
        (
            {"model": {"preset": "tiny", "dtype": "int4"}},
            {},
            r"model\.dtype: unknown KV dtype 'int4'",
        ),
        ({"namespace": {"model_id": 15}}, {}, r"namespace\.model_id: must be a non-empty string"),
        (
            {},
            {"KVTIER_NAMESPACE__MODEL_ID": "1.5"},
            r"namespace\.model_id: .*got 1\.5 \(from env:KVTIER_NAMESPACE__MODEL_ID\)",
        ),
        ({"tiers": []}, {}, r"tiers: at least one tier"),
        ({"tiers": [{"name": "x", "capacity": "1GiB"}]}, {}, r"tiers\[0\]\.backend: missing"),
        (
            {"tiers": [{"backend": "dram", "capacity": "1GiB"}] * 2},
            {},
            r"tiers\[1\]\.name: duplicate tier name 'dram'",
        ),
        ({}, {"KVTIER_PIPELINE__BATCHPAGES": "3"}, r"KVTIER_PIPELINE__BATCHPAGES: .* not a key"),
        ({}, {"KVTIER_FOO__BAR": "1"}, r"KVTIER_FOO__BAR: unknown section 'foo'"),
        ({}, {"KVTIER_TIERS__SSD__CAPACITY": "1GiB"}, r"no tier named 'ssd'"),
        ({}, {"KVTIER_TIERS__7__CAPACITY": "1GiB"}, r"no tier at index 7"),
        (
            {},
            {"KVTIER_TIERS__DRAM__CAPACITY": "1KiB"},
            r"tiers\[0\]\.capacity: 1024 bytes .*smaller than one page.*"
            r"\(from env:KVTIER_TIERS__DRAM__CAPACITY\)",
        ),
        ({}, {"KVTIER_PIPELINE__WRITE_POLICY": "never"}, r"\(from env:KVTIER_PIPELINE"),
        ({"observe": {"whatif": "yes"}}, {}, r"observe\.whatif: must be true or false"),
        ({"observe": {"sizing": True}}, {}, r"observe\.sizing: unknown key"),
        (
            {},
            {"KVTIER_OBSERVE__PREDICTOR": "psychic"},
            r"observe\.predictor: must be one of none, prefix, lookahead, prefix\+lookahead, "
            r"got 'psychic' \(from env:KVTIER_OBSERVE__PREDICTOR\)",
        ),
    ],
)
def test_bad_config_names_the_key(raw, env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(raw, env=env)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\npreset = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(broken, env={})
    with pytest.raises(ConfigError, match=r"tiers\[0\].speed: unknown key .*from file:"):
        load_config(_file(tmp_path, '[[tiers]]\nbackend="dram"\ncapacity=1\nspeed=2\n'), env={})
    with pytest.raises(ConfigError, match="must be a path, dict or KVTierConfig"):
        load_config(42, env={})  # type: ignore[arg-type]


def test_registered_admission_policy_is_selectable():
    class OnlyZero(AdmitAll):
        name = "only-zero"

        def __init__(self, byte: int = 0) -> None:
            self.byte = byte

        def admit(self, key: bytes) -> bool:  # type: ignore[override]
            return key[0] == self.byte

    register_admission("only-zero", OnlyZero)
    cfg = load_config(
        {
            "pipeline": {
                "write_policy": "selective",
                "admission": "only-zero",
                "admission_params": {"byte": 7},
            }
        },
        env={},
    ).config
    assert cfg.admission == "only-zero" and cfg.admission_params == {"byte": 7}
    with pytest.raises(ConfigError, match=r"admission_params: bad parameters for 'only-zero'"):
        load_config({"pipeline": {"admission": "only-zero", "admission_params": {"x": 1}}}, env={})


def test_background_eviction_is_a_pipeline_switch_on_by_default():
    assert load_config(None, env={}).config.background_eviction is True
    resolved = load_config(None, env={"KVTIER_PIPELINE__BACKGROUND_EVICTION": "false"})
    assert resolved.config.background_eviction is False
    assert resolved.sources["pipeline.background_eviction"].startswith("env:")
    assert resolved.config.to_dict()["pipeline"]["background_eviction"] is False
    with pytest.raises(ConfigError, match=r"pipeline.background_eviction: must be true or false"):
        load_config({"pipeline": {"background_eviction": "yes"}}, env={})


def test_observe_switches_are_off_by_default_and_set_by_file_or_environment(tmp_path):
    """What-if sizing and the live predictor can be switched on where an engine opens the
    cache from a config file (vLLM's ``kvtier_config``) or the environment, not only as
    ``KVCache`` arguments."""
    default = load_config(None, env={}).config
    assert (default.whatif, default.predictor) == (False, None)
    path = tmp_path / "kv.toml"
    path.write_text('[observe]\nwhatif = true\npredictor = "lookahead"\n')
    resolved = load_config(path, env={})
    assert (resolved.config.whatif, resolved.config.predictor) == (True, "lookahead")
    assert resolved.sources["observe.predictor"] == f"file:{path}"
    env = {"KVTIER_OBSERVE__WHATIF": "false", "KVTIER_OBSERVE__PREDICTOR": "none"}
    overridden = load_config(path, env=env).config
    assert (overridden.whatif, overridden.predictor) == (False, None)
    assert resolved.config.to_dict()["observe"] == {"whatif": True, "predictor": "lookahead"}
    assert load_config(resolved.config.to_dict(), env={}).config == resolved.config


def test_two_tiers_on_one_directory_are_refused(tmp_path, monkeypatch) -> None:
    """Two NVMe tiers on one path: ``inspect config --check`` (one tier at a time) passed
    them, and the cache skipped the second at start, locked out by the first. Paths are
    compared after ``~`` and symlinks."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "link").symlink_to(tmp_path / "store", target_is_directory=True)
    tiers = [
        {"name": "dram", "backend": "dram", "capacity": "1MiB"},
        {"name": "a", "backend": "nvme", "capacity": "4MiB", "options": {"path": "~/store"}},
        {"name": "b", "backend": "nvme", "capacity": "4MiB",
         "options": {"path": str(tmp_path / "link")}},
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.options\.path: tier 'b' uses the "):
        load_config({"model": {"preset": "tiny"}, "tiers": tiers}, env={})
    tiers[2]["options"]["path"] = str(tmp_path / "other")
    assert len(load_config({"model": {"preset": "tiny"}, "tiers": tiers}, env={}).config.tiers) == 3


def test_every_default_is_re_exported_from_kvtier_config() -> None:
    """architecture.md promises every name of ``kvtier.config.defaults`` from
    ``kvtier.config``; ``DEFAULT_EVICTION``, ``MAX_PAGE_TOKENS`` and ``MAX_RANK`` were
    missing (a docs probe)."""
    import kvtier.config as config
    import kvtier.config.defaults as defaults

    names = [n for n in dir(defaults) if n.isupper()]
    assert names and [n for n in names if n not in config.__all__] == []
    assert all(getattr(config, n) is getattr(defaults, n) for n in names)
