"""The KVCache facade: store / lookup / load / read / prefetch / delete / flush, typed and
torch inputs, restart recovery, listeners, metrics (Python and Prometheus) and logs."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from cache_kit import PAGE, PT, SPEC, config, open_cache, sequence, tier

from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError
from kvtier.keys import ROOT_KEY, Namespace, page_keys


async def test_store_lookup_load_read_release(tmp_path):
    rng = np.random.default_rng(20)
    async with open_cache(config(tmp_path)) as cache:
        assert cache.spec == SPEC and [t.name for t in cache.tiers] == ["dram", "file"]
        tokens, data = sequence(rng, 5)
        tail = rng.integers(0, 50_000, size=PT - 1)  # a partial page gets no key
        res = await cache.store(np.concatenate([tokens, tail]), data)
        assert res.stored == [True] * 5 and res.keys == cache.page_keys(tokens)

        hit = await cache.lookup(tokens)
        assert hit.keys == res.keys and hit.tiers == ["dram"] * 5
        assert hit.cached_tokens == 5 * PT
        other = tokens.copy()
        other[2 * PT] += 1  # diverges in page 2: only pages 0 and 1 are a cached prefix
        assert (await cache.lookup(other)).cached_tokens == 2 * PT

        loaded = await cache.load(res.keys)
        assert loaded.missing == [] and None not in loaded.slots
        arena = cache.tiers[0].arena
        for slot, row in zip(loaded.slots, data, strict=True):
            assert np.array_equal(arena.view(slot), row)
            assert torch.equal(arena.tensor(slot), torch.from_numpy(row))
        assert all(cache.directory.is_pinned(k) for k in res.keys)
        await cache.release(res.keys)  # may be awaited or not
        assert not any(cache.directory.is_pinned(k) for k in res.keys)

        out = np.zeros_like(data)
        assert await cache.read(res.keys, out) == [True] * 5
        assert np.array_equal(out, data)

        # a second store of the same pages is a no-op that succeeds
        assert all((await cache.store(tokens, data)).stored)
        assert cache.metrics.snapshot()["tiers"]["dram"]["stored_pages"] == 5


async def test_typed_and_torch_pages_and_keyed_store(tmp_path):
    rng = np.random.default_rng(21)
    async with open_cache(config(tmp_path)) as cache:
        tokens = rng.integers(0, 1000, size=3 * PT)
        typed = rng.standard_normal((3, *SPEC.page_shape)).astype(np.float16)
        res = await cache.store(tokens, typed)
        assert all(res.stored)
        out = torch.zeros((3, *SPEC.page_shape), dtype=torch.float16)
        assert all(await cache.read(res.keys, out))
        assert np.array_equal(out.numpy(), typed)

        t_tokens = rng.integers(0, 1000, size=2 * PT)
        t_pages = torch.randn((2, *SPEC.page_shape), dtype=torch.float16)
        res2 = await cache.store(t_tokens, t_pages)
        rows = [np.zeros(PAGE, dtype=np.uint8) for _ in range(2)]
        assert all(await cache.read(res2.keys, rows))
        assert np.array_equal(np.stack(rows), t_pages.view(torch.uint8).reshape(2, PAGE).numpy())

        # keyed form, with another namespace (different keys, same bytes)
        ns = Namespace("other-model", kv_dtype=SPEC.dtype, page_tokens=SPEC.page_tokens)
        keys = page_keys(tokens, ns)
        assert set(keys).isdisjoint(res.keys)
        parents = [ROOT_KEY, *keys[:-1]]
        assert (
            await cache.store_pages(keys, list(typed), parents=parents, namespace=ns) == [True] * 3
        )
        assert cache.directory.get(keys[1]).parent == keys[0]  # type: ignore[union-attr]


async def test_prefetch_delete_flush(tmp_path):
    rng = np.random.default_rng(22)
    async with open_cache(config(tmp_path, write_policy="write-back")) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        assert not any(cache.directory.is_committed(k, "file") for k in keys)
        assert await cache.flush() == 4
        assert all(cache.directory.is_committed(k, "file") for k in keys)
        await cache.demote("dram", keys[:2])
        result = await cache.prefetch(keys, deadline_s=5)
        assert sorted(result.arrived) == sorted(keys) and result.late == []
        unknown = bytes(16)
        assert (await cache.prefetch([unknown], 1)).missing == [unknown]
        assert await cache.delete(keys[:2]) == 4  # two pages, two tiers each
        assert [cache.directory.locate(k) for k in keys] == [None, None, "dram", "dram"]
        assert (await cache.lookup(tokens)).cached_tokens == 0
        cache.directory.check_invariants()


async def test_reopen_recovers_pages_from_the_file_tier(tmp_path):
    rng = np.random.default_rng(23)
    cfg = config(tmp_path)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 6)
        await cache.store(tokens, data)
    async with open_cache(cfg) as again:
        hit = await again.lookup(tokens)
        assert hit.tiers == ["file"] * 6
        loaded = await again.load(hit.keys, pin=False)
        assert loaded.missing == []
        assert not any(again.directory.is_pinned(k) for k in hit.keys)
        out = np.zeros_like(data)
        assert all(await again.read(hit.keys, out)) and np.array_equal(out, data)


async def test_listeners_follow_commits_and_removals(tmp_path):
    rng = np.random.default_rng(24)
    seen: dict[bytes, set[str]] = {}

    class Tree:
        def on_commit(self, key: bytes, tier: str) -> None:
            seen.setdefault(key, set()).add(tier)

        def on_remove(self, key: bytes, tier: str) -> None:
            seen[key].discard(tier)

    async with open_cache(config(tmp_path, dram_pages=4)) as cache:
        cache.directory.subscribe(Tree())
        for _ in range(5):
            tokens, data = sequence(rng, 3)
            await cache.store(tokens, data)
        await cache.flush()
        for key, tiers in seen.items():
            assert tiers == set(cache.directory.tiers_of(key))


async def test_metrics_snapshot_and_prometheus(tmp_path):
    rng = np.random.default_rng(25)
    async with open_cache(config(tmp_path, dram_pages=4)) as cache:
        seqs = []
        for _ in range(4):
            tokens, data = sequence(rng, 3)
            seqs.append((await cache.store(tokens, data)).keys)
        for keys in seqs:
            await cache.load(keys, pin=False)
        snap = cache.metrics.snapshot()
        lat = snap["fetch_latency_s"]
        assert lat["count"] == 4 and 0 < lat["p50"] <= lat["p99"] <= lat["max"]
        assert snap["tiers"]["file"]["hits"] > 0 and snap["tiers"]["dram"]["misses"] > 0
        link = snap["links"]["file->dram"]
        assert link["pages"] > 0 and link["seconds"] > 0 and link["gb_per_s"] > 0
        assert set(snap["queues"]) == {"fetch", "prefetch", "evict"}
        text = cache.metrics.to_prometheus()
        assert "# TYPE kvtier_hits_total counter" in text
        assert f'kvtier_link_pages_total{{link="file->dram"}} {int(link["pages"])}' in text
        assert 'kvtier_fetch_latency_seconds_bucket{le="+Inf"} 4' in text
        assert "kvtier_fetch_latency_seconds_count 4" in text
        for line in text.splitlines():
            if line and not line.startswith("#"):
                _name, value = line.rsplit(" ", 1)
                float(value)  # every sample is a number


async def test_json_logs_go_to_stderr_once_per_outage(tmp_path, capsys):
    import shutil

    rng = np.random.default_rng(26)
    async with open_cache(config(tmp_path, dram_pages=4)) as cache:
        tokens, data = sequence(rng, 8)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        shutil.rmtree(tmp_path / "file")  # the file tier loses its pages
        out = np.zeros_like(data)
        for _ in range(3):
            await cache.read(keys, out)
    captured = capsys.readouterr()
    assert captured.out == ""
    events = [json.loads(line) for line in captured.err.splitlines() if line.startswith("{")]
    assert any(e["event"] == "kvtier cache open" for e in events)
    failing = [e for e in events if e["event"].startswith("tier failing")]
    assert len(failing) == 1 and failing[0]["tier"] == "file"


@pytest.mark.parametrize("level", ["warning", "error"])
async def test_stdlib_log_lines_follow_the_log_config(level, capsys):
    """A remote store's outage line (logged through :mod:`logging`, as the built-in
    backends do) went to Python's last-resort handler: bare text among JSON lines, and
    printed at ``level = "error"`` too. It now takes ``[log]``'s format and level."""
    from kvtier.testing.servers import free_port

    cfg = {
        "model": {"preset": "tiny"},
        "log": {"format": "json", "level": level},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "16KiB"},
            {"name": "remote", "backend": "redis", "capacity": "1MiB",
             "options": {"url": f"redis://127.0.0.1:{free_port()}/0",
                         "op_timeout_s": 0.5, "connect_timeout_s": 0.5}},
        ],
    }  # fmt: skip
    rng = np.random.default_rng(29)
    async with KVCache(cfg, env={}) as cache:
        await cache.store(*sequence(rng, 8))
        await cache.flush()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is a JSON object
    outage = [e for e in events if "unavailable" in e["event"]]
    if level == "error":
        assert outage == []
    else:
        assert len(outage) == 1
        assert outage[0]["component"] == "kvtier.backends.remote"
        assert outage[0]["level"] == "warning" and "timestamp" in outage[0]


