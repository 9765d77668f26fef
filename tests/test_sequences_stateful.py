"""Stateful check of the sequence manager on real tiers.

Random create / append / fork / snapshot / rollback / commit / evict / fault / tier
failure (pages lost, then recomputed) / free against a model of token lists; after every
step: tables equal the model, no working page leaked or freed while referenced, the
directory and the prefix tree agree, and no unverified page was ever stored. Runs twice:
on a small DRAM-over-file cache built from the real backends and Directory (explicit
leaf-first eviction), and on the real KVCache facade (watermark eviction, write-back).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from seq_harness import TwoTierCache
from test_sequences import SPEC, kv_for

from kvtier.attention import attention, paged_attention
from kvtier.errors import CapacityError
from kvtier.index.block_table import VersionError
from kvtier.index.directory import PageState
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import PageKey, page_keys
from kvtier.sequences import PageFaultError, SequenceManager


class SequencesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.cache = self.make_cache(Path(self.tmp.name))
        self.tree = self.attach_tree()
        self.mgr = self.run(SequenceManager.open(self.cache, 10))
        self.model: dict[int, list[int]] = {}
        self.kv: dict[int, torch.Tensor] = {}
        self.versions: dict[int, list[tuple[int, list[int]]]] = {}
        self.verified_keys: set[bytes] = set()
        self.filler: set[bytes] = set()
        self.lost: set[bytes] = set()
        self.next_token = 1

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def make_cache(self, root: Path) -> Any:
        cache = TwoTierCache(SPEC, 20, 400, root / "store")
        self.run(cache.open())
        return cache

    def attach_tree(self) -> PrefixTree:
        return self.cache.tree

    async def push_down(self, n: int | None) -> None:
        await self.cache.evict(n)

    async def lose(self, keys: list[bytes]) -> None:
        await self.cache.lose(keys)

    def teardown(self) -> None:
        self.run(self.mgr.close())
        self.run(self.cache.close())
        self.loop.close()
        self.tmp.cleanup()

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model)))

    @rule()
    def create(self) -> None:
        s = self.mgr.create()
        self.model[s], self.versions[s] = [], []
        self.kv[s] = kv_for(SPEC, [], 0)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 7))
    def append(self, data: st.DataObject, n: int) -> None:
        s = self._pick(data)
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        kv = kv_for(SPEC, tokens, len(self.model[s]))
        try:
            self.run(self.mgr.append(s, tokens, kv))
        except CapacityError:
            return  # working pool full: nothing changed
        self.model[s] += tokens
        self.kv[s] = torch.cat([self.kv[s], kv], dim=2)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def adopt(self, data: st.DataObject) -> None:
        """A new sequence starts from the cached prefix of another's tokens."""
        src = self._pick(data)
        toks = self.model[src][: data.draw(st.integers(0, len(self.model[src])))]
        s = self.mgr.create()
        n = self.run(self.mgr.adopt_prefix(s, toks))
        assert n % SPEC.page_tokens == 0 and n <= len(toks)
        keys = page_keys(toks[:n], self.mgr.namespace)
        assert all(self.cache.directory.locate(k) is not None for k in keys)
        self.model[s], self.versions[s] = toks[:n], []
        self.kv[s] = kv_for(SPEC, toks[:n], 0)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        s = self._pick(data)
        c = self.mgr.fork(s)
        self.model[c], self.kv[c] = list(self.model[s]), self.kv[s].clone()
        self.versions[c] = [(v, list(t)) for v, t in self.versions[s]]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.versions[s].append((self.mgr.snapshot(s), list(self.model[s])))

    @precondition(lambda self: any(self.versions.values()))
    @rule(data=st.data(), commit=st.booleans())
    def resolve(self, data: st.DataObject, commit: bool) -> None:
        s = data.draw(st.sampled_from(sorted(k for k, v in self.versions.items() if v)))
        i = data.draw(st.integers(0, len(self.versions[s]) - 1))
        v, toks = self.versions[s][i]
        if commit:
            keep = data.draw(st.none() | st.integers(0, len(self.model[s]) - len(toks)))
            self.run(self.mgr.commit(s, v, keep))
            n = len(self.model[s]) if keep is None else len(toks) + keep
        else:
            self.run(self.mgr.rollback(s, v))
            n = len(toks)
        self.model[s] = self.model[s][:n]
        self.kv[s] = self.kv[s][:, :, :n]
        del self.versions[s][i:]
        with pytest.raises(VersionError):
            self.run(self.mgr.rollback(s, v))

    @rule(n=st.none() | st.integers(1, 4))
    def evict(self, n: int | None) -> None:
        self.run(self.push_down(n))

    @precondition(
        lambda self: any(
            not self.versions[s] and len(t) >= SPEC.page_tokens for s, t in self.model.items()
        )
    )
    @rule(data=st.data())
    def lose_and_recover(self, data: st.DataObject) -> None:
        """A tier fails: a stored page is gone. The fault names it; nothing stays pinned;
        the engine cuts the sequence there and recomputes (appends the tokens again)."""
        pt = SPEC.page_tokens
        s = data.draw(
            st.sampled_from(
                sorted(s for s, t in self.model.items() if not self.versions[s] and len(t) >= pt)
            )
        )
        table = self.mgr.tables.table(s)
        stored = [i for i, p in enumerate(table.pages) if p.key is not None and p.slot < 0]
        if not stored:
            return
        lp = data.draw(st.sampled_from(stored))
        self.lost.add(table.pages[lp].key)
        self.run(self.lose([table.pages[lp].key]))
        with pytest.raises(PageFaultError) as info:
            self.run(self.mgr.ensure_resident([s]))
        assert lp in info.value.missing[s]
        assert not any(self.cache.directory.is_pinned(k) for k in self.cache.directory)
        self._recover(s, min(info.value.missing[s]))

    def _recover(self, s: int, first: int) -> None:
        """What an engine does after a fault: abandon speculation, cut the sequence at
        the first lost page and recompute (append those tokens again)."""
        pt = SPEC.page_tokens
        if self.versions[s]:
            v, toks = self.versions[s][0]
            self.run(self.mgr.rollback(s, v))
            self.model[s], self.versions[s] = toks, []
            self.kv[s] = self.kv[s][:, :, : len(toks)]
        toks = self.model[s]
        cut = min(first * pt, len(toks))
        self.run(self.mgr.truncate(s, cut))
        try:
            self.run(self.mgr.append(s, toks[cut:], self.kv[s][:, :, cut:]))
        except CapacityError:  # no working slots to recompute into now: stays cut
            self.model[s] = toks[:cut]
            self.kv[s] = self.kv[s][:, :, :cut]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self._fault_check(seqs)

    @precondition(lambda self: self.model)
    @rule()
    def evict_then_fault(self) -> None:
        """Push pages down, then fault every live sequence back, two at a time."""
        self.run(self.push_down(None))
        live = sorted(self.model)
        for i in range(0, len(live), 2):
            self._fault_check(live[i : i + 2])

    def _fault_check(self, seqs: list[int]) -> None:
        """ensure_resident, then attention through the table equals attention over the
        original tensors, bit for bit, for every non-empty sequence."""
        try:
            batch = self.run(self.mgr.ensure_resident(seqs))
        except CapacityError:
            return  # the top tier is pinned full: a clear error, nothing pinned
        except PageFaultError as exc:
            # only pages a tier lost may be missing (shared with a sequence that lost them)
            for s, lps in exc.missing.items():
                pages = self.mgr.tables.table(s).pages
                assert all(pages[lp].key in self.lost for lp in lps), exc
            assert not any(self.cache.directory.is_pinned(k) for k in self.cache.directory)
            for s, lps in exc.missing.items():
                self._recover(s, min(lps))
            return
        try:
            assert batch.seq_lens == [len(self.model[s]) for s in seqs]
            rows = [i for i, n in enumerate(batch.seq_lens) if n]
            g = torch.Generator().manual_seed(len(self.model))
            q = torch.randn((len(rows), 1, 4, SPEC.head_dim), generator=g).half()
            lens = [batch.seq_lens[i] for i in rows]
            table = batch.block_table[rows]
            for layer in range(SPEC.num_layers):
                out = paged_attention(q, self.mgr.page, table, lens, layer, SPEC)
                for j, i in enumerate(rows):
                    kv = self.kv[seqs[i]][layer]
                    assert torch.equal(out[j], attention(q[j], kv[0], kv[1]))
        finally:
            self.run(self.mgr.release(batch))
        assert not any(self.cache.directory.is_pinned(k) for k in self.cache.directory)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        s = self._pick(data)
        self.run(self.mgr.free(s))
        del self.model[s], self.versions[s], self.kv[s]

    @invariant()
    def tables_equal_model(self) -> None:
        for s, toks in self.model.items():
            t = self.mgr.tables.table(s)
            assert t.tokens == toks
            assert len(t.pages) == SPEC.pages_for(len(toks))
            assert t.live_versions() == [v for v, _ in self.versions[s]]

    @invariant()
    def no_leak_no_early_free(self) -> None:
        self.mgr.check_invariants()
        # the working pool is exactly the reserved (never committed) part of the top tier
        d = self.cache.directory
        assert d.count("dram", PageState.RESERVED) == self.mgr.working_pages
        assert d.count("dram") <= self.cache.tiers[0].backend.capacity_pages
        assert not any(d.is_pinned(k) for k in d)

    @invariant()
    def directory_and_tree_agree(self) -> None:
        for s, toks in self.model.items():
            verified = self.versions[s][0][1] if self.versions[s] else toks
            self.verified_keys.update(page_keys(verified, self.mgr.namespace))
        d = self.cache.directory
        for tier in ("dram", "disk"):
            # visible pages (committed, or being evicted by the evict queue)
            committed = set(d.keys_in(tier, PageState.COMMITTED, PageState.EVICTING))
            in_tree = {k for k, tiers in self.tree.items() if tier in tiers}
            assert committed == in_tree
            # nothing unverified was ever stored (keys of verified prefixes only)
            assert committed <= self.verified_keys | self.filler


