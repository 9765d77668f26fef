"""The NVMe store against a dict model: random puts, deletes, two-phase puts, reopens.

Hypothesis drives sequences of operations on a small store (capacity 6, three slots per
slab, so slots and slabs are reused all the time) and checks after every step that the
store holds exactly the committed pages of the model, with exactly their bytes, and that
uncommitted reservations are invisible but count against capacity.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.backends.nvme import NvmeStore

from kvtier.backend import Reservation
from kvtier.keys import PageKey

PAGE = 4096 + 40
CAPACITY = 6
KEYS = st.integers(min_value=0, max_value=9)


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


class NvmeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # tmpfs where there is one: fsync is free there, so many steps fit in little time.
        shm = Path("/dev/shm")
        base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-nvme-sm-", dir=base))
        self.store = self._open()
        self.model: set[int] = set()
        self.pending: dict[int, Reservation] = {}

    def _open(self) -> NvmeStore:
        s = NvmeStore(
            page_bytes=PAGE,
            capacity_pages=CAPACITY,
            path=self.dir / "s",
            slab_bytes=3 * 8192,
            io_threads=2,
        )
        self.loop.run_until_complete(s.open())
        return s

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def room(self) -> int:
        return CAPACITY - len(self.model) - len(self.pending)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4))
    def put(self, ids: list[int]) -> None:
        # A pending (uncommitted) reservation of the same key does not help: new slots.
        fresh = {i for i in ids if i not in self.model}
        fits = len(fresh) <= self.room()
        ok = self.run(self.store.put([key(i) for i in ids], [page(i) for i in ids]))
        for i, o in zip(ids, ok, strict=True):
            if o:
                self.model.add(i)
            else:
                assert i not in self.model
        if fits:
            assert all(ok), (ids, ok)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def delete(self, ids: list[int]) -> None:
        ok = self.run(self.store.delete([key(i) for i in ids]))
        assert ok == [i in self.model for i in ids]
        self.model.difference_update(ids)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=6))
    def get(self, ids: list[int]) -> None:
        outs = [np.zeros(PAGE, np.uint8) for _ in ids]
        hits = self.run(self.store.get([key(i) for i in ids], outs))
        assert hits == [i in self.model for i in ids]
        for i, hit, out in zip(ids, hits, outs, strict=True):
            if hit:
                assert np.array_equal(out, page(i))

    @precondition(lambda self: self.room() > 0)
    @rule(i=KEYS)
    def reserve_and_write(self, i: int) -> None:
        if i in self.model or i in self.pending:
            return
        (r,) = self.run(self.store.reserve([key(i)], "sm"))
        assert r is not None and not r.present
        assert self.run(self.store.write([r], [page(i)])) == [True]
        self.pending[i] = r
        assert self.run(self.store.contains([key(i)])) == [False]

    @precondition(lambda self: bool(self.pending))
    @rule(commit=st.booleans())
    def finish_pending(self, commit: bool) -> None:
        ids = sorted(self.pending)
        rs = [self.pending.pop(i) for i in ids]
        if commit:
            assert self.run(self.store.commit(rs)) == [True] * len(rs)
            self.model.update(ids)
        else:
            self.run(self.store.abort(rs))

    @rule()
    def reopen(self) -> None:
        self.run(self.store.close())
        self.pending.clear()  # uncommitted work is dropped by close
        self.store = self._open()
        assert self.store.stats()["recovered_pages"] == len(self.model)

    @invariant()
    def matches_model(self) -> None:
        assert self.store.used_pages() == len(self.model) + len(self.pending)
        assert sorted(self.run(self.store.keys())) == sorted(key(i) for i in self.model)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


NvmeModel.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_nvme_store_matches_model = NvmeModel.TestCase
