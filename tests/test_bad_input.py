"""Every bad-input case of the core issue, and tiers failing mid-run.

Bad input: wrong shape, dtype or size handed to store/read, bad keys, unknown backend,
bad backend options, bad config key or value, capacity below one page, misuse (closed
cache, double release, deleting pinned pages, negative deadlines). Each raises a
KVTierUsageError subclass whose message names the problem.

Failing tiers: a backend that starts raising, a store whose directory vanishes, a page
corrupted on disk: each gives misses (False / missing), never wrong bytes, and nothing
already committed elsewhere is lost.
"""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
from cache_kit import (
    PAGE,
    PT,
    SPEC,
    FailingFileStore,
    config,
    damage_on_disk,
    open_cache,
    sequence,
    sequence_below_dram,
)
from kvtier.cli.app import get_app
from structlog.testing import capture_logs
from typer.testing import CliRunner

from kvtier.backend import Reservation
from kvtier.cache import KVCache
from kvtier.errors import (
    BackendUnavailableError,
    ConfigError,
    KVTierUsageError,
    UnknownBackendError,
)
from kvtier.keys import PageKey
from kvtier.transfer import tier as tier_module


@pytest.fixture
async def cache(tmp_path):
    async with open_cache(config(tmp_path)) as c:
        yield c


TOKENS_2 = np.arange(2 * PT)


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        (np.zeros((3, PAGE), np.uint8), r"pages: shape \(3, 512\) does not match \[2, 512\]"),
        (np.zeros((2, PAGE - 1), np.uint8), r"shape \(2, 511\) does not match"),
        (np.zeros((2, *SPEC.page_shape), np.float32), r"dtype float32 does not match .*float16"),
        (torch.zeros((2, *SPEC.page_shape), dtype=torch.bfloat16), r"dtype torch.bfloat16"),
        (np.zeros((2, 2, *SPEC.page_shape), np.float16), r"shape \(2, 2, 2, 2, 4, 2, 8\)"),
        (np.zeros((2, *SPEC.page_shape), ">f2"), r"pages: dtype >f2 is not in native byte order"),
        ("not pages", r"expected a numpy array, a CPU torch tensor or a list"),
        ([b"x" * PAGE], r"got 1 pages for 2 keys"),
        ([b"x" * PAGE, b"x" * 10], r"pages\[1\] must hold 512 bytes"),
        ([np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.int16)], r"pages\[1\]: dtype int16"),
    ],
)
async def test_store_rejects_wrong_shape_dtype_size(cache, pages, match):
    with pytest.raises(KVTierUsageError, match=match):
        await cache.store(TOKENS_2, pages)
    assert len(cache.directory) == 0  # nothing was stored


async def test_store_rejects_bad_tokens(cache):
    with pytest.raises(KVTierUsageError, match="token ids must be integers"):
        await cache.store(np.zeros(PT, np.float32), np.zeros((1, PAGE), np.uint8))
    with pytest.raises(KVTierUsageError, match="1-D"):
        await cache.store(np.zeros((2, PT), np.int64), np.zeros((2, PAGE), np.uint8))
    # ragged: numpy's own ValueError came out of np.asarray before
    with pytest.raises(KVTierUsageError, match="cannot make one array of this list"):
        await cache.store([[1, 2], [3]], np.zeros((1, PAGE), np.uint8))
    with pytest.raises(KVTierUsageError, match="1-D sequence of integers"):
        cache.page_keys([list(range(PT)), [1]])


async def test_read_rejects_bad_output(cache):
    res = await cache.store(TOKENS_2, np.ones((2, PAGE), np.uint8))
    ro = np.zeros((2, PAGE), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(KVTierUsageError, match="out: output array must be writable"):
        await cache.read(res.keys, ro)
    strided = np.zeros((2, 2 * PAGE), np.uint8)[:, ::2]
    with pytest.raises(KVTierUsageError, match="must be C-contiguous"):
        await cache.read(res.keys, strided)
    with pytest.raises(KVTierUsageError, match=r"out\[0\] must be writable"):
        await cache.read(res.keys, [b"x" * PAGE, bytearray(PAGE)])
    # a strided memoryview (numpy cannot wrap it: a bare BufferError before)
    views = [memoryview(bytearray(2 * PAGE))[::2] for _ in range(2)]
    with pytest.raises(KVTierUsageError, match=r"out\[0\] must be C-contiguous"):
        await cache.read(res.keys, views)
    with pytest.raises(KVTierUsageError, match=r"pages\[0\] must be C-contiguous"):
        await cache.store(TOKENS_2, views)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ([b"short"], r"keys\[0\] must be a 16-byte page key, got bytes of 5 bytes"),
        (["a" * 16], r"keys\[0\] must be a 16-byte page key, got str"),
        (bytes(16), r"not a single bytes"),
    ],
)
async def test_bad_keys(cache, keys, match):
    with pytest.raises(KVTierUsageError, match=match):
        await cache.load(keys)
    with pytest.raises(KVTierUsageError, match=match):
        await cache.prefetch(keys, 1.0)


