"""Misuse that used to hang, lose pages silently or escape as a raw exception, from an
adversarial audit of the public API: each now gets a ``KVTierUsageError`` (or a
``ConfigError``, or a warning) that names the problem, and changes nothing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kvtier.cache import KVCache
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.sequences import SequenceManager


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "16KiB"},
            {"name": "nvme", "backend": "nvme", "capacity": "1MiB",
             "options": {"path": str(tmp_path / "nvme"), "preallocate": False}},
        ],
        **extra,
    }  # fmt: skip


async def test_a_cache_used_from_another_thread_and_loop_is_refused(tmp_path: Path) -> None:
    """Two loops on one cache hung (a lock bound to another loop marked the NVMe tier
    failing); the cache now names the misuse, and the owner keeps using it."""
    async with KVCache(_config(tmp_path), env={}, configure_log=False) as cache:
        tokens = np.arange(16)
        pages = np.random.default_rng(0).integers(0, 256, (4, 512), np.uint8)
        errors: list[BaseException] = []

        def elsewhere() -> None:
            try:
                asyncio.run(cache.store(tokens, pages))
            except BaseException as exc:  # the test inspects it
                errors.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], KVTierUsageError), errors
        assert "another thread or event loop" in str(errors[0])
        with pytest.raises(KVTierUsageError, match="another thread or event loop"):
            await asyncio.to_thread(cache.release, [])
        assert all((await cache.store(tokens, pages)).stored)


async def test_pages_whose_bytes_do_not_fill_the_page_shape_are_named(tmp_path: Path) -> None:
    async with KVCache(_config(tmp_path), env={}, configure_log=False) as cache:
        shape = cache.spec.page_shape  # float16: 512 bytes a page
        with pytest.raises(KVTierUsageError, match="holds 256 bytes, not 512"):
            await cache.store(np.arange(4), np.zeros((1, *shape), np.uint8))
        sparse = torch.zeros(1, 512, dtype=torch.uint8).to_sparse()
        with pytest.raises(KVTierUsageError, match="dense"):
            await cache.store(np.arange(4), sparse)
        key = cache.page_keys(np.arange(4))[0]
        page = np.zeros((1, 512), np.uint8)
        with pytest.raises(KVTierUsageError, match="parents must be a sequence"):
            await cache.store_pages([key], page, parents=5)  # type: ignore[arg-type]
        parents = (p for p in [None])
        assert await cache.store_pages([key], page, parents=parents) == [True]  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["meta", "sparse"])
async def test_an_append_whose_kv_cannot_be_read_changes_nothing(tmp_path: Path, kind: str) -> None:
    """The block table took the token before the copy failed: the sequence grew by a
    token whose KV was never written, and its page was later published."""
    async with KVCache(_config(tmp_path), env={}, configure_log=False) as cache:
        s = cache.spec

        def kv(n: int, device: str = "cpu") -> torch.Tensor:
            shape = (s.num_layers, s.kv_factor, n, s.num_kv_heads, s.head_dim)
            return torch.ones(shape, dtype=torch.float16, device=device)

        mgr = await SequenceManager.open(cache, 8)
        try:
            seq = mgr.create()
            await mgr.append(seq, [1, 2, 3], kv(3))
            bad = kv(1, "meta") if kind == "meta" else kv(1).to_sparse()
            with pytest.raises(KVTierUsageError, match=r"meta|dense"):
                await mgr.append(seq, [4], bad)
            batch = await mgr.ensure_resident([seq])
            assert batch.seq_lens[0] == 3
            await mgr.release(batch)
        finally:
            await mgr.close()


def _kv(cache: KVCache, n: int, value: float = 1.0) -> torch.Tensor:
    s = cache.spec
    shape = (s.num_layers, s.kv_factor, n, s.num_kv_heads, s.head_dim)
    return torch.full(shape, value, dtype=torch.float16)


async def test_a_sequence_manager_used_from_another_loop_is_refused_before_it_changes(
    tmp_path: Path,
) -> None:
    """``commit`` from another loop raised only when it came to store the pages: the
    version was already used up (a retry on the right loop said "not a live version")
    and the verified pages were not stored. ``fork``, ``free``, ``append`` and others were
    accepted from another thread. Each is now refused before it changes anything."""
    async with KVCache(_config(tmp_path), env={}, configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 8)
        seq = mgr.create()
        version = mgr.snapshot(seq)
        await mgr.append(seq, list(range(8)), _kv(cache, 8))
        calls = {
            "commit": lambda: asyncio.run(mgr.commit(seq, version)),
            "append": lambda: asyncio.run(mgr.append(seq, [9], _kv(cache, 1))),
            "free": lambda: asyncio.run(mgr.free(seq)),
            "fork": lambda: mgr.fork(seq),
            "create": mgr.create,
        }
        for name, call in calls.items():
            with pytest.raises(KVTierUsageError, match="another thread or event loop"):
                await asyncio.to_thread(call)
            assert mgr.tables.seq_ids() == [seq], name
            assert mgr.tables.table(seq).tokens == list(range(8)), name
        await mgr.commit(seq, version)  # the version is still live
        assert len((await cache.lookup(np.arange(8))).keys) == 2
        await mgr.close()


async def test_a_sequence_manager_after_its_cache_closed(tmp_path: Path) -> None:
    """After the cache closed, ``append`` raised BackendClosedError (naming an internal
    arena) after the block table had taken the tokens; ``fork`` and ``free`` were
    accepted; and the manager's own ``close``, documented as idempotent, raised."""
    cache = await KVCache.open(_config(tmp_path), env={}, configure_log=False)
    mgr = await SequenceManager.open(cache, 8)
    seq = mgr.create()
    await mgr.append(seq, [1, 2, 3], _kv(cache, 3))
    await cache.close()
    with pytest.raises(KVTierUsageError, match="KVCache is closed"):
        await mgr.append(seq, [4], _kv(cache, 1))
    with pytest.raises(KVTierUsageError, match="KVCache is closed"):
        mgr.fork(seq)
    with pytest.raises(KVTierUsageError, match="KVCache is closed"):
        await mgr.free(seq)
    await mgr.close()
    await mgr.close()
    with pytest.raises(KVTierUsageError, match="SequenceManager is closed"):
        mgr.create()


