"""A cancelled call gives the caller's buffers back when it raises.

An engine reuses its staging buffers as soon as a call returns, cancelled or not. Batches
already started when a ``store`` or ``read`` is cancelled run on worker threads (DRAM
copies over 1 MiB, file reads); if the call raised before they stopped, a store went on
copying the caller's overwritten buffer into the cache (pages published under the
original tokens with the new bytes: wrong KV served), and a read went on writing pages
into ``out`` after the caller had put its own data there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.testing.case import cancel_after

#: 128 KiB pages, 16 per batch: a batch is a 2 MiB copy, which the DRAM arena hands to
#: its worker threads
MODEL = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16",
         "page_tokens": 16, "name": "cancel-buffers"}  # fmt: skip
PAGE_BYTES = 2 * 2 * 16 * 8 * 128 * 2


def _config(path: Path, dram: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pipeline": {"batch_pages": 16},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": dram},
            {"name": "nvme", "backend": "nvme", "capacity": "64MiB",
             "options": {"path": str(path), "preallocate": False}},
        ],
    }  # fmt: skip


async def test_a_cancelled_store_never_publishes_what_the_caller_wrote_after(
    tmp_path: Path,
) -> None:
    wrong = cancelled = 0
    for trial, turns in enumerate([1, 2, 3, 5, 8] * 3):
        async with KVCache(
            _config(tmp_path / f"s{trial}", "16MiB"), env={}, configure_log=False
        ) as cache:
            n = 48
            tokens = np.arange(n * 16) + trial * 100_000
            orig = np.random.default_rng(trial).integers(0, 256, (n, PAGE_BYTES), np.uint8)
            buf = orig.copy()  # the engine's staging buffer
            cancelled += await cancel_after(cache.store(tokens, buf), turns)
            buf[:] = 0xEE  # reused for the next request as soon as store() returned
            await cache.flush()
            hit = await cache.lookup(tokens)
            out = np.zeros((len(hit.keys), PAGE_BYTES), np.uint8)
            ok = await cache.read(hit.keys, out)
            wrong += sum(1 for i, k in enumerate(ok) if k and not (out[i] == orig[i]).all())
    assert cancelled > 0, "no store was cancelled midway: the test lost its point"
    assert wrong == 0, f"{wrong} pages served with bytes written after store() was cancelled"


@pytest.mark.parametrize("tier", ["dram", "nvme"])
async def test_a_cancelled_read_never_writes_into_out_after_it_raised(
    tmp_path: Path, tier: str
) -> None:
    async with KVCache(_config(tmp_path / "s", "32MiB"), env={}, configure_log=False) as cache:
        n = 64
        tokens = np.arange(n * 16)
        pages = np.random.default_rng(0).integers(0, 256, (n, PAGE_BYTES), np.uint8)
        keys = (await cache.store(tokens, pages)).keys
        await cache.flush()
        if tier == "nvme":
            assert await cache.demote("dram", keys) == []
        changed = cancelled = 0
        for turns in (1, 2, 3, 4, 6):
            out = np.zeros((n, PAGE_BYTES), np.uint8)
            cancelled += await cancel_after(cache.read(keys, out), turns)
            out[:] = 0x11  # the caller's own data, once read() raised
            await asyncio.sleep(0.2)  # time for a stray copy to land
            changed += int((out != 0x11).any(axis=1).sum())
        assert cancelled > 0, "no read was cancelled midway: the test lost its point"
        assert changed == 0, f"{changed} pages of out written after read() was cancelled"


@pytest.mark.parametrize("backend", ["file", "nvme"])
async def test_a_cancelled_store_read_returns_once_its_threads_stopped(
    tmp_path: Path, backend: str
) -> None:
    """A store read cut into one group per thread (``Backend.run_blocking_chunks`` in the
    file store, ``_slot_io`` groups in the NVMe store); cancelled, it raised at once (a
    cancelled ``gather`` reports its thread futures cancelled while the threads still
    run; the NVMe store shielded its groups and did not wait), and the threads wrote into
    ``out`` afterwards. Both stores now promise ``get_finishes_before_raising`` (the file
    store's one-hop reads too: ``Backend.run_blocking`` waits for its thread), so the
    cache no longer shields their reads."""
    from kvtier.backends.filestore import FileStore
    from kvtier.backends.nvme import NvmeStore

    n, page = 16, 1 << 20
    store = (
        FileStore(page_bytes=page, capacity_pages=n, path=str(tmp_path), io_threads=2)
        if backend == "file"
        else NvmeStore(page_bytes=page, capacity_pages=n, path=str(tmp_path), io_threads=2,
                       engine="posix", preallocate=False)
    )  # fmt: skip
    async with store:
        pages = np.random.default_rng(3).integers(0, 256, (n, page), np.uint8)
        keys = [bytes([i]) * 16 for i in range(n)]
        assert await store.put(keys, list(pages)) == [True] * n
        late = cancelled = 0
        for turns in (1, 2, 3, 4):
            out = np.zeros((n, page), np.uint8)
            cancelled += await cancel_after(store.get(keys, out), turns)
            out[:] = 0x11
            await asyncio.sleep(0.2)
            late += int((out != 0x11).any(axis=1).sum())
        assert cancelled > 0, "no read was cancelled midway: the test lost its point"
        assert late == 0, f"{late} pages of out written after get() was cancelled"