@pytest.mark.parametrize("deadline", [float("nan"), "1", None, True, -0.5])
async def test_prefetch_rejects_a_deadline_that_is_not_seconds(cache, deadline):
    res = await cache.store(TOKENS_2, np.ones((2, PAGE), np.uint8))
    with pytest.raises(KVTierUsageError, match=r"deadline_s must be >= 0 .*got"):
        await cache.prefetch(res.keys, deadline)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parents": ["x", None]}, r"parents\[0\] must be a 16-byte page key or None, got str"),
        ({"parents": [b"short", None]}, r"parents\[0\] must be a 16-byte page key .*5 bytes"),
        ({"parents": "ab"}, r"parents must be a sequence of page keys, not a single str"),
        ({"namespace": 5}, r"namespace must be a Namespace, a label string or None, got int"),
    ],
)
async def test_store_pages_rejects_bad_parents_and_namespace(cache, kwargs, match):
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    with pytest.raises(KVTierUsageError, match=match):
        await cache.store_pages(keys, np.zeros((2, PAGE), np.uint8), **kwargs)
    assert len(cache.directory) == 0  # nothing was stored


async def test_a_key_given_twice_in_one_store_is_named(cache):
    """store_pages([k, k], [A, B]) kept A, reported both stored, and a read of k gave A."""
    a, b = PageKey(b"a" * 16), PageKey(b"b" * 16)
    pages = np.stack([np.full(PAGE, v, np.uint8) for v in (1, 2, 3)])
    with pytest.raises(KVTierUsageError, match=r"keys\[2\] repeats keys\[0\]"):
        await cache.store_pages([a, b, a], pages)
    assert len(cache.directory) == 0  # nothing was stored
    with pytest.raises(KVTierUsageError, match=r"keys\[1\] repeats keys\[0\]"):
        await cache.reserve_private([a, a])
    assert len(cache.directory) == 0  # nothing was reserved
    assert await cache.store_pages([a, b], pages[:2]) == [True, True]


@pytest.mark.parametrize("parent", ["zz", 16, bytes(15)])
async def test_bad_parent_key_is_named(cache, parent):
    with pytest.raises(KVTierUsageError, match=r"parent must be a 16-byte page key"):
        await cache.store(TOKENS_2, np.zeros((2, PAGE), np.uint8), parent=parent)
    with pytest.raises(KVTierUsageError, match=r"parent must be a 16-byte page key"):
        await cache.lookup(TOKENS_2, parent=parent)
    assert len(cache.directory) == 0


async def test_misuse(cache, tmp_path):
    res = await cache.store(TOKENS_2, np.ones((2, PAGE), np.uint8))
    with pytest.raises(KVTierUsageError, match="deadline_s must be >= 0"):
        await cache.prefetch(res.keys, -1)
    await cache.load(res.keys)
    with pytest.raises(KVTierUsageError, match="is pinned: release it first"):
        await cache.delete(res.keys)
    cache.release(res.keys)
    with pytest.raises(KVTierUsageError, match=r"is not pinned \(released twice\?\)"):
        cache.release(res.keys)
    await cache.close()
    with pytest.raises(KVTierUsageError, match="KVCache is closed"):
        await cache.lookup(TOKENS_2)
    with pytest.raises(KVTierUsageError, match="closed; create a new one"):
        await cache.start()


@pytest.mark.parametrize("pin", ["yes", None, 1, np.array([1, 0])])
async def test_load_pin_must_be_a_bool(cache, pin):
    res = await cache.store(TOKENS_2, np.ones((2, PAGE), np.uint8))
    with pytest.raises(KVTierUsageError, match="pin must be True or False"):
        await cache.load(res.keys, pin)
    assert cache.stats()["tiers"][0]["pinned_pages"] == 0  # nothing was pinned


