"""A hypothesis state machine over a live KVCache (real DRAM arena over a real file
store): random stores, loads with pins, releases, reads, prefetches, deletes and flushes.

After every step: the directory is consistent and agrees with every backend's occupancy,
the top tier holds its watermark (only pins may hold it above), pinned pages are resident
in the top tier, and every page stored and not deleted reads back with exactly the bytes
stored (the file tier is large enough that nothing is ever dropped).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np
from cache_kit import PAGE, config
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.cache import KVCache
from kvtier.errors import CapacityError
from kvtier.keys import PageKey

POOL = 12  # distinct sequences the machine draws from
SEQ_PAGES = 3


class CacheMachine(RuleBasedStateMachine):
    write_policy = "write-back"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        cfg = config(
            Path(self.tmp.name),
            dram_pages=6,
            file_pages=POOL * SEQ_PAGES * 2,
            write_policy=self.write_policy,
            batch_pages=2,
        )
        self.cache = KVCache(cfg, env={}, configure_log=False)
        self.run(self.cache.start())
        rng = np.random.default_rng(0)
        self.seqs = []
        for _ in range(POOL):
            tokens = rng.integers(0, 50_000, size=SEQ_PAGES * 4)
            data = rng.integers(0, 256, size=(SEQ_PAGES, PAGE), dtype=np.uint8)
            self.seqs.append((tokens, data, self.cache.page_keys(tokens)))
        self.stored: dict[PageKey, np.ndarray] = {}
        self.fetched: set[PageKey] = set()  # pages the last load/prefetch brought up
        self.pins: list[list[PageKey]] = []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.cache.close())
        self.loop.close()
        self.tmp.cleanup()

    seq = st.integers(0, POOL - 1)

    @rule(i=seq)
    def store(self, i):
        tokens, data, keys = self.seqs[i]
        self.fetched = set()
        top = self.cache.tiers[0]
        try:
            res = self.run(self.cache.store(tokens, data))
        except CapacityError:
            # only when pinned pages leave no room for one batch
            assert self.cache.directory.pinned(top.name) > top.capacity_pages - SEQ_PAGES
            return
        for k, ok, row in zip(keys, res.stored, data, strict=True):
            if ok:
                self.stored[k] = row

    @rule(i=seq)
    def load_and_pin(self, i):
        keys = self.seqs[i][2]
        top = self.cache.tiers[0]
        pinned = {k for ks in self.pins for k in ks if k in self.stored}
        room_needed = len(pinned | {k for k in keys if k in self.stored})
        try:
            result = self.run(self.cache.load(keys))
        except CapacityError:
            # only when the pinned pages really cannot fit; nothing stays pinned
            assert room_needed > top.high_pages
            assert not any(self.cache.directory.is_pinned(k) for k in keys if k not in pinned)
            return
        self.pins.append(keys)
        self.fetched = set(keys)
        arena = self.cache.tiers[0].arena
        for k, slot in zip(keys, result.slots, strict=True):
            if k in self.stored:
                assert slot is not None
                assert np.array_equal(arena.view(slot), self.stored[k])
            else:
                assert k in result.missing

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def release(self, data):
        keys = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        # released pages may keep the tier above its watermark until the next operation
        # that needs room there
        self.fetched = set(keys) | {k for ks in self.pins for k in ks} | self.fetched

        async def release() -> None:  # from the loop, as an engine calls it
            await self.cache.release(keys)

        self.run(release())

    @rule(i=seq)
    def prefetch(self, i):
        keys = self.seqs[i][2]
        result = self.run(self.cache.prefetch(keys, deadline_s=1.0))
        self.fetched = set(keys)
        absent = {k for k in keys if k not in self.stored}
        assert absent <= set(result.missing)
        # a stored page is missed only when pinned pages leave no room for its batch
        if set(result.missing) - absent:
            top = self.cache.tiers[0]
            assert self.cache.directory.pinned(top.name) > top.capacity_pages - SEQ_PAGES

    @rule(i=seq)
    def delete(self, i):
        keys = self.seqs[i][2]
        if any(self.cache.directory.is_pinned(k) for k in keys):
            return
        self.run(self.cache.delete(keys))
        for k in keys:
            self.stored.pop(k, None)

    @rule()
    def flush(self):
        self.run(self.cache.flush())

    @invariant()
    def consistent(self):
        self.run(self.cache.pipeline.drain())
        c = self.cache
        d = c.directory
        d.check_invariants()
        for t in c.tiers:
            assert d.used(t.name) == t.backend.used_pages(), t.name
            assert t.claimed == 0 and t.reserving == 0
        top = c.tiers[0]
        # above the high watermark only by pins and what the last fetch brought up
        spared = sum(1 for k in self.fetched if d.is_committed(k, top.name) and not d.is_pinned(k))
        assert d.used(top.name) <= max(top.high_pages, d.pinned(top.name) + spared)
        for keys in self.pins:
            for k in keys:
                if k in self.stored:
                    assert d.is_committed(k, top.name)

    @invariant()
    def every_stored_page_reads_back_exactly(self):
        if not self.stored:
            return
        keys = list(self.stored)
        out = np.zeros((len(keys), PAGE), dtype=np.uint8)
        ok = self.run(self.cache.read(keys, out))
        assert all(ok)
        for k, row in zip(keys, out, strict=True):
            assert np.array_equal(row, self.stored[k])


class WriteThroughMachine(CacheMachine):
    write_policy = "write-through"


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
TestCacheWriteBack = CacheMachine.TestCase
TestCacheWriteBack.settings = _SETTINGS
TestCacheWriteThrough = WriteThroughMachine.TestCase
TestCacheWriteThrough.settings = _SETTINGS
