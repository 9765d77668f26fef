"""Block tables: appends, copy-on-write forks, versions, packing; stateful model check.

The working pool here is a real in-memory page store (one list of token ids per slot), so
every copy the tables ask for really happens and the contents can be read back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.block_table import (
    PAD_SLOT,
    BlockTables,
    SequenceFinishedError,
    SequenceLengthError,
    SlotPool,
    UnknownSequenceError,
    VersionError,
    pack_slots,
)
from kvtier.keys import PageKey

PT = 4


class Memory:
    """Working slots holding token ids per position (the KV stand-in)."""

    def __init__(self, slots: int) -> None:
        self.slots: list[list[int | None]] = [[None] * PT for _ in range(slots)]
        self.published: dict[PageKey, list[int]] = {}

    def copy(self, src: int, dst: int, tokens: int) -> None:
        self.slots[dst][:tokens] = self.slots[src][:tokens]

    def write(self, tables: BlockTables, seq: int, tokens: list[int]) -> None:
        for w in tables.append(seq, tokens):
            self.slots[w.slot][w.offset : w.offset + w.count] = tokens[
                w.src_start : w.src_start + w.count
            ]

    def read(self, tables: BlockTables, seq: int) -> list[int | None]:
        t = tables.table(seq)
        out: list[int | None] = []
        for i, p in enumerate(t.pages):
            n = min(PT, t.num_tokens - i * PT)
            src = self.published[p.key] if p.slot == PAD_SLOT else self.slots[p.slot]
            assert p.slot != PAD_SLOT or p.key is not None
            out.extend(src[:n])
        return out

    def publish(self, tables: BlockTables, seq: int) -> int:
        n = 0
        for lp, page in tables.publishable(seq):
            content = list(self.slots[page.slot])
            key = PageKey(lp.to_bytes(8, "little") + page.pid.to_bytes(8, "little"))
            self.published[key] = content
            tables.mark_published(page, key)
            n += 1
        return n


def make(slots: int = 64, max_tokens: int | None = None) -> tuple[BlockTables, Memory]:
    mem = Memory(slots)
    return BlockTables(PT, SlotPool(range(slots)), mem.copy, max_tokens), mem


def test_append_allocates_pages_as_they_fill() -> None:
    tables, mem = make()
    s = tables.create()
    mem.write(tables, s, [1, 2, 3])
    assert len(tables.table(s).pages) == 1
    mem.write(tables, s, [4, 5, 6, 7, 8, 9])
    assert len(tables.table(s).pages) == 3
    assert mem.read(tables, s) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert tables.pool.in_use == 3
    assert tables.free(s) == 3
    assert tables.pool.in_use == 0


def test_fork_shares_full_pages_and_copies_partial_on_write() -> None:
    tables, mem = make()
    a = tables.create()
    mem.write(tables, a, list(range(6)))
    b = tables.fork(a)
    ta, tb = tables.table(a), tables.table(b)
    assert ta.pages == tb.pages and tables.pool.in_use == 2
    mem.write(tables, b, [100])
    assert ta.pages[0] is tb.pages[0]  # full page still shared
    assert ta.pages[1] is not tb.pages[1]  # the partial one was copied
    assert tables.cow_copies == 1
    mem.write(tables, a, [200])
    assert tables.cow_copies == 1  # a is now sole holder of its partial page
    assert mem.read(tables, a) == [0, 1, 2, 3, 4, 5, 200]
    assert mem.read(tables, b) == [0, 1, 2, 3, 4, 5, 100]
    tables.free(a)
    assert tb.pages[0].refs == 1 and tables.pool.in_use == 2


def test_snapshot_rollback_restores_exactly_and_frees() -> None:
    tables, mem = make()
    s = tables.create()
    mem.write(tables, s, list(range(6)))
    assert mem.publish(tables, s) == 1
    before = list(tables.table(s).pages)
    v = tables.snapshot(s)
    mem.write(tables, s, [9] * 7)
    assert tables.table(s).verified_tokens == 6
    assert mem.publish(tables, s) == 0  # pages after the snapshot are unverified
    freed = tables.rollback(s, v)
    assert freed >= 2
    assert tables.table(s).pages == before
    assert mem.read(tables, s) == list(range(6))
    assert tables.pool.in_use == 1  # page 0 published, page 1 partial working
    with pytest.raises(VersionError, match="already committed or rolled back"):
        tables.rollback(s, v)


def test_commit_with_keep_truncates_and_publishes_verified() -> None:
    tables, mem = make()
    s = tables.create()
    mem.write(tables, s, [1, 2, 3])
    v = tables.snapshot(s)
    mem.write(tables, s, [4, 5, 6, 7, 8])
    assert mem.publish(tables, s) == 0  # nothing verified is full
    tables.commit(s, v, keep=2)
    assert mem.read(tables, s) == [1, 2, 3, 4, 5]
    assert mem.publish(tables, s) == 1
    with pytest.raises(VersionError):
        tables.commit(s, v)
    v2 = tables.snapshot(s)
    with pytest.raises(KVTierUsageError, match="keep=3"):
        tables.commit(s, v2, keep=3)


def test_bad_input() -> None:
    tables, _mem = make(slots=2, max_tokens=10)
    with pytest.raises(UnknownSequenceError, match="unknown sequence id 42"):
        tables.append(42, [1])
    s = tables.create()
    with pytest.raises(KVTierUsageError, match="integer dtype"):
        tables.append(s, np.array([1.0, 2.0]))
    with pytest.raises(KVTierUsageError, match="integers, got bool"):
        tables.append(s, [True])
    with pytest.raises(KVTierUsageError, match=r"\[0, 2\*\*32\)"):
        tables.append(s, [-1])
    with pytest.raises(SequenceLengthError, match="maximum length of 10"):
        tables.append(s, list(range(11)))
    with pytest.raises(CapacityError, match="needs 3 working slots"):
        tables.append(s, list(range(9)))
    assert tables.table(s).num_tokens == 0 and tables.pool.in_use == 0
    tables.free(s)
    with pytest.raises(SequenceFinishedError, match=f"sequence {s} is finished"):
        tables.fork(s)
    with pytest.raises(SequenceFinishedError):
        tables.free(s)
    with pytest.raises(SequenceFinishedError):
        tables.snapshot(s)


def test_pack_pads_and_checks_width() -> None:
    tables, mem = make()
    a, b = tables.create(), tables.create()
    mem.write(tables, a, list(range(9)))
    mem.write(tables, b, [1])
    packed = tables.pack([a, b], lambda p: p.slot)
    assert packed.dtype == np.int32 and packed.shape == (2, 3)
    assert list(packed[1, 1:]) == [PAD_SLOT, PAD_SLOT]
    assert list(packed[0]) == [p.slot for p in tables.table(a).pages]
    with pytest.raises(KVTierUsageError, match="max_pages=2"):
        tables.pack([a], lambda p: p.slot, max_pages=2)
    assert pack_slots([], 4).shape == (0, 4)


class TablesModel(RuleBasedStateMachine):
    """Random create/append/fork/snapshot/rollback/commit/publish/free against lists."""

    def __init__(self) -> None:
        super().__init__()
        self.tables, self.mem = make(slots=48)
        self.model: dict[int, list[int]] = {}
        self.versions: dict[int, list[tuple[int, list[int]]]] = {}
        self.next_token = 0

    def _tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    @rule()
    def create(self) -> None:
        s = self.tables.create()
        self.model[s] = []
        self.versions[s] = []

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data: st.DataObject, n: int) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        tokens = self._tokens(n)
        try:
            self.mem.write(self.tables, s, tokens)
        except CapacityError:
            return
        self.model[s].extend(tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        c = self.tables.fork(s)
        self.model[c] = list(self.model[s])
        self.versions[c] = [(v, list(toks)) for v, toks in self.versions[s]]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        v = self.tables.snapshot(s)
        self.versions[s].append((v, list(self.model[s])))

    @precondition(lambda self: any(self.versions.values()))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(k for k, v in self.versions.items() if v)))
        i = data.draw(st.integers(0, len(self.versions[s]) - 1))
        v, toks = self.versions[s][i]
        self.tables.rollback(s, v)
        self.model[s] = toks
        del self.versions[s][i:]
        with pytest.raises(VersionError):
            self.tables.rollback(s, v)

    @precondition(lambda self: any(self.versions.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(k for k, v in self.versions.items() if v)))
        i = data.draw(st.integers(0, len(self.versions[s]) - 1))
        v, toks = self.versions[s][i]
        since = len(self.model[s]) - len(toks)
        keep = data.draw(st.none() | st.integers(0, since))
        try:
            self.tables.commit(s, v, keep)
        except CapacityError:  # a cut inside a shared page with no slot for the copy
            assert self.tables.table(s).live_versions() == [v for v, _ in self.versions[s]]
            return  # nothing changed (the invariants check the contents)
        if keep is not None:
            self.model[s] = self.model[s][: len(toks) + keep]
        del self.versions[s][i:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        verified = self.versions[s][0][1] if self.versions[s] else self.model[s]
        for lp, page in self.tables.publishable(s):
            # never publish a page holding an unverified token
            assert (lp + 1) * PT <= len(verified)
            assert self.mem.slots[page.slot] == verified[lp * PT : (lp + 1) * PT]
        self.mem.publish(self.tables, s)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.tables.free(s)
        del self.model[s], self.versions[s]

    @invariant()
    def tables_equal_model(self) -> None:
        for s, toks in self.model.items():
            assert self.tables.table(s).tokens == toks
            assert self.mem.read(self.tables, s) == toks
            assert self.tables.table(s).live_versions() == [v for v, _ in self.versions[s]]

    @invariant()
    def no_leak_and_no_early_free(self) -> None:
        live = self.tables.live_pages()
        holders: dict[int, int] = dict.fromkeys(live, 0)
        for s in self.model:
            t = self.tables.table(s)
            for p in t.pages:
                holders[p.pid] += 1
            for v in t.versions:
                for p in v.pages:
                    holders[p.pid] += 1
        for pid, page in live.items():
            assert page.refs == holders[pid], page
            assert page.slot != PAD_SLOT or page.key is not None, page
        used = {p.slot for p in live.values() if p.slot != PAD_SLOT}
        assert used == set(self.tables.pool.used())

    @invariant()
    def stored_pages_hold_slots_only_while_a_holder_may_cut_them(self) -> None:
        may_cut: set[int] = set()
        for s in self.model:
            t = self.tables.table(s)
            for pages in (t.pages, *(v.pages for v in t.versions)):
                may_cut.update(p.pid for p in pages[t.verified_tokens // PT :])
        for pid, page in self.tables.live_pages().items():
            if page.key is not None and page.slot != PAD_SLOT:
                assert pid in may_cut, page


TestTablesModel = TablesModel.TestCase
TestTablesModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def _state(
    tables: BlockTables, mem: Memory, seq: int
) -> tuple[list[int | None], list[int], int, list[int]]:
    t = tables.table(seq)
    return mem.read(tables, seq), [p.filled for p in t.pages], tables.pool.in_use, t.tokens[:]


def test_truncate_inside_a_stored_page_raises_before_changing_the_table() -> None:
    tables, mem = make()
    s = tables.create()
    mem.write(tables, s, list(range(10)))
    assert mem.publish(tables, s) == 2  # pages 0 and 1 stored, page 2 partial
    before = _state(tables, mem, s)
    with pytest.raises(KVTierUsageError, match="inside a stored page"):
        tables.truncate(s, 5)
    assert _state(tables, mem, s) == before
    assert tables.pool.in_use == 1


def test_truncate_needing_a_copy_with_the_pool_full_changes_nothing() -> None:
    tables, mem = make(slots=2)
    a = tables.create()
    mem.write(tables, a, list(range(7)))  # 2 of 2 working pages, shared with the fork
    b = tables.fork(a)
    before = _state(tables, mem, a)
    # cutting a inside page 0, shared with b, needs a copy and the pool is full
    with pytest.raises(CapacityError):
        tables.truncate(a, 2)
    assert _state(tables, mem, a) == before
    assert mem.read(tables, b) == list(range(7))
    tables.free(b)
    tables.truncate(a, 2)  # sole holder now: cut in place
    assert mem.read(tables, a) == [0, 1] and tables.pool.in_use == 1


def test_commit_keep_needing_a_copy_with_the_pool_full_changes_nothing() -> None:
    tables, mem = make(slots=2)
    a = tables.create()
    v = tables.snapshot(a)
    mem.write(tables, a, list(range(6)))  # 2 of 2 working pages
    b = tables.fork(a)
    before = _state(tables, mem, a)
    with pytest.raises(CapacityError):
        tables.commit(a, v, keep=2)  # cut inside page 0, shared with b
    assert _state(tables, mem, a) == before
    assert tables.table(a).live_versions() == [v]
    tables.free(b)
    tables.commit(a, v, keep=2)  # with room it goes through
    assert mem.read(tables, a) == [0, 1]


@pytest.mark.parametrize("bad", [2.5, "3"])
def test_truncate_and_commit_keep_reject_non_integers(bad: object) -> None:
    tables, mem = make()
    s = tables.create()
    mem.write(tables, s, list(range(6)))
    for wrong in (bad, None, True):
        with pytest.raises(KVTierUsageError, match="truncate num_tokens must be an int"):
            tables.truncate(s, wrong)  # type: ignore[arg-type]
    v = tables.snapshot(s)
    mem.write(tables, s, [7, 8, 9])
    with pytest.raises(KVTierUsageError, match="must be an int"):
        tables.commit(s, v, keep=bad)  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match="must be an int"):
        tables.commit(s, v, keep=True)
    assert tables.table(s).num_tokens == 9 and tables.table(s).live_versions() == [v]


def test_an_unhashable_sequence_id_is_a_clear_error() -> None:
    tables, _mem = make()
    with pytest.raises(UnknownSequenceError, match=r"unknown sequence id \[1\]"):
        tables.table([1])  # type: ignore[arg-type]


def test_truncate_table_only_ever_cuts_tokens_in_step_with_pages() -> None:
    """A cut inside a shared partial page gives this table its own copy; the other holder
    keeps every token."""
    tables, mem = make()
    a = tables.create()
    mem.write(tables, a, list(range(2 * PT + 3)))
    b = tables.fork(a)
    tables.truncate(a, PT + 1)
    assert mem.read(tables, a) == list(range(PT + 1))
    assert mem.read(tables, b) == list(range(2 * PT + 3))
    mem.write(tables, a, [99])
    assert mem.read(tables, b) == list(range(2 * PT + 3))


def test_stored_pages_give_their_working_slots_back_once_no_holder_can_cut_them() -> None:
    """A page stored while a fork still holds it unverified keeps its working slot (that
    fork may cut inside it on commit); once no holder can, the slot goes back."""
    tables, mem = make(slots=16)
    a = tables.create()
    v = tables.snapshot(a)
    mem.write(tables, a, list(range(3 * PT)))  # three full pages, unverified
    b = tables.fork(a)
    tables.commit(a, v)
    assert mem.publish(tables, a) == 3
    assert tables.pool.in_use == 3  # b may still cut inside them
    tables.commit(b, v, keep=PT + 1)  # b cuts inside page 1: its own copy
    assert mem.read(tables, b) == list(range(PT + 1))
    assert mem.read(tables, a) == list(range(3 * PT))
    assert tables.pool.in_use == 1  # only b's copy: a's stored pages need no slot now

    c = tables.create()
    w = tables.snapshot(c)
    mem.write(tables, c, list(range(100, 100 + 2 * PT)))
    d = tables.fork(c)
    tables.commit(c, w)
    mem.publish(tables, c)
    tables.commit(d, w)
    assert tables.pool.in_use == 1  # both verified: c's stored pages hold no slot
    assert mem.read(tables, c) == mem.read(tables, d) == list(range(100, 100 + 2 * PT))