@pytest.mark.parametrize(
    ("kind", "value", "match"),
    [
        ("ttl", True, r"hint 'ttl' needs a finite number value, got True"),
        ("ttl", "30", r"hint 'ttl' needs a finite number value, got '30'"),
        ("next_turn", [1], r"hint 'next_turn' needs a finite number value, got \[1\]"),
        ("close", "x", r"hint 'close' takes no value, got 'x'"),
        (["ttl"], 1.0, r"unknown hint kind \['ttl'\]"),
        (None, None, r"unknown hint kind None"),
    ],
)
async def test_bad_hints_are_named(cache, kind, value, match):
    keys = cache.page_keys(TOKENS_2)
    with pytest.raises(KVTierUsageError, match=match):
        cache.hint(kind, keys, value)


@pytest.mark.parametrize("namespace", [5, b"ns", ["ns"]])
async def test_reserve_private_checks_the_namespace_as_store_pages_does(cache, namespace):
    """An int namespace was accepted here while store_pages refused it."""
    with pytest.raises(KVTierUsageError, match=r"namespace must be a Namespace, a label string"):
        await cache.reserve_private([PageKey(b"p" * 16)], namespace=namespace)
    assert len(cache.directory) == 0  # nothing was reserved
    slots = await cache.reserve_private([PageKey(b"q" * 16)], namespace=cache.namespace)
    await cache.release_private(slots)


async def test_release_private_takes_only_what_reserve_private_gave(cache):
    """Another reservation given back would free a slot a batch in flight is writing."""
    (slot,) = await cache.reserve_private([PageKey(b"p" * 16)])
    stored = await cache.store(TOKENS_2, np.ones((2, PAGE), np.uint8))
    forged = Reservation(stored.keys[0], 0)
    for bad, match in [
        (None, "needs the list reserve_private returned, got NoneType"),
        ("x", "needs the list reserve_private returned, got str"),
        ([forged], r"reservations\[0\] is not a private slot this cache holds"),
        (["x"], r"reservations\[0\] is not a private slot"),
        ([slot, slot], "a slot is given twice"),
    ]:
        with pytest.raises(KVTierUsageError, match=match):
            await cache.release_private(bad)
    await cache.release_private([slot])
    with pytest.raises(KVTierUsageError, match="only what reserve_private returned, once"):
        await cache.release_private([slot])  # released twice
    out = np.zeros((2, PAGE), np.uint8)
    assert await cache.read(stored.keys, out) == [True, True] and out.all()