async def test_open_classmethod_and_close_idempotent(tmp_path):
    cache = await KVCache.open(config(tmp_path), env={})
    assert cache.is_open
    await cache.close()
    await cache.close()
    assert not cache.is_open
    await asyncio.sleep(0)


def test_default_cache_constructs_without_opening():
    cache = KVCache(env={}, configure_log=False)
    assert cache.config.tiers[0].backend == "dram" and cache.tiers == []
    with pytest.raises(Exception, match="not open"):
        cache.release([])


async def test_single_store_tier_cache(tmp_path):
    """A cache whose only tier is a store: pages round-trip, load reports no slots."""
    rng = np.random.default_rng(27)
    cfg = {
        "model": {"preset": "tiny"},
        "tiers": [
            {
                "name": "disk",
                "backend": "file",
                "capacity": 64 * PAGE,
                "options": {"path": str(tmp_path)},
            }
        ],
    }
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 3)
        res = await cache.store(tokens, data)
        assert all(res.stored)
        loaded = await cache.load(res.keys, pin=False)
        assert loaded.slots == [None] * 3 and loaded.missing == []
        out = np.zeros_like(data)
        assert all(await cache.read(res.keys, out)) and np.array_equal(out, data)
        stats = cache.stats()
        assert stats["tiers"][0]["used_pages"] == 3
        assert stats["tiers"][0]["backend_stats"]["used_pages"] == 3


