"""Codecs configured per tier on a KVCache: config checks, capacity, mixed-codec
hierarchies, and lossy KV never mixing with exact KV (namespace and frames)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.codec import CodecStore, make_codec, slot_bytes
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.spec import preset
from kvtier.testing.servers import RedisServer, unavailable_reason
from kvtier.tier_check import check_tiers, create_backend

SPEC = preset("tiny")  # float16, 512-byte pages of (2, 2, 4, 2, 8)
PAGE = SPEC.page_bytes


def _config(path: Path, *lower: dict[str, Any], dram_pages: int = 8) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "dram", "backend": "dram", "capacity": dram_pages * PAGE}
    ]
    for i, t in enumerate(lower):
        tier = {"name": f"t{i}", "backend": "file", "capacity": 256 * PAGE,
                "options": {"path": str(path / f"t{i}")}}  # fmt: skip
        tier.update(t)
        tiers.append(tier)
    return {"model": {"preset": "tiny"}, "tiers": tiers}


def _kv(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` pages of smooth float16 KV (compressible, finite), as uint8 rows."""
    base = rng.standard_normal((n, 1, 1, 1, SPEC.num_kv_heads, SPEC.head_dim))
    x = base + 0.01 * rng.standard_normal((n, *SPEC.page_shape))
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(n, PAGE)


def _tokens(rng: np.random.Generator, pages: int) -> np.ndarray:
    return rng.integers(0, 50_000, pages * SPEC.page_tokens)


# -- configuration ------------------------------------------------------------------------


def test_codec_config_is_checked_early_and_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec: unknown codec 'brotli'"):
        load_config(_config(tmp_path, {"codec": "brotli"}), env={})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec: .*'level'"):
        load_config(_config(tmp_path, {"codec": "zstd", "codec_params": {"level": 40}}), env={})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec_params: must be a table"):
        load_config(_config(tmp_path, {"codec": "zstd", "codec_params": 3}), env={})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec: must be a non-empty string"):
        load_config(_config(tmp_path, {"codec": 7}), env={})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec: .*float8_e4m3fn"):
        cfg = _config(tmp_path, {"codec": "fp8-e4m3"})
        cfg["model"] = {"preset": "tiny", "dtype": "float8_e4m3fn"}
        load_config(cfg, env={})


async def test_a_codec_on_a_memory_tier_is_refused_naming_the_tier(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cfg["tiers"][0]["codec"] = "zstd"
    cache = KVCache(cfg, env={}, configure_log=False)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.codec \(dram\): .*needs a store backend"):
        await cache.start()


def test_codec_from_the_environment(tmp_path: Path) -> None:
    env = {"KVTIER_TIERS__T0__CODEC": "lz4", "KVTIER_TIERS__T0__CODEC_PARAMS__ACCELERATION": "4"}
    resolved = load_config(_config(tmp_path, {}), env=env)
    tier = resolved.config.tiers[1]
    assert (tier.codec, tier.codec_params) == ("lz4", {"acceleration": 4})
    assert resolved.sources["tiers[1].codec"] == "env:KVTIER_TIERS__T0__CODEC"


def test_a_bad_codec_parameter_names_where_it_came_from(tmp_path: Path) -> None:
    """The codec set in one place, a bad parameter in another: the error names both."""
    env = {"KVTIER_TIERS__T0__CODEC_PARAMS__LEVEL": "99"}
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path, {"codec": "zstd"}), env=env)
    assert "level" in str(err.value)
    assert "env:KVTIER_TIERS__T0__CODEC_PARAMS__LEVEL" in str(err.value)


async def test_capacity_counts_logical_pages_at_the_encoded_size(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"codec": "fp8-e4m3"}, {"codec": "zstd"}, {})
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        fp8, zstd, plain = (t.capacity_pages for t in cache.tiers[1:])
        assert plain == 256
        assert fp8 == 256 * PAGE // slot_bytes(make_codec("fp8-e4m3", SPEC))
        assert fp8 > 1.5 * plain  # fp8 holds ~twice the pages in the same bytes
        assert zstd == 256 * PAGE // (PAGE + 32)  # lossless: counted at a raw page + frame
        assert isinstance(cache.tiers[1].backend, CodecStore)
        assert not isinstance(cache.tiers[3].backend, CodecStore)  # none: not wrapped


