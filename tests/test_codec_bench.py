"""``kvtier bench codec``, ``kvtier bench sim --codec`` and ``kvtier inspect codecs``: what
they report (no timing is asserted: benchmarks are not timed tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from kvtier.cli.sim_sizes import codec_page_factors
from typer.testing import CliRunner

from kvtier.bench.codec import parse_codec
from kvtier.codec import make_codec, slot_bytes
from kvtier.errors import KVTierUsageError
from kvtier.spec import preset


def _run(*args: str) -> dict:
    result = CliRunner().invoke(get_app(), ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_codec_reports_ratio_speed_and_tier_rates() -> None:
    data = _run(
        "codec", "--source", "normal", "--pages", "3", "--codec", "zstd",
        "--codec", "fp8-e4m3", "--tier", "file", "--rounds", "1", "--repeat", "1",
    )  # fmt: skip
    rows = {r["codec"]: r for r in data["speed"]["codecs"]}
    assert rows["zstd"]["exact"] and rows["zstd"]["ratio"] > 1.0
    fp8 = rows["fp8-e4m3"]
    assert fp8["lossy"] and not fp8["exact"]
    assert 1.9 < fp8["ratio"] < 2.0  # half of a 16-bit page, plus scales and the frame
    assert fp8["max_error_of_peak"] <= 2.0**-4  # half an e4m3 ulp at the top binade
    (tier,) = data["tiers"]
    by = {r["codec"]: r for r in tier["codecs"]}
    assert set(by) == {"none", "zstd", "fp8-e4m3"} and by["none"]["read_vs_none"] == 1.0
    assert by["fp8-e4m3"]["stored_bytes_per_page"] < data["speed"]["page_bytes"] / 1.9


def test_bench_sim_codec_gives_a_tier_the_pages_its_bytes_hold() -> None:
    common = ["sim", "--workload", "chat", "--requests", "300", "--capacity", "50",
              "--policy", "lru", "--tiers", "dram,nvme", "--model", "llama3-8b",
              "--no-progress"]  # fmt: skip
    plain = _run(*common)["runs"][0]["capacity_pages"]
    coded = _run(*common, "--codec", "nvme=fp8-e4m3")
    spec = preset("llama3-8b")
    factor = spec.page_bytes / slot_bytes(make_codec("fp8-e4m3", spec))
    assert coded["runs"][0]["capacity_pages"] == [plain[0], int(plain[1] * factor)]
    assert coded["codec_page_factors"] == {"dram": 1.0, "nvme": factor}
    bad = CliRunner().invoke(get_app(), [*["bench", *common], "--codec", "disk=zstd"])
    assert bad.exit_code == 2 and "disk" in bad.output


def test_bench_sim_codec_takes_the_bench_codec_syntax() -> None:
    """``NAME:key=value`` was read as a ``module:Class`` path ("No module named 'zstd'")."""
    common = ["sim", "--workload", "chat", "--requests", "50", "--capacity", "50",
              "--policy", "lru", "--tiers", "dram,nvme", "--model", "llama3-8b",
              "--no-progress"]  # fmt: skip
    spec = preset("llama3-8b")
    for text, name, params in [
        ("zstd:level=3,shuffle=false", "zstd", {"level": 3, "shuffle": False}),
        ("fp8-e4m3:scale=token", "fp8-e4m3", {"scale": "token"}),
    ]:
        data = _run(*common, "--codec", f"nvme={text}")
        factor = spec.page_bytes / slot_bytes(make_codec(name, spec, **params))
        assert data["codecs"] == {"nvme": text}
        assert data["codec_page_factors"] == {"dram": 1.0, "nvme": factor}
    for text, needle in [
        ("nvme=zstd:level", "'level' in 'zstd:level' is not key=value"),
        ("nvme=zstd:level=99", "'level' must be an integer in"),
    ]:
        bad = CliRunner().invoke(get_app(), ["bench", *common, "--codec", text])
        assert bad.exit_code == 2 and needle in " ".join(bad.output.split()), bad.output


def test_codec_option_parsing() -> None:
    assert parse_codec("zstd") == ("zstd", {})
    assert parse_codec("zstd:level=3,shuffle=false") == ("zstd", {"level": 3, "shuffle": False})
    assert parse_codec("fp8-e4m3:scale=token") == ("fp8-e4m3", {"scale": "token"})
    with pytest.raises(KVTierUsageError, match="key=value"):
        parse_codec("zstd:level")
    # a plugin's module:Class path, as a tier's codec takes it (before: "codec parameter
    # 'Rle' in 'mypkg.codecs:Rle' is not key=value")
    assert parse_codec("mypkg.codecs:Rle") == ("mypkg.codecs:Rle", {})
    assert parse_codec("mypkg:Rle:level=3") == ("mypkg:Rle", {"level": 3})


def test_codec_option_values_take_a_sign_and_only_ascii_digits() -> None:
    """Before: ``level=-5`` stayed the string '-5' (so a valid negative level could not be
    given), and ``level=²`` raised ValueError from ``int()`` (str.isdigit is true)."""
    assert parse_codec("zstd:level=-5") == ("zstd", {"level": -5})
    assert parse_codec("zstd:level=+3") == ("zstd", {"level": 3})
    assert parse_codec("zstd:level=²") == ("zstd", {"level": "²"})  # the codec refuses it


@pytest.mark.parametrize(
    ("text", "needle"),
    [("zstd:=3", "codec parameter '=3' in 'zstd:=3' has no name"),
     ("zstd:level=3,level=4", "codec parameter 'level' is given twice in 'zstd:level=3,level=4'")],
)  # fmt: skip
def test_codec_option_refuses_a_blank_or_repeated_parameter(text: str, needle: str) -> None:
    """Before: a blank name gave "unknown parameter(s) " and a repeat silently won."""
    with pytest.raises(KVTierUsageError, match=re.escape(needle)):
        parse_codec(text)


SIM_CODEC = ["bench", "sim", "--workload", "chat", "--requests", "20", "--capacity", "5",
             "--policy", "lru", "--tiers", "hbm,nvme", "--no-progress", "--json"]  # fmt: skip


@pytest.mark.parametrize(
    ("codecs", "needle"),
    [(["nvme=zstd:level=²"], "--codec nvme=zstd:level=²: codec 'zstd': parameter 'level'"),
     (["nvme=nosuch"], "--codec nvme=nosuch: unknown codec 'nosuch'"),
     (["nvme=zstd:shuffel=true"], "--codec nvme=zstd:shuffel=true: codec 'zstd': unknown"),
     (["nvme=zstd", "nvme=lz4"], "--codec: tier 'nvme' is given twice (nvme=zstd and nvme=lz4)"),
     (["nvme=zstd:=3"], "--codec nvme=zstd:=3: codec parameter '=3'")],
)  # fmt: skip
def test_bench_sim_codec_errors_name_the_option(codecs: list[str], needle: str) -> None:
    """Before: ``level=²`` was "unexpected ValueError ... a kvtier bug" (exit 1), a second
    ``--codec`` for a tier silently replaced the first, and codec errors did not name
    ``--codec``."""
    args = [a for c in codecs for a in ("--codec", c)]
    result = CliRunner().invoke(get_app(), [*SIM_CODEC, *args])
    assert result.exit_code == 2, result.output
    assert needle in json.loads(result.stdout)["error"]["message"]


def test_bench_sim_codec_takes_a_negative_zstd_level() -> None:
    data = _run(*SIM_CODEC[1:-1], "--codec", "nvme=zstd:level=-5")
    assert data["codecs"] == {"nvme": "zstd:level=-5"}


def test_the_docs_give_the_codec_page_factors_the_code_computes() -> None:
    """docs/cli.md said "about 2 for fp8-e4m3/int8"; int8's default per-channel scales
    (a float32 per head dimension over 16 tokens) make it 1.6."""
    spec = preset("llama3-70b")
    factors = codec_page_factors(
        {"a": "fp8-e4m3", "b": "int8", "c": "int8:scale=token"}, ["a", "b", "c"], spec
    )
    assert [round(f, 2) for f in factors] == [2.0, 1.6, 1.94]
    docs = " ".join((Path(__file__).parents[1] / "docs" / "cli.md").read_text().split())
    assert "about 2 for `fp8-e4m3`" in docs and "1.6 for `int8`" in docs
    assert "about 1.94 for `int8:scale=token`" in docs


def test_inspect_codecs_lists_the_builtins() -> None:
    result = CliRunner().invoke(get_app(), ["inspect", "codecs", "--json"])
    assert result.exit_code == 0, result.output
    codecs = {c["name"]: c for c in json.loads(result.stdout)["codecs"]}
    assert {"none", "zstd", "lz4", "fp8-e4m3", "int8"} <= set(codecs)
    assert codecs["fp8-e4m3"]["lossy"] and not codecs["zstd"]["lossy"]
    assert all(codecs[n]["available"] for n in ("zstd", "lz4", "fp8-e4m3", "int8"))