async def test_demote_moves_pages_down_as_eviction_would(tmp_path):
    rng = np.random.default_rng(7)
    async with KVCache(config(tmp_path), env={}) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        assert await cache.demote("dram", [*keys[:2], bytes(16)]) == []  # unknown: ignored
        assert [cache.directory.locate(k) for k in keys] == ["file", "file", "dram", "dram"]
        assert await cache.demote("file", keys[:1]) == []  # the last tier drops
        assert cache.directory.locate(keys[0]) is None
        await cache.load(keys[2:3])
        with pytest.raises(KVTierUsageError, match="is pinned"):
            await cache.demote("dram", keys[2:])
        assert cache.directory.locate(keys[3]) == "dram"  # nothing moved
        cache.release(keys[2:3])
        with pytest.raises(KVTierUsageError, match="no tier named 'nvme'; tiers: dram, file"):
            await cache.demote("nvme", keys)
        out = np.zeros((3, data.shape[1]), dtype=np.uint8)
        assert all(await cache.read(keys[1:], out)) and np.array_equal(out, data[1:])


async def test_close_names_and_counts_dirty_pages_it_could_not_write_down(tmp_path, capsys):
    """Pages a store reported stored, still dirty in DRAM when the tier below fails for
    good, are lost at close: close says so (one warning with the count per tier) and
    counts them in ``dropped_pages_total``. Before, close logged only "kvtier cache
    closed" and a reopened store had none of them (the probe: 0 of 16, no word)."""
    import shutil

    rng = np.random.default_rng(31)
    cache = open_cache(config(tmp_path, dram_pages=64, write_policy="write-back"))
    await cache.start()
    try:
        tokens, data = sequence(rng, 6)
        assert (await cache.store(tokens, data)).stored == [True] * 6
        shutil.rmtree(tmp_path / "file")  # the tier below can no longer take a page
        (tmp_path / "file").write_bytes(b"")  # nor make its directory again
    finally:
        await cache.close()
    assert cache.metrics.snapshot()["tiers"]["dram"]["dropped_pages"] == 6
    events = [
        json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")
    ]
    lost = [e for e in events if e["event"].startswith("close could not write dirty pages down")]
    assert len(lost) == 1 and lost[0]["pages"] == 6 and lost[0]["tiers"] == {"dram": 6}