TestSequencesModel = SequencesModel.TestCase
TestSequencesModel.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class KVCacheSequencesModel(SequencesModel):
    """The same machine on the real KVCache: a 24-page DRAM tier (10 of them the working
    pool) with watermark eviction over a file store, write-back. ``evict`` stores other
    tenants' pages, which pushes the sequences' pages down."""

    def make_cache(self, root: Path) -> Any:
        from kvtier.cache import KVCache
        from kvtier.config import KVTierConfig, TierConfig
        from kvtier.keys import Namespace

        pb = SPEC.page_bytes
        config = KVTierConfig(
            spec=SPEC,
            namespace=Namespace.for_spec(SPEC),
            tiers=[
                TierConfig("dram", "dram", 24 * pb, 0.8, 0.6),
                TierConfig("disk", "file", 600 * pb, 0.9, 0.8, options={"path": str(root)}),
            ],
            write_policy="write-back",
        )
        return self.run(KVCache.open(config, configure_log=False))

    def attach_tree(self) -> PrefixTree:
        return self.cache.prefix_tree  # the tree KVCache's leaf-first eviction uses

    async def push_down(self, n: int | None) -> None:
        count = 6 if n is None else n
        keys = [PageKey(os.urandom(16)) for _ in range(count)]
        self.filler.update(keys)
        pages = np.zeros((count, SPEC.page_bytes), dtype=np.uint8)
        await self.cache.store_pages(keys, pages)

    async def lose(self, keys: list[bytes]) -> None:
        await self.cache.delete(keys)


TestKVCacheSequencesModel = KVCacheSequencesModel.TestCase
TestKVCacheSequencesModel.settings = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