async def test_unknown_backend_names_it(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"][1]["backend"] = "tape-drive"
    with pytest.raises(UnknownBackendError, match=r"tiers\[1\] \(file, backend 'tape-drive'\)"):
        await open_cache(cfg).start()
    cfg["tiers"][1]["backend"] = "no_such_module:Store"
    with pytest.raises((UnknownBackendError, BackendUnavailableError), match="no_such_module"):
        await open_cache(cfg).start()
    cfg["tiers"][1]["backend"] = "cache_kit:config"
    with pytest.raises(UnknownBackendError, match="is not a kvtier Backend subclass"):
        await open_cache(cfg).start()


async def test_bad_backend_options_name_the_tier(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"][1]["options"] = {}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.options \(file\): .*'path'"):
        await open_cache(cfg).start()
    cfg["tiers"][0]["options"] = {"colour": "blue"}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.options \(dram\): .*colour"):
        await open_cache(cfg).start()


def test_bad_config_and_capacity_below_one_page(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"][0]["capacity"] = PAGE - 1
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: 511 bytes .* one page"):
        open_cache(cfg)
    cfg = config(tmp_path)
    cfg["pipeline"]["batch_size"] = 3
    with pytest.raises(ConfigError, match=r"pipeline\.batch_size: unknown key"):
        open_cache(cfg)
    with pytest.raises(ConfigError, match=r"write_policy: must be one of"):
        KVCache(config(tmp_path), env={"KVTIER_PIPELINE__WRITE_POLICY": "lazy"})


@pytest.mark.parametrize("alone", [False, True], ids=["above-a-file-tier", "alone"])
async def test_a_one_page_tier_is_refused_at_open_naming_the_minimum(tmp_path, alone):
    """Before: storing a sequence of two pages raised CapacityError ("0 of its 1 pages are
    pinned ...") even above a file tier: leaf-first eviction spares the page a batch
    extends, and a one-page tier cannot hold it beside the batch."""
    cfg = config(tmp_path, dram_pages=1)
    if alone:
        del cfg["tiers"][1:]
    match = (
        r"tiers\[0\]\.capacity \(dram\): 1 page cannot hold a page beside the one it "
        r"extends, .*the tier needs at least 2 pages \(1024 bytes\), or set "
        r"pipeline\.leaf_first = false"
    )
    with pytest.raises(ConfigError, match=match):
        await open_cache(cfg).start()
    result = CliRunner().invoke(get_app(), ["inspect", "config", "-c", _toml(tmp_path, cfg)])
    assert result.exit_code == 2 and "needs at least 2 pages" in result.output


async def test_a_batch_larger_than_the_only_tier_is_named_not_blamed_on_pins(tmp_path):
    """A 2-page tier alone, a store of 3 pages: the error told a vLLM operator to release
    loaded pages and close transformers caches, though nothing was pinned. With nothing
    pinned or reserved it now says the tier is smaller than what is stored into it."""
    from kvtier.errors import CapacityError

    cfg = config(tmp_path, dram_pages=2)
    del cfg["tiers"][1:]
    async with open_cache(cfg) as cache:
        tokens = np.arange(3 * cache.spec.page_tokens)
        with pytest.raises(CapacityError) as caught:
            await cache.store(tokens, np.ones((3, cache.spec.page_bytes), np.uint8))
    assert "nothing is pinned" in str(caught.value)
    assert "smaller than the sequences stored into it at once" in str(caught.value)
    assert "cache.release" not in str(caught.value)


@pytest.mark.parametrize(
    ("dram", "extra"),
    [
        ({"capacity": 2 * PAGE}, {}),  # the smallest tier that works with the defaults
        ({"capacity": 4 * PAGE, "high_watermark": 1.0}, {"batch_pages": 3}),
        ({}, {"leaf_first": False}),  # one page: no parent is spared
    ],
)
async def test_the_smallest_tiers_that_take_a_batch_store_every_page(tmp_path, dram, extra):
    """12 pages in batches through a small top tier over a file tier: each is stored."""
    cfg = config(tmp_path, dram_pages=1, **extra)
    cfg["tiers"][0].update(dram)
    tokens, data = sequence(np.random.default_rng(9), 12)
    async with open_cache(cfg) as cache:
        assert all((await cache.store(tokens, data)).stored)
        out = np.zeros_like(data)
        assert all(await cache.read(cache.page_keys(tokens), out))
        assert np.array_equal(out, data)


def _toml(tmp_path, cfg) -> str:
    """``cfg`` (pipeline and tiers of cache_kit's config) as a TOML file."""
    lines = ['[model]\npreset = "tiny"\n[pipeline]']
    lines += [f"{k} = {str(v).lower()}" for k, v in cfg["pipeline"].items()]
    for t in cfg["tiers"]:
        lines.append("[[tiers]]")
        lines += [f"{k} = {v!r}" for k, v in t.items() if k != "options"]
        lines += [f"options = {{ path = {v!r} }}" for v in t.get("options", {}).values()]
    path = tmp_path / "kvtier.toml"
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return str(path)


async def test_tier_raising_mid_run_degrades_to_misses(tmp_path):
    """The file tier starts raising TierIOError: pages only there become misses, pages
    in DRAM are still served, new pages stay in DRAM until it recovers."""
    FailingFileStore.failing = False
    rng = np.random.default_rng(30)
    cfg = config(tmp_path, dram_pages=8, file_backend="cache_kit:FailingFileStore")
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 6)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        down = keys[:3]
        await cache.demote("dram", down)
        FailingFileStore.failing = True

        loaded = await cache.load(keys, pin=False)
        assert loaded.missing == down  # a miss, never an exception or wrong data
        out = np.zeros_like(data)
        ok = await cache.read(keys, out)
        assert ok == [False] * 3 + [True] * 3
        assert np.array_equal(out[3:], data[3:])

        new_tokens, new_data = sequence(rng, 2)
        new = (await cache.store(new_tokens, new_data)).keys  # write-through fails quietly
        await cache.pipeline.drain()
        assert [cache.directory.locate(k) for k in new] == ["dram", "dram"]
        assert not cache.tiers[1].healthy

        FailingFileStore.failing = False  # the device comes back
        assert await cache.flush() == 2  # the dirty pages go down now
        assert cache.tiers[1].healthy
        loaded = await cache.load(keys, pin=False)
        assert loaded.missing == []
        assert all(await cache.read(keys, out)) and np.array_equal(out, data)
        assert cache.metrics.snapshot()["tiers"]["file"]["failed_pages"] > 0
        cache.directory.check_invariants()


async def test_outage_under_pressure_keeps_committed_pages(tmp_path):
    """With the lower tier down and DRAM full of dirty pages, new stores report False
    rather than dropping committed pages."""
    FailingFileStore.failing = False
    rng = np.random.default_rng(31)
    cfg = config(
        tmp_path, dram_pages=6, file_backend="cache_kit:FailingFileStore", write_policy="write-back"
    )
    async with open_cache(cfg) as cache:
        FailingFileStore.failing = True
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        more_tokens, more_data = sequence(rng, 4)
        more = await cache.store(more_tokens, more_data)
        assert not all(more.stored)
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out)) and np.array_equal(out, data)
        FailingFileStore.failing = False
        # write-downs are tried again once WRITE_DOWN_RETRY_S has passed since the last
        # one failed (until then, evictions take only pages that need none)
        await asyncio.sleep(tier_module.WRITE_DOWN_RETRY_S)
        assert all((await cache.store(more_tokens, more_data)).stored)
        assert all(await cache.read(keys, out)) and np.array_equal(out, data)