async def test_close_after_a_good_flush_reports_nothing_lost(tmp_path, capsys):
    rng = np.random.default_rng(32)
    async with open_cache(config(tmp_path, dram_pages=64, write_policy="write-back")) as cache:
        assert all((await cache.store(*sequence(rng, 6))).stored)
    assert cache.metrics.snapshot()["tiers"]["dram"]["dropped_pages"] == 0
    assert "dirty pages" not in capsys.readouterr().err


def test_every_queue_is_exported_from_the_start() -> None:
    """``kvtier_queue_depth`` had a HELP and TYPE line but no sample until a batch had
    waited, so ``inspect stats --json`` showed ``"queues": {}`` where ``stats()`` showed
    three zeros."""
    from kvtier.metrics import CacheMetrics

    text = CacheMetrics().to_prometheus()
    for queue in ("fetch", "prefetch", "evict"):
        assert f'kvtier_queue_depth{{queue="{queue}"}} 0' in text


async def test_flush_returns_while_other_callers_keep_storing(tmp_path) -> None:
    """``flush`` waited for the pipeline to be idle: with four tasks storing every few
    milliseconds into a full three-tier hierarchy it never was (evictions and write-downs
    never stop), and a probe's flush timed out after 30 s every time. It now finishes the
    work in progress when it is called and writes the dirty pages down, whatever other
    callers start meanwhile."""
    stop = asyncio.Event()
    lower = [tier("file2", "file", 256, options={"path": str(tmp_path / "file2")})]
    cfg = config(tmp_path, dram_pages=16, file_pages=64, extra_tiers=lower)
    async with open_cache(cfg) as cache:

        async def writer(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                await cache.store(*sequence(rng, int(rng.integers(1, 12))))
                await asyncio.sleep(0.005)

        writers = [asyncio.create_task(writer(s)) for s in range(4)]
        try:
            await asyncio.sleep(1.0)
            for _ in range(3):
                await asyncio.wait_for(cache.flush(), 10)
        finally:
            stop.set()
            await asyncio.gather(*writers)
        await cache.flush()  # alone now: nothing is left dirty
        dram = cache.tiers[0]
        assert cache.pipeline.planner.dirty(0, cache.directory.keys_in(dram.name)) == []


async def test_a_forked_child_is_told_to_open_its_own_cache(tmp_path) -> None:
    """A child forked while the cache was open used the parent's copy: ``store`` raised a
    bare ``RuntimeError: no running event loop`` and ``close`` logged a failure per
    tier. Both now raise ``KVTierUsageError`` naming the fork; the parent is unharmed."""
    import os
    import signal

    rng = np.random.default_rng(34)
    async with open_cache(config(tmp_path)) as cache:
        tokens, data = sequence(rng, 2)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what each call raised, then leave at once
            said = []
            for call in (lambda: cache.store(tokens, data), cache.close):
                try:
                    await call()
                    said.append("no error")
                except Exception as exc:
                    said.append(f"{type(exc).__name__}: {exc}")
            os.write(write, "\n".join(said).encode())
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of the parent's state here
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as pipe:
            said = pipe.read().splitlines()
        assert len(said) == 2, said
        assert all(
            s.startswith("KVTierUsageError: this KVCache was started in process") for s in said
        )
        assert all("forked child" in s for s in said)
        assert all((await cache.store(tokens, data)).stored)  # the parent goes on
