"""The sequence manager on real tiers: faults, forks, rollbacks, attention bit for bit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from seq_harness import TwoTierCache

from kvtier.attention import attention, paged_attention
from kvtier.backend import BackendClosedError
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.block_table import (
    SequenceFinishedError,
    SequenceLengthError,
    UnknownSequenceError,
    VersionError,
)
from kvtier.index.directory import PageState
from kvtier.keys import Namespace, page_keys
from kvtier.sequences import PageFaultError, SequenceManager, VersionedGroup
from kvtier.spec import KVSpec

SPEC = KVSpec(2, 2, 8, "float16", 4, name="seqtest")
DRAFT = KVSpec(1, 1, 8, "float16", 4, name="seqtest-draft")


def kv_for(spec: KVSpec, tokens: list[int], start: int) -> torch.Tensor:
    """Deterministic KV of tokens at positions start.. (what a model would compute)."""
    out = torch.empty(
        (spec.num_layers, spec.kv_factor, len(tokens), spec.num_kv_heads, spec.head_dim),
        dtype=torch.float16,
    )
    for i, t in enumerate(tokens):
        g = torch.Generator().manual_seed(t * 100_003 + start + i)
        out[:, :, i] = torch.randn(out[:, :, i].shape, generator=g).half()
    return out


async def make(tmp_path: Path, dram: int = 24, disk: int = 200, working: int = 10, **kw):
    cache = TwoTierCache(SPEC, dram, disk, tmp_path / "store")
    await cache.open()
    mgr = await SequenceManager.open(cache, working, **kw)
    return cache, mgr


class Ref:
    """The original tensors of each sequence."""

    def __init__(self) -> None:
        self.kv: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, list[int]] = {}

    async def append(self, mgr: SequenceManager, s: int, tokens: list[int]) -> None:
        start = len(self.tokens.get(s, []))
        kv = kv_for(mgr.spec, tokens, start)
        await mgr.append(s, tokens, kv)
        self.tokens[s] = self.tokens.get(s, []) + tokens
        prev = self.kv.get(s)
        self.kv[s] = kv if prev is None else torch.cat([prev, kv], dim=2)


async def check_attention(mgr: SequenceManager, ref: Ref, seqs: list[int]) -> None:
    async with mgr.resident(seqs) as batch:
        assert batch.block_table.dtype == np.int32
        assert batch.seq_lens == [len(ref.tokens[s]) for s in seqs]
        g = torch.Generator().manual_seed(7)
        q = torch.randn((len(seqs), 2, 4, SPEC.head_dim), generator=g).half()
        for layer in range(SPEC.num_layers):
            out = paged_attention(q, mgr.page, batch.block_table, batch.seq_lens, layer, SPEC)
            for i, s in enumerate(seqs):
                kv = ref.kv[s][layer]
                expect = attention(q[i], kv[0], kv[1])
                assert torch.equal(out[i], expect), f"sequence {s} layer {layer}"
    assert batch.released


async def test_attention_equal_after_disk_forks_and_rollbacks(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path, dram=20, working=10)
    ref = Ref()
    a = mgr.create()
    for chunk in range(5):  # chunked prefill: 5 chunks of 6 tokens, the last page partial
        await ref.append(mgr, a, list(range(chunk * 6, chunk * 6 + 6)))
        await cache.evict()  # finished chunks move down while later ones run
    b = mgr.fork(a)
    ref.tokens[b], ref.kv[b] = list(ref.tokens[a]), ref.kv[a].clone()
    await ref.append(mgr, b, [900, 901, 902])
    await ref.append(mgr, a, [500])
    assert mgr.stats.cow_copies == 1
    v = mgr.snapshot(a)
    saved = (list(ref.tokens[a]), ref.kv[a].clone())
    await ref.append(mgr, a, [1, 2, 3, 4, 5, 6, 7])
    published_before = mgr.stats.pages_published
    assert await mgr.rollback(a, v) >= 1
    assert mgr.stats.pages_published == published_before
    ref.tokens[a], ref.kv[a] = saved
    moved = await cache.evict()
    assert moved > 0 and cache.directory.count("dram") - 10 == 0  # only the pool is left
    assert cache.tree.pages_in("disk") > 0
    await check_attention(mgr, ref, [a, b])
    await check_attention(mgr, ref, [b])
    mgr.check_invariants()
    await mgr.close()
    await cache.close()


async def test_unverified_pages_never_reach_the_cache(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path)
    ref = Ref()
    s = mgr.create()
    await ref.append(mgr, s, list(range(6)))
    v = mgr.snapshot(s)
    await ref.append(mgr, s, list(range(100, 112)))
    keys = page_keys(ref.tokens[s], mgr.namespace)
    assert len(keys) == 4
    assert [cache.directory.locate(k) for k in keys] == ["dram", None, None, None]
    assert cache.tree.match_length(keys) == 1
    await cache.evict()
    assert cache.tree.pages_in("disk") == 1
    await mgr.commit(s, v, keep=5)  # accept 5 of 12 draft tokens: 11 tokens, 2 full pages
    ref.tokens[s] = ref.tokens[s][:11]
    ref.kv[s] = ref.kv[s][:, :, :11]
    keys = page_keys(ref.tokens[s], mgr.namespace)
    assert cache.tree.match_length(keys) == 2
    await check_attention(mgr, ref, [s])
    mgr.check_invariants()
    with pytest.raises(VersionError, match="already committed or rolled back"):
        await mgr.rollback(s, v)
    await mgr.close()
    await cache.close()


async def test_fault_reports_lost_pages_and_pins_nothing(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path)
    ref = Ref()
    s = mgr.create()
    await ref.append(mgr, s, list(range(14)))
    await cache.evict()
    keys = page_keys(ref.tokens[s], mgr.namespace)
    await cache.lose([keys[1]])
    with pytest.raises(PageFaultError) as info:
        await mgr.ensure_resident([s])
    assert info.value.missing == {s: [1]}
    assert "sequence" in str(info.value) and "[1]" in str(info.value)
    assert not any(cache.directory.is_pinned(k) for k in keys)
    # the engine recomputes: cut at the lost page and append again
    await mgr.truncate(s, 4)
    ref.tokens[s], ref.kv[s] = ref.tokens[s][:4], ref.kv[s][:, :, :4]
    await ref.append(mgr, s, list(range(4, 14)))
    await check_attention(mgr, ref, [s])
    await mgr.close()
    await cache.close()


async def test_capacity_error_when_everything_is_pinned(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path, dram=8, working=4)
    ref = Ref()
    a, b = mgr.create(), mgr.create()
    await ref.append(mgr, a, list(range(16)))
    await ref.append(mgr, b, list(range(50, 66)))
    await cache.evict()
    batch = await mgr.ensure_resident([a])
    with pytest.raises(CapacityError, match="pinned"):
        await mgr.ensure_resident([b])
    await mgr.release(batch)
    await check_attention(mgr, ref, [b])  # room again once released
    with pytest.raises(KVTierUsageError, match="already released"):
        await mgr.release(batch)
    await mgr.close()
    await cache.close()


async def test_bad_input(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path, working=3, max_tokens=12)
    s = mgr.create()
    kv1 = kv_for(SPEC, [1], 0)
    with pytest.raises(UnknownSequenceError, match="unknown sequence id 99"):
        await mgr.append(99, [1], kv1)
    with pytest.raises(KVTierUsageError, match="integer dtype"):
        await mgr.append(s, np.array([1.5]), kv1)
    with pytest.raises(KVTierUsageError, match="shape"):
        await mgr.append(s, [1, 2], kv1)
    with pytest.raises(KVTierUsageError, match=r"dtype torch\.float16"):
        await mgr.append(s, [1], kv1.float())
    with pytest.raises(SequenceLengthError, match="maximum length of 12"):
        await mgr.append(s, list(range(13)), kv_for(SPEC, list(range(13)), 0))
    with pytest.raises(CapacityError, match="working"):
        SequenceManager(cache, 1)  # fine to build ...
        await SequenceManager.open(cache, 100)  # ... but the top tier lacks 100 slots
    await mgr.free(s)
    with pytest.raises(SequenceFinishedError, match="finished"):
        mgr.fork(s)
    with pytest.raises(SequenceFinishedError):
        await mgr.ensure_resident([s])
    with pytest.raises(KVTierUsageError, match="working_pages"):
        SequenceManager(cache, 0)
    await mgr.close()
    await cache.close()


async def test_versioned_group_keeps_draft_in_step(tmp_path: Path) -> None:
    target_cache = TwoTierCache(SPEC, 24, 100, tmp_path / "t")
    draft_cache = TwoTierCache(DRAFT, 24, 100, tmp_path / "d")
    await target_cache.open()
    await draft_cache.open()
    target = await SequenceManager.open(target_cache, 8)
    draft = await SequenceManager.open(draft_cache, 8)
    group = VersionedGroup({"target": target, "draft": draft})
    s = group.create()

    async def step(tokens: list[int], start: int) -> None:
        await group.append(
            s,
            tokens,
            {"target": kv_for(SPEC, tokens, start), "draft": kv_for(DRAFT, tokens, start)},
        )

    await step([1, 2, 3, 4, 5], 0)
    v = group.snapshot(s)
    await step([6, 7, 8, 9], 5)
    await group.rollback(s, v)
    for m, name in ((target, "target"), (draft, "draft")):
        assert m.tables.table(group.member(s, name)).tokens == [1, 2, 3, 4, 5]
        m.check_invariants()
    with pytest.raises(KVTierUsageError, match="not live"):
        await group.commit(s, v)
    v2 = group.snapshot(s)
    await step([6, 7, 8], 5)
    await group.commit(s, v2)
    assert target.stats.pages_published == draft.stats.pages_published == 2
    with pytest.raises(KVTierUsageError, match="kv must be given"):
        await group.append(s, [1], {"target": kv_for(SPEC, [1], 8)})
    # before: TypeError, KeyError and AttributeError
    with pytest.raises(KVTierUsageError, match="kv must map each manager's name to its KV"):
        await group.append(s, [1], None)  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match=r"no manager named 'nope' in this group"):
        group.member(s, "nope")
    with pytest.raises(KVTierUsageError, match="manager 'a' must be a SequenceManager"):
        VersionedGroup({"a": object()})  # type: ignore[dict-item]
    await group.free(s)
    for m, c in ((target, target_cache), (draft, draft_cache)):
        await m.close()
        await c.close()


async def test_a_batch_released_through_another_manager_stays_releasable(
    tmp_path: Path,
) -> None:
    """Another manager's ``release`` of a batch raised "not pinned (released twice?)"
    after marking it released, so its own manager refused it and its pages stayed pinned
    for good. Now it is refused before anything changes."""
    caches = [TwoTierCache(SPEC, 24, 100, tmp_path / n) for n in ("a", "b")]
    for c in caches:
        await c.open()
    mine, other = [await SequenceManager.open(c, 4) for c in caches]
    s = mine.create()
    tokens = list(range(2 * SPEC.page_tokens))
    await mine.append(s, tokens, kv_for(SPEC, tokens, 0))
    await mine.publish_pending(s)
    batch = await mine.ensure_resident([s])
    pinned = caches[0].directory.is_pinned
    assert batch.pinned and all(pinned(k) for k in batch.pinned)
    with pytest.raises(KVTierUsageError, match="made by another SequenceManager"):
        await other.release(batch)
    assert not batch.released and all(pinned(k) for k in batch.pinned)
    await mine.release(batch)
    assert not any(pinned(k) for k in batch.pinned)
    for m, c in zip((mine, other), caches, strict=True):
        await m.close()
        await c.close()


async def test_versioned_group_refuses_two_managers_over_one_cache(tmp_path: Path) -> None:
    """A target and a draft manager over one cache key their pages in one namespace: the
    group was accepted, and the draft read the target's KV for the same tokens. Two
    caches with one namespace are refused too."""
    cache = TwoTierCache(SPEC, 24, 100, tmp_path / "a")
    twin = TwoTierCache(SPEC, 24, 100, tmp_path / "b")
    await cache.open()
    await twin.open()
    target = await SequenceManager.open(cache, 4)
    draft = await SequenceManager.open(cache, 4)
    other = await SequenceManager.open(twin, 4)
    with pytest.raises(KVTierUsageError, match="'target' and 'draft' share one cache"):
        VersionedGroup({"target": target, "draft": draft})
    with pytest.raises(KVTierUsageError, match="'target' and 'draft' share one namespace"):
        VersionedGroup({"target": target, "draft": other})
    for m in (target, draft, other):
        await m.close()
    await cache.close()
    await twin.close()


async def test_on_kvcache_pages_go_to_disk_and_back_bit_exact(tmp_path: Path) -> None:
    from kvtier.cache import KVCache
    from kvtier.config import KVTierConfig, TierConfig
    from kvtier.keys import Namespace

    pb = SPEC.page_bytes
    config = KVTierConfig(
        spec=SPEC,
        namespace=Namespace.for_spec(SPEC),
        tiers=[
            TierConfig("dram", "dram", 20 * pb, 0.8, 0.6),
            TierConfig("disk", "file", 400 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
        write_policy="write-back",
    )
    async with KVCache(config, configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 8)
        ref = Ref()
        seqs = []
        for i in range(4):  # 4 sequences of 6.5 pages: more than DRAM holds
            s = mgr.create()
            for chunk in range(2):
                toks = [i * 1000 + chunk * 13 + t for t in range(13)]
                await ref.append(mgr, s, toks)
            seqs.append(s)
        b = mgr.fork(seqs[0])
        ref.tokens[b], ref.kv[b] = list(ref.tokens[seqs[0]]), ref.kv[seqs[0]].clone()
        v = mgr.snapshot(b)
        await ref.append(mgr, b, [7] * 9)
        await mgr.rollback(b, v)
        ref.tokens[b], ref.kv[b] = ref.tokens[b][:26], ref.kv[b][:, :, :26]
        await ref.append(mgr, b, [8, 8])
        await cache.flush()
        assert cache.directory.keys_in("disk"), "nothing reached the disk tier"
        on_disk_only = [
            k for k in cache.directory.keys_in("disk") if cache.directory.locate(k) != "dram"
        ]
        assert on_disk_only, "no page was evicted from DRAM"
        for group in ([seqs[0], b], [seqs[1]], [seqs[2], seqs[3]]):
            await check_attention(mgr, ref, group)
        mgr.check_invariants()
        await mgr.close()


async def test_adopt_cached_prefix_then_attention_bit_exact(tmp_path: Path) -> None:
    cache, mgr = await make(tmp_path)
    ref = Ref()
    system = list(range(1000, 1014))  # 3 full pages + 2 tokens
    a = mgr.create()
    await ref.append(mgr, a, [*system, 1, 2, 3])
    await cache.evict()
    b = mgr.create()
    prompt = [*system, 7, 7, 7, 7, 7]
    got = await mgr.adopt_prefix(b, prompt)
    assert got == 12 and mgr.stats.pages_adopted == 3
    ref.tokens[b] = prompt[:got]
    ref.kv[b] = kv_for(SPEC, prompt[:got], 0)  # what the cached pages must hold
    await ref.append(mgr, b, prompt[got:])
    await check_attention(mgr, ref, [a, b])
    with pytest.raises(KVTierUsageError, match="not empty"):
        await mgr.adopt_prefix(b, prompt)
    c = mgr.create()
    assert await mgr.adopt_prefix(c, [5, 5, 5, 5]) == 0  # nothing cached: nothing adopted
    mgr.check_invariants()
    await mgr.close()
    await cache.close()


def _kvcache_config(tmp_path: Path, dram_pages: int):  # type: ignore[no-untyped-def]
    from kvtier.config import KVTierConfig, TierConfig
    from kvtier.keys import Namespace

    pb = SPEC.page_bytes
    return KVTierConfig(
        spec=SPEC,
        namespace=Namespace.for_spec(SPEC),
        tiers=[
            TierConfig("dram", "dram", dram_pages * pb, 0.8, 0.6),
            TierConfig("disk", "file", 400 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
        write_policy="write-back",
    )


async def test_on_kvcache_a_failing_disk_tier_is_a_named_fault(tmp_path: Path) -> None:
    from kvtier.cache import KVCache

    async with KVCache(_kvcache_config(tmp_path, 20), configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 6)
        ref = Ref()
        a, b = mgr.create(), mgr.create()
        for c in range(0, 40, 12):  # chunked prefill: a chunk must fit the working pool
            await ref.append(mgr, a, list(range(c, min(c + 12, 40))))
        for c in range(100, 140, 12):  # b's prefill pushes a's pages down
            await ref.append(mgr, b, list(range(c, min(c + 12, 140))))
        keys = page_keys(ref.tokens[a], mgr.namespace)
        on_disk = [i for i, k in enumerate(keys) if cache.directory.locate(k) == "disk"]
        assert len(on_disk) >= 2
        store = cache.tiers[1].backend
        for i in on_disk[:2]:  # the disk fails these pages: torn bytes
            path = store.page_path(keys[i])
            raw = bytearray(path.read_bytes())
            raw[10] ^= 0xFF
            path.write_bytes(bytes(raw))
        with pytest.raises(PageFaultError) as info:
            await mgr.ensure_resident([a])
        assert info.value.missing == {a: on_disk[:2]}
        assert not any(cache.directory.is_pinned(k) for k in cache.directory)
        # the engine recomputes from the first lost page; then everything checks out
        first = on_disk[0] * SPEC.page_tokens
        await mgr.truncate(a, first)
        toks = ref.tokens[a]
        ref.tokens[a], ref.kv[a] = toks[:first], ref.kv[a][:, :, :first]
        for c in range(first, 40, 12):
            await ref.append(mgr, a, toks[c : c + 12])
        await check_attention(mgr, ref, [a])
        await check_attention(mgr, ref, [b])
        await mgr.close()


async def test_on_kvcache_all_pinned_is_a_capacity_error_not_a_hang(tmp_path: Path) -> None:
    import asyncio

    from kvtier.cache import KVCache
    from kvtier.errors import CapacityError as CapErr

    async with KVCache(_kvcache_config(tmp_path, 16), configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 4)
        ref = Ref()
        a, b = mgr.create(), mgr.create()
        for c in range(0, 40, 12):  # 10 pages each, in chunks that fit the pool
            await ref.append(mgr, a, list(range(c, min(c + 12, 40))))
            await ref.append(mgr, b, list(range(100 + c, 100 + min(c + 12, 40))))
        batch = await mgr.ensure_resident([a])
        with pytest.raises(CapErr, match="pinned"):
            await asyncio.wait_for(mgr.ensure_resident([b]), timeout=30)
        assert mgr.stats.resident_calls == 1
        await mgr.release(batch)
        await check_attention(mgr, ref, [b])
        await mgr.close()


async def test_store_deferred_while_top_tier_is_pinned_full(tmp_path: Path) -> None:
    from kvtier.cache import KVCache

    async with KVCache(_kvcache_config(tmp_path, 16), configure_log=False) as cache:
        mgr = await SequenceManager.open(cache, 6)
        ref = Ref()
        a, b = mgr.create(), mgr.create()
        for c in range(0, 40, 8):  # a: 10 stored pages
            await ref.append(mgr, a, list(range(c, c + 8)))
        await ref.append(mgr, b, [500, 501, 502])
        batch = await mgr.ensure_resident([a])  # 10 pinned + 6 working = 16: full
        before = mgr.stats.pages_published
        await ref.append(mgr, b, [503, 504])  # b's first page is full: it cannot be stored
        assert mgr.stats.pages_published == before and mgr.stats.publish_failures >= 1
        keys = page_keys(ref.tokens[b], mgr.namespace)
        assert cache.directory.locate(keys[0]) is None
        assert mgr.tables.table(b).pages[0].slot >= 0  # still whole in the working pool
        await mgr.release(batch)
        assert await mgr.publish_pending(b) == 1
        assert cache.directory.locate(keys[0]) == "dram"
        await check_attention(mgr, ref, [a])
        await check_attention(mgr, ref, [b])
        mgr.check_invariants()
        await mgr.close()


async def test_on_kvcache_draft_namespace_versioned_with_target(tmp_path: Path) -> None:
    from kvtier.cache import KVCache
    from kvtier.config import KVTierConfig, TierConfig
    from kvtier.keys import Namespace

    def cfg(spec: KVSpec, sub: str) -> KVTierConfig:
        pb = spec.page_bytes
        return KVTierConfig(
            spec=spec,
            namespace=Namespace.for_spec(spec),
            tiers=[
                TierConfig("dram", "dram", 20 * pb, 0.8, 0.6),
                TierConfig(
                    "disk", "file", 200 * pb, 0.9, 0.8, options={"path": str(tmp_path / sub)}
                ),
            ],
            write_policy="write-back",
        )

    async with (
        KVCache(cfg(SPEC, "t"), configure_log=False) as tcache,
        KVCache(cfg(DRAFT, "d"), configure_log=False) as dcache,
    ):
        assert tcache.namespace != dcache.namespace
        target = await SequenceManager.open(tcache, 6)
        draft = await SequenceManager.open(dcache, 6)
        group = VersionedGroup({"target": target, "draft": draft})
        refs = {"target": Ref(), "draft": Ref()}
        mgrs = {"target": target, "draft": draft}
        s = group.create()

        async def step(tokens: list[int]) -> None:
            start = len(refs["target"].tokens.get(group.member(s, "target"), []))
            kv = {n: kv_for(m.spec, tokens, start) for n, m in mgrs.items()}
            await group.append(s, tokens, kv)
            for n in mgrs:
                sid = group.member(s, n)
                r = refs[n]
                r.tokens[sid] = r.tokens.get(sid, []) + tokens
                prev = r.kv.get(sid)
                r.kv[sid] = kv[n] if prev is None else torch.cat([prev, kv[n]], dim=2)

        await step(list(range(10)))
        v = group.snapshot(s)
        saved = {}
        for n in mgrs:
            sid = group.member(s, n)
            saved[n] = (list(refs[n].tokens[sid]), refs[n].kv[sid].clone())
        await step([50, 51, 52, 53, 54, 55])
        await group.rollback(s, v)  # both models back, both pools freed
        for n, m in mgrs.items():
            sid = group.member(s, n)
            refs[n].tokens[sid], refs[n].kv[sid] = saved[n]
            assert m.tables.table(sid).tokens == list(range(10))
            assert m.stats.pages_discarded >= 1
        v2 = group.snapshot(s)
        await step([60, 61, 62])
        await group.commit(s, v2)
        await step([70])
        for n, m in mgrs.items():
            await check_attention_spec(m, refs[n], [group.member(s, n)])
            m.check_invariants()
        fork = group.fork(s)
        assert group.member(fork, "draft") != group.member(s, "draft")
        await group.free(fork)
        await group.free(s)
        await target.close()
        await draft.close()


async def check_attention_spec(mgr: SequenceManager, ref: Ref, seqs: list[int]) -> None:
    """check_attention for any spec (the draft model's geometry too)."""
    spec = mgr.spec
    batch = await mgr.ensure_resident(seqs)
    try:
        q = torch.randn((len(seqs), 1, spec.num_kv_heads * 2, spec.head_dim)).half()
        for layer in range(spec.num_layers):
            out = paged_attention(q, mgr.page, batch.block_table, batch.seq_lens, layer, spec)
            for i, s in enumerate(seqs):
                kv = ref.kv[s][layer]
                assert torch.equal(out[i], attention(q[i], kv[0], kv[1]))
    finally:
        await mgr.release(batch)


async def test_manager_opens_on_a_warm_cache_by_evicting_clean_pages(tmp_path) -> None:
    """The working pool is taken through KVCache.reserve_private, which makes room per
    policy: a top tier full of clean cached pages does not refuse a new manager."""
    from kvtier.cache import KVCache
    from kvtier.config import KVTierConfig, TierConfig

    spec = KVSpec(1, 1, 8, "float16", 4, name="warm")
    pb = spec.page_bytes
    config = KVTierConfig(
        spec=spec,
        namespace=Namespace.for_spec(spec),
        tiers=[
            TierConfig("dram", "dram", 20 * pb, 1.0, 0.9),
            TierConfig("disk", "file", 100 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
    )
    rng = np.random.default_rng(8)
    async with KVCache(config, configure_log=False) as cache:
        tokens = rng.integers(0, 1000, 15 * spec.page_tokens)
        stored = await cache.store(tokens, np.zeros((15, pb), np.uint8))
        await cache.flush()  # clean: copies on disk
        mgr = await SequenceManager.open(cache, 8)
        assert cache.directory.used("dram") <= 20
        found = await cache.lookup(tokens)
        assert found.keys == stored.keys  # evicted pages went down, not away
        assert cache.directory.count("dram", PageState.RESERVED) == 8  # the pool
        await mgr.close()
        assert cache.directory.count("dram", PageState.RESERVED) == 0  # given back


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