async def test_a_store_under_a_dead_lower_tier_tries_no_write_down_for_a_while(
    tmp_path, monkeypatch
):
    """DRAM full of dirty pages over a tier that refuses every write: every store tried
    to write down every dirty page, batch by batch, walking the policy's order again for
    each, before it gave up (a 16-session bench run over a dead Valkey took 55 s against
    7 s with DRAM alone). After a refused write-down, while the tier below is in its
    outage, evictions take only victims that need none for ``WRITE_DOWN_RETRY_S``; then
    one eviction tries again, and once the tier works the dirty pages go down. The
    committed pages stay throughout, as before."""
    FailingFileStore.failing = False
    rng = np.random.default_rng(34)
    cfg = config(
        tmp_path,
        dram_pages=32,
        file_backend="cache_kit:FailingFileStore",
        write_policy="write-back",
        batch_pages=4,
    )
    async with open_cache(cfg) as cache:
        FailingFileStore.failing = True
        tokens, data = sequence(rng, 40)
        stored = await cache.store(tokens, data)
        assert not all(stored.stored)  # the tier is full of dirty pages
        kept = [k for k, ok in zip(stored.keys, stored.stored, strict=True) if ok]
        assert len(kept) >= 24
        FailingFileStore.refused = 0
        for _ in range(5):
            assert not any((await cache.store(*sequence(rng, 4))).stored)
        assert FailingFileStore.refused == 0  # within the retry interval: none tried
        monkeypatch.setattr(tier_module, "WRITE_DOWN_RETRY_S", 0.0)
        assert not any((await cache.store(*sequence(rng, 4))).stored)
        assert 0 < FailingFileStore.refused <= 24  # once to make room, once to trim (14 + 10)
        out = np.zeros((len(kept), PAGE), np.uint8)
        assert all(await cache.read(kept, out))
        assert np.array_equal(out, data[[stored.keys.index(k) for k in kept]])
        FailingFileStore.failing = False  # the device is back
        assert all((await cache.store(*sequence(rng, 4))).stored)


async def test_flushes_under_a_dead_lower_tier_warn_once_a_minute(tmp_path):
    """Every ``flush()`` under a dead lower tier logged "flush could not write every
    dirty page down" (1,001 lines for 1,000 flushes, about 4,800 a minute); like
    "write-through blocked", it is now logged at most once a minute per tier, with the
    count held back."""
    FailingFileStore.failing = False
    rng = np.random.default_rng(35)
    cfg = config(tmp_path, dram_pages=16, file_backend="cache_kit:FailingFileStore")
    async with open_cache(cfg) as cache:
        FailingFileStore.failing = True
        await cache.store(*sequence(rng, 4))
        with capture_logs() as logs:
            for _ in range(20):
                await cache.flush()
        lines = [e for e in logs if e["event"] == "flush could not write every dirty page down"]
        assert len(lines) == 1 and lines[0]["failed"] == 4 and lines[0]["held_back"] == 0
        FailingFileStore.failing = False