def test_only_lossy_codecs_change_the_namespace(tmp_path: Path) -> None:
    plain = load_config(_config(tmp_path, {}), env={}).config.namespace
    lossless = load_config(_config(tmp_path, {"codec": "zstd"}), env={}).config.namespace
    lossy = load_config(_config(tmp_path, {"codec": "fp8-e4m3"}), env={}).config.namespace
    token = load_config(
        _config(tmp_path, {"codec": "fp8-e4m3", "codec_params": {"scale": "token"}}), env={}
    ).config.namespace
    assert lossless == plain
    assert lossy.kv_dtype == "float16~fp8-e4m3:head"
    assert len({plain.digest, lossy.digest, token.digest}) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_inspect_config_check_probes_codec_tiers(tmp_path: Path, dtype: str) -> None:
    """``kvtier inspect config --check`` checks each codec tier's file store without
    creating it and runs a probe page through its codec in memory: a lossy codec's answer
    is its rounding of the page, not a failure."""
    codecs = ["fp8-e4m3", "int8", "zstd", "lz4"]
    cfg = _config(tmp_path, *({"codec": c} for c in codecs))
    cfg["model"] = {"preset": "tiny", "dtype": dtype}
    config = load_config(cfg, env={}).config
    checks = await check_tiers(config)
    assert [(c.tier, c.ok, c.error) for c in checks] == [(t.name, True, None) for t in config.tiers]
    assert isinstance(create_backend(config, 1), CodecStore)
    assert not any(tmp_path.iterdir())


def test_a_codec_on_a_memory_tier_fails_its_config_check(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {})
    cfg["tiers"][0]["codec"] = "zstd"
    config = load_config(cfg, env={}).config
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.codec \(dram\): .*store backend"):
        create_backend(config, 0)


# -- hierarchies --------------------------------------------------------------------------


async def test_pages_cross_mixed_codec_tiers_byte_for_byte(tmp_path: Path) -> None:
    """dram -> file (zstd) -> file (lz4) -> file (none): every page is evicted through
    the codec tiers and read back identical."""
    cfg = _config(
        tmp_path,
        {"codec": "zstd", "capacity": 24 * PAGE},
        {"codec": "lz4", "capacity": 24 * PAGE},
        {"capacity": 256 * PAGE},
        dram_pages=4,
    )
    cfg["pipeline"] = {"write_policy": "write-back"}
    rng = np.random.default_rng(1)
    tokens, pages = _tokens(rng, 40), _kv(rng, 40)
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        stored = await cache.store(tokens, pages)
        assert all(stored.stored)
        await cache.flush()
        where = (await cache.lookup(tokens)).tiers
        assert {"t0", "t1", "t2"} <= set(where)  # pages spread over every lower tier
        loaded = await cache.load(stored.keys[:4])
        cache.release(stored.keys[:4])
        assert loaded.missing == []
        out = np.zeros_like(pages)
        assert all(await cache.read(stored.keys, out))
        np.testing.assert_array_equal(out, pages)
        tiers = {t["name"]: t for t in cache.stats()["tiers"]}
        for name in ("t0", "t1"):
            backend = tiers[name]["backend_stats"]
            assert backend["encoded_pages"] > 0 and backend["codec_ratio"] > 1.0
            assert backend["frame_failures"] == 0


async def test_a_fp8_tier_returns_each_page_as_fp8_rounded_it(tmp_path: Path) -> None:
    """dram -> file (fp8) -> file (zstd): what comes back is the fp8 rounding of what was
    stored, and it stays that exact rounding through the lossless tier below."""
    cfg = _config(
        tmp_path, {"codec": "fp8-e4m3", "capacity": 8 * PAGE}, {"codec": "zstd"}, dram_pages=4
    )
    rng = np.random.default_rng(2)
    tokens, pages = _tokens(rng, 30), _kv(rng, 30)
    codec = make_codec("fp8-e4m3", SPEC)
    expected = np.empty_like(pages)
    enc = np.empty(codec.max_encoded_bytes(), np.uint8)
    for page, want in zip(pages, expected, strict=True):
        codec.encode(page, enc)
        codec.decode(enc, want)
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        stored = await cache.store(tokens, pages)
        await cache.flush()
        hit = await cache.lookup(tokens)
        assert hit.keys == stored.keys and "t1" in hit.tiers
        out = np.zeros_like(pages)
        assert all(await cache.read(stored.keys, out))
        below_dram = [i for i, t in enumerate(hit.tiers) if t != "dram"]
        assert below_dram
        np.testing.assert_array_equal(out[below_dram], expected[below_dram])