async def test_token_ids_in_a_meta_tensor_are_named(tmp_path: Path) -> None:
    async with KVCache(_config(tmp_path), env={}, configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 8)
        seq = mgr.create()
        meta = torch.empty(2, dtype=torch.int64, device="meta")
        with pytest.raises(KVTierUsageError, match="token ids are a meta tensor"):
            await mgr.append(seq, meta, _kv(cache, 2))
        assert mgr.tables.table(seq).tokens == []
        await mgr.close()


async def test_a_close_cut_short_before_its_flush_says_what_it_lost(tmp_path: Path) -> None:
    """``asyncio.wait_for(cache.close(), T)`` running out: pages only DRAM held (write-back)
    are lost, as before, but no longer silently."""
    cfg = _config(tmp_path, pipeline={"write_policy": "write-back"})
    cfg["tiers"][0]["capacity"] = "64KiB"  # 128 pages: all 40 stay dirty in DRAM
    cache = await KVCache.open(cfg, env={}, configure_log=False)
    tokens = np.arange(40 * 4)
    pages = np.random.default_rng(2).integers(0, 256, (40, 512), np.uint8)
    assert all((await cache.store(tokens, pages)).stored)
    with capture_logs() as logs:
        task = asyncio.create_task(cache.close())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lost = [e for e in logs if "dirty pages are lost" in e["event"]]
    assert len(lost) == 1 and lost[0]["pages"] > 0, logs


def test_a_bad_capacity_names_where_it_came_from() -> None:
    env = {"KVTIER_TIERS__DRAM__CAPACITY": "-1GiB"}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity.*KVTIER_TIERS__DRAM__CAPACITY"):
        load_config(None, env=env)


async def test_a_store_path_under_home_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/kv`` in a TOML file or a variable, which no shell expanded, made a directory
    named ``~`` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    cfg["tiers"][1]["options"]["path"] = "~/kv"
    async with KVCache(cfg, env={}, configure_log=False):
        pass
    assert (tmp_path / "home" / "kv").is_dir()
    assert not (tmp_path / "~").exists()