async def test_vanished_store_directory_gives_misses(tmp_path):
    rng = np.random.default_rng(32)
    async with open_cache(config(tmp_path, dram_pages=4)) as cache:
        tokens, data = sequence(rng, 8)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        in_dram = [k for k in keys if cache.directory.is_committed(k, "dram")]
        shutil.rmtree(tmp_path / "file")
        out = np.zeros_like(data)
        ok = await cache.read(keys, out)
        assert [k for k, o in zip(keys, ok, strict=True) if o] == in_dram
        for o, row, got in zip(ok, data, out, strict=True):
            if o:
                assert np.array_equal(got, row)
        loaded = await cache.load(keys[:4], pin=False)
        assert set(loaded.missing) == {k for k in keys[:4] if k not in in_dram}


async def test_corrupted_page_on_disk_is_a_miss(tmp_path):
    rng = np.random.default_rng(33)
    async with open_cache(config(tmp_path, dram_pages=4)) as cache:
        keys, data = await sequence_below_dram(cache, rng, 2)
        damage_on_disk(cache, keys[0])
        out = np.zeros_like(data)
        assert await cache.read(keys, out) == [False, True]
        assert np.array_equal(out[1], data[1])
        assert cache.directory.locate(keys[0]) is None  # the bad copy is forgotten
        assert (await cache.load(keys, pin=False)).missing == [keys[0]]


async def test_store_pages_parents_that_close_a_cycle_do_not_jam_a_tier(tmp_path) -> None:
    """A caller's parents may contradict the chain stored before: a -> b -> c stored, a
    deleted (b and c stay), a stored again "after c". Recorded, that closes a cycle in
    which no page is ever a leaf, and leaf-first eviction of the lowest tier offered
    nothing: its writes blocked and it stayed full. Now the contradicting parent is not
    recorded and the tiers keep making room."""

    def key(i: int) -> PageKey:
        return PageKey(i.to_bytes(2, "little") * 8)

    page = np.ones((1, PAGE), np.uint8)
    async with open_cache(config(tmp_path, dram_pages=8, file_pages=32)) as cache:
        for r in range(20):
            a, b, c = key(3 * r + 1), key(3 * r + 2), key(3 * r + 3)
            await cache.store_pages([a, b, c], np.ones((3, PAGE), np.uint8), parents=[None, a, b])
            await cache.store_pages([key(1000 + r)], page)
            await cache.delete([a])
            await cache.store_pages([a], page, parents=[c])
            assert cache.prefix_tree.parent_of(a) is None
        for r in range(40):
            await cache.store_pages([key(2000 + r)], page)
        await cache.flush()
        for t in cache.stats()["tiers"]:
            assert t["used_pages"] <= t["high_pages"], t
        assert cache.directory.locate(key(2039)) is not None


async def test_a_namespace_of_another_page_geometry_is_refused(cache):
    """A namespace may name another model, revision or rank, but not other tokens per
    page, another KV dtype or layout: 16 tokens stored as one page of this cache's size
    under a p16 / float32 label were accepted before, keyed as what they are not."""
    import dataclasses

    own = cache.namespace
    for other in (
        dataclasses.replace(own, page_tokens=own.page_tokens * 4),
        dataclasses.replace(own, kv_dtype="float32"),
        dataclasses.replace(own, layout_version=own.layout_version + 1),
    ):
        tokens = list(range(other.page_tokens))
        with pytest.raises(KVTierUsageError, match="not another page geometry"):
            await cache.store(tokens, np.zeros((1, PAGE), np.uint8), namespace=other.label)
        with pytest.raises(KVTierUsageError, match="not another page geometry"):
            cache.page_keys(tokens, namespace=other)
        with pytest.raises(KVTierUsageError, match="not another page geometry"):
            await cache.lookup(tokens, namespace=other)
    fine = dataclasses.replace(own, model_id="another-model", revision="r2", rank=1)
    res = await cache.store(list(range(own.page_tokens)), np.ones((1, PAGE), np.uint8),
                            namespace=fine)  # fmt: skip
    assert res.stored == [True]
