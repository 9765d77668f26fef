"""Review of sequences and indexes: state stays whole when an operation raises, and bad
input gets a clear error naming the problem."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from seq_harness import TwoTierCache
from test_block_table import PT, Memory, make
from test_sequences import DRAFT, SPEC, Ref, kv_for

from kvtier.attention import paged_attention
from kvtier.backend import BackendClosedError
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.block_table import BlockTables, UnknownSequenceError
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.sequences import SequenceManager, VersionedGroup
from kvtier.spec import KVSpec

NS = Namespace("review-model", page_tokens=4)


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


def test_prefix_tree_insert_with_a_bad_key_keeps_counts_true() -> None:
    tree = PrefixTree(["dram", "disk"])
    keys = page_keys(list(range(12)), NS)
    with pytest.raises(KVTierUsageError, match="16 bytes"):
        tree.insert([keys[0], keys[1], PageKey(b"short")], "dram")
    # whatever the tree kept, its per-tier count agrees with its pages
    assert tree.pages_in("dram") == sum(1 for _, tiers in tree.items() if "dram" in tiers)


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


async def _group(tmp_path: Path, draft_working: int) -> tuple[VersionedGroup, list[Any]]:
    target_cache = TwoTierCache(SPEC, 24, 100, tmp_path / "t")
    draft_cache = TwoTierCache(DRAFT, 24, 100, tmp_path / "d")
    await target_cache.open()
    await draft_cache.open()
    target = await SequenceManager.open(target_cache, 8)
    draft = await SequenceManager.open(draft_cache, draft_working)
    return VersionedGroup({"target": target, "draft": draft}), [
        target,
        draft,
        target_cache,
        draft_cache,
    ]


async def test_group_append_is_all_or_nothing_across_managers(tmp_path: Path) -> None:
    group, (target, draft, *caches) = await _group(tmp_path, draft_working=1)
    s = group.create()
    toks = [1, 2, 3, 4, 5]  # two pages: the draft's pool holds one
    kv = {"target": kv_for(SPEC, toks, 0), "draft": kv_for(DRAFT, toks, 0)}
    with pytest.raises(CapacityError):
        await group.append(s, toks, kv)
    bad = {"target": kv_for(SPEC, toks[:2], 0), "draft": kv_for(SPEC, toks[:2], 0)}
    with pytest.raises(KVTierUsageError, match="shape"):
        await group.append(s, toks[:2], bad)  # the draft's KV has the target's geometry
    for m, name in ((target, "target"), (draft, "draft")):
        assert m.tables.table(group.member(s, name)).tokens == []
        assert m.tables.pool.in_use == 0 and m.stats.pages_published == 0
        m.check_invariants()
    ok = {"target": kv_for(SPEC, toks[:3], 0), "draft": kv_for(DRAFT, toks[:3], 0)}
    await group.append(s, toks[:3], ok)
    for m, name in ((target, "target"), (draft, "draft")):
        assert m.tables.table(group.member(s, name)).tokens == toks[:3]
    await group.free(s)
    for c in (target, draft, *caches):
        await c.close()


async def test_open_with_bad_max_tokens_reserves_nothing(tmp_path: Path) -> None:
    cache = TwoTierCache(SPEC, 24, 100, tmp_path / "s")
    await cache.open()
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(KVTierUsageError, match="max_tokens"):
            await SequenceManager.open(cache, 4, max_tokens=bad)  # type: ignore[arg-type]
    assert cache.directory.used("dram") == 0 and cache.dram.used_pages() == 0
    mgr = await SequenceManager.open(cache, 24)  # the whole tier is still there
    await mgr.close()
    await cache.close()


async def test_open_on_a_closed_top_tier_leaves_no_reservation(tmp_path: Path) -> None:
    cache = TwoTierCache(SPEC, 24, 100, tmp_path / "s")  # never opened
    with pytest.raises(BackendClosedError):
        await SequenceManager.open(cache, 4)
    assert cache.directory.used("dram") == 0


async def test_group_commit_is_all_or_nothing_across_managers(tmp_path: Path) -> None:
    group, (target, draft, *caches) = await _group(tmp_path, draft_working=2)
    s = group.create()
    v = group.snapshot(s)
    toks = [1, 2, 3, 4, 5, 6]  # two pages: the draft's pool is full
    await group.append(s, toks, {"target": kv_for(SPEC, toks, 0), "draft": kv_for(DRAFT, toks, 0)})
    f = group.fork(s)
    # keeping 2 tokens cuts inside page 0, shared with the fork: the draft has no slot
    # for its copy, the target has
    with pytest.raises(CapacityError):
        await group.commit(s, v, keep=2)
    for m, name in ((target, "target"), (draft, "draft")):
        table = m.tables.table(group.member(s, name))
        assert table.tokens == toks and len(table.versions) == 1
        assert m.stats.cow_copies == 0
        m.check_invariants()
    await group.free(f)
    await group.commit(s, v, keep=2)  # the version is still live and now goes through
    for m, name in ((target, "target"), (draft, "draft")):
        assert m.tables.table(group.member(s, name)).tokens == toks[:2]
        m.check_invariants()
    await group.free(s)
    for c in (target, draft, *caches):
        await c.close()


def test_gather_rejects_pages_of_another_geometry_and_slots_past_the_pool() -> None:
    spec = KVSpec(2, 2, 8, "float32", 4, name="attn")
    q = torch.zeros((1, 1, 4, 8))
    row = np.array([[0, 1]], dtype=np.int32)
    # pages of 8 tokens where the spec says 4: same heads and dims, so slicing "works"
    wrong = torch.zeros((4, 2, 2, 8, 2, 8))
    with pytest.raises(KVTierUsageError, match="page shape"):
        paged_attention(q, wrong, row, [6], 0, spec)
    with pytest.raises(KVTierUsageError, match="page shape"):
        paged_attention(q, lambda slot: wrong[slot], row, [6], 0, spec)
    pool = torch.zeros((2, *spec.page_shape))
    with pytest.raises(KVTierUsageError, match="slot 5"):
        paged_attention(q, pool, np.array([[0, 5]], dtype=np.int32), [6], 0, spec)


@pytest.mark.parametrize("rate", ["0.5", None, True])
def test_speculative_accept_rate_of_the_wrong_type_is_named(rate: object) -> None:
    from kvtier.bench.speculative import SpeculativeParams

    with pytest.raises(KVTierUsageError, match="accept_rate must be a number"):
        SpeculativeParams(accept_rate=rate)  # type: ignore[arg-type]


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


async def test_a_resident_table_stays_valid_while_other_sequences_commit(
    tmp_path: Path,
) -> None:
    """A stored page's working slot may go back to the pool when a fork commits; a table
    handed out for another sequence must not point at it."""
    cache = TwoTierCache(SPEC, 40, 100, tmp_path / "s")
    await cache.open()
    mgr = await SequenceManager.open(cache, 10)
    ref = Ref()
    a = mgr.create()
    v = mgr.snapshot(a)
    await ref.append(mgr, a, list(range(3 * SPEC.page_tokens)))  # 3 pages, unverified
    b = mgr.fork(a)
    await mgr.commit(a, v)  # a's pages are stored; b still holds them unverified
    async with mgr.resident([a]) as batch:
        await mgr.commit(b, v)  # nobody can cut them now: their working slots go back
        c = mgr.create()
        await ref.append(mgr, c, list(range(500, 500 + 3 * SPEC.page_tokens)))  # reuses slots
        for layer in range(SPEC.num_layers):
            for lp in range(3):
                page = mgr.page(int(batch.block_table[0, lp]))
                pt = SPEC.page_tokens
                assert torch.equal(page[layer], ref.kv[a][layer][:, lp * pt : (lp + 1) * pt])
    mgr.check_invariants()
    await mgr.close()
    await cache.close()


async def test_group_snapshot_during_a_group_commit_covers_every_manager(
    tmp_path: Path,
) -> None:
    """A snapshot taken while a group commit waits on a store must see every manager
    committed (not the target committed and the draft still holding the old version)."""
    group, (target, draft, target_cache, *rest) = await _group(tmp_path, draft_working=8)
    s = group.create()
    v = group.snapshot(s)
    toks = list(range(SPEC.page_tokens + 1))  # one full page to store on commit
    await group.append(s, toks, {"target": kv_for(SPEC, toks, 0), "draft": kv_for(DRAFT, toks, 0)})
    gate, entered = asyncio.Event(), asyncio.Event()
    store = target_cache.store_pages

    async def gated_store(*args: Any, **kwargs: Any) -> list[bool]:
        entered.set()
        await gate.wait()
        return await store(*args, **kwargs)

    target_cache.store_pages = gated_store  # type: ignore[method-assign]
    commit = asyncio.create_task(group.commit(s, v))
    await entered.wait()
    w = group.snapshot(s)  # while the commit waits on the target's store
    gate.set()
    await commit
    more = [90, 91]
    await group.append(s, more, {"target": kv_for(SPEC, more, 5), "draft": kv_for(DRAFT, more, 5)})
    await group.rollback(s, w)
    for m, name in ((target, "target"), (draft, "draft")):
        table = m.tables.table(group.member(s, name))
        assert table.tokens == toks and table.versions == []
        m.check_invariants()
    await group.free(s)
    for c in (target, draft, target_cache, *rest):
        await c.close()