async def test_a_corrupted_codec_page_is_a_miss_through_the_cache(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"codec": "zstd"}, dram_pages=2)
    rng = np.random.default_rng(3)
    tokens, pages = _tokens(rng, 6), _kv(rng, 6)
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        stored = await cache.store(tokens, pages)
        await cache.flush()
    victim = stored.keys[0].hex()
    path = tmp_path / "t0" / victim[:2] / victim
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        loaded = await cache.load(stored.keys[:2])
        cache.release(stored.keys[:2])
        assert loaded.missing == [stored.keys[0]]
        out = np.zeros((1, PAGE), np.uint8)
        assert await cache.read(stored.keys[1:2], out) == [True]
        np.testing.assert_array_equal(out[0], pages[1])


# -- lossy and exact never mix ----------------------------------------------------------


async def test_lossy_and_exact_caches_on_one_store_never_see_each_others_pages(
    tmp_path: Path,
) -> None:
    """An fp8 cache and an exact cache take turns on the same file tier: different keys
    for the same tokens, each finds only its own pages, and even a forced read of the
    other's keys is a miss."""
    rng = np.random.default_rng(4)
    tokens, pages = _tokens(rng, 5), _kv(rng, 5)
    exact_cfg = _config(tmp_path, {})
    lossy_cfg = _config(tmp_path, {"codec": "fp8-e4m3"})
    async with KVCache(lossy_cfg, env={}, configure_log=False) as lossy:
        lossy_keys = (await lossy.store(tokens, pages)).keys
        await lossy.flush()
    async with KVCache(exact_cfg, env={}, configure_log=False) as exact:
        assert (await exact.lookup(tokens)).cached_tokens == 0
        exact_keys = (await exact.store(tokens, pages)).keys
        await exact.flush()
    assert not set(exact_keys) & set(lossy_keys)
    async with KVCache(lossy_cfg, env={}, configure_log=False) as lossy:
        hit = await lossy.lookup(tokens)
        assert hit.keys == lossy_keys and hit.tiers == ["t0"] * 5
        out = np.zeros((5, PAGE), np.uint8)
        assert all(await lossy.read(hit.keys, out))
        assert not np.array_equal(out, pages)  # fp8-rounded, as stored by an fp8 cache
        assert await lossy.read(exact_keys, out) == [False] * 5
    async with KVCache(exact_cfg, env={}, configure_log=False) as exact:
        hit = await exact.lookup(tokens)
        assert hit.keys == exact_keys and hit.tiers == ["t0"] * 5
        out = np.zeros((5, PAGE), np.uint8)
        assert all(await exact.read(hit.keys, out))
        np.testing.assert_array_equal(out, pages)
        assert await exact.read(lossy_keys, out[:5]) == [False] * 5


async def test_a_shared_pool_keeps_lossy_and_exact_servers_apart() -> None:
    """Servers on one Valkey pool, some with fp8 on their remote tier: an fp8 server does
    not find an exact server's pages for the same tokens, and later servers of each kind
    find exactly their own kind (exact bytes for the exact one)."""
    reason = unavailable_reason("valkey")
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(5)
    tokens, pages = _tokens(rng, 4), _kv(rng, 4)

    def cfg(url: str, codec: str) -> dict[str, Any]:
        remote = {"name": "remote", "backend": "redis", "capacity": 256 * PAGE, "codec": codec,
                  "options": {"url": url, "key_prefix": "kvtier-codec-test"}}  # fmt: skip
        dram = {"name": "dram", "backend": "dram", "capacity": 16 * PAGE}
        return {"model": {"preset": "tiny"}, "tiers": [dram, remote]}

    with RedisServer("valkey") as server:
        async with (
            KVCache(cfg(server.url, "none"), env={}, configure_log=False) as exact,
            KVCache(cfg(server.url, "fp8-e4m3"), env={}, configure_log=False) as lossy,
        ):
            await exact.store(tokens, pages)
            await exact.flush()
            assert (await lossy.lookup(tokens)).cached_tokens == 0
            await lossy.store(tokens, pages)
            await lossy.flush()
        async with (
            KVCache(cfg(server.url, "none"), env={}, configure_log=False) as exact2,
            KVCache(cfg(server.url, "fp8-e4m3"), env={}, configure_log=False) as lossy2,
        ):
            for cache in (exact2, lossy2):  # each finds its own kind in the pool
                hit = await cache.lookup(tokens)
                assert hit.tiers == ["remote"] * 4
                out = np.zeros_like(pages)
                assert all(await cache.read(hit.keys, out))
                if cache is exact2:
                    np.testing.assert_array_equal(out, pages)
                else:
                    x = pages.view(np.float16).astype(np.float32)
                    y = out.view(np.float16).astype(np.float32)
                    assert not np.array_equal(out, pages)
                    assert np.abs(y - x).max() <= np.abs(x).max() / 16
