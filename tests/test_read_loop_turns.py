"""A read from a DRAM tier awaits the arena's ``get`` directly (the arena promises
``get_finishes_before_raising``): a small one takes one loop turn (the arena's own yield).
A task and a shield per batch, which backends without that promise still get, cost three
turns more (29 -> 43 us per one-page read on the 2-vCPU VM). A cancelled read, small
(copied on the loop) or large (copied by threads), still leaves nothing writing into the
caller's buffer once it has returned, and no page half-copied.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from kvtier.backends.dram import DramArena

from kvtier.cache import KVCache
from kvtier.testing import check_backend, conformance_cases
from kvtier.testing.case import cancel_after


def config(head_dim: int) -> dict[str, Any]:
    """Two DRAM tiers of pages of ``16 * head_dim * 4`` bytes (float16 K and V)."""
    model = {"num_layers": 1, "num_kv_heads": 1, "head_dim": head_dim, "dtype": "float16",
             "page_tokens": 16, "name": "read-turns"}  # fmt: skip
    page = 16 * head_dim * 2 * 2
    return {
        "model": model,
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": 64 * page},
            {"name": "dram2", "backend": "dram", "capacity": 256 * page},
        ],
    }


async def turns_during(coro: Any) -> tuple[Any, int]:
    """Run ``coro`` beside a task that counts loop turns; (its result, turns)."""
    turns = 0
    stop = False

    async def tick() -> None:
        nonlocal turns
        while not stop:
            await asyncio.sleep(0)
            turns += 1

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0)  # the ticker is running
    start = turns
    result = await coro
    taken = turns - start
    stop = True
    await ticker
    return result, taken


async def test_a_small_dram_read_takes_one_loop_turn() -> None:
    async with KVCache(config(64), env={}, configure_log=False) as cache:
        page_bytes = cache.spec.page_bytes
        pages = np.random.default_rng(0).integers(0, 256, (8, page_bytes), dtype=np.uint8)
        keys = (await cache.store(np.arange(16 * 8), pages)).keys
        await cache.pipeline.drain()  # the write-through to dram2 is done
        out = np.zeros((8, page_bytes), np.uint8)
        ok, turns = await turns_during(cache.read(keys, out))
        assert ok == [True] * 8
        assert (out == pages).all()
        assert turns <= 2, f"an 8-page DRAM read took {turns} loop turns"


@pytest.mark.parametrize("head_dim", [64, 4096], ids=["inline-copy", "threaded-copy"])
async def test_a_cancelled_dram_read_leaves_whole_pages_and_nothing_writing(
    head_dim: int,
) -> None:
    async with KVCache(config(head_dim), env={}, configure_log=False) as cache:
        page_bytes = cache.spec.page_bytes
        pages = np.random.default_rng(1).integers(0, 256, (8, page_bytes), dtype=np.uint8)
        keys = (await cache.store(np.arange(16 * 8), pages)).keys
        for turns in (0, 1, 2, 3):
            out = np.zeros((8, page_bytes), np.uint8)
            await cancel_after(cache.read(keys, out), turns)
            for i in range(8):  # every page is all old or all new bytes
                assert (out[i] == 0).all() or (out[i] == pages[i]).all()
            out[:] = 0x5A  # the caller's own bytes, once read() is over
            await asyncio.sleep(0.05)  # a copy thread still running would write by now
            assert (out == 0x5A).all(), "the read wrote into out after it returned"


async def test_the_dram_arena_keeps_its_promise_with_threaded_copies() -> None:
    """The conformance case of ``get_finishes_before_raising`` on pages large enough for
    the arena to split a get across its copy threads (the kit's usual pages copy inline).
    Before, a cancelled threaded copy returned at once (a cancelled ``gather`` reports its
    thread futures cancelled while the threads still run)."""
    case = next(c for c in conformance_cases() if c.name == "cancelled_get_stops_writing")
    report = await check_backend(
        lambda: DramArena(page_bytes=1 << 20, capacity_pages=32), cases=[case]
    )
    assert report.passed == ["cancelled_get_stops_writing"], report
