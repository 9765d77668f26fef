"""Stateful check of the sequence manager on real tiers (DRAM arena over a file store).

Random create / append / fork / snapshot / rollback / commit / evict / fault / free
against a model of token lists; after every step: tables equal the model, no working
page leaked or freed while referenced, the directory and the prefix tree agree, and no
unverified page was ever stored.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

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
from kvtier.keys import page_keys
from kvtier.sequences import SequenceManager


class SequencesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.cache = TwoTierCache(SPEC, 20, 400, Path(self.tmp.name) / "store")
        self.run(self.cache.open())
        self.mgr = self.run(SequenceManager.open(self.cache, 10))
        self.model: dict[int, list[int]] = {}
        self.kv: dict[int, torch.Tensor] = {}
        self.versions: dict[int, list[tuple[int, list[int]]]] = {}
        self.verified_keys: set[bytes] = set()
        self.next_token = 1

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

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
        self.run(self.cache.evict(n))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        try:
            batch = self.run(self.mgr.ensure_resident(seqs))
        except CapacityError:
            return
        try:
            assert batch.seq_lens == [len(self.model[s]) for s in seqs]
            q = torch.ones((len(seqs), 1, 4, SPEC.head_dim), dtype=torch.float16)
            if all(batch.seq_lens):
                out = paged_attention(q, self.mgr.page, batch.block_table, batch.seq_lens, 1, SPEC)
                for i, s in enumerate(seqs):
                    kv = self.kv[s][1]
                    assert torch.equal(out[i], attention(q[i], kv[0], kv[1]))
        finally:
            self.run(self.mgr.release(batch))

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
        assert d.count("dram") <= self.cache.dram.capacity_pages
        assert not any(d.is_pinned(k) for k in d)

    @invariant()
    def directory_and_tree_agree(self) -> None:
        for s, toks in self.model.items():
            verified = self.versions[s][0][1] if self.versions[s] else toks
            self.verified_keys.update(page_keys(verified, self.mgr.namespace))
        d = self.cache.directory
        for tier in ("dram", "disk"):
            committed = set(d.keys_in(tier))
            in_tree = {k for k, tiers in self.cache.tree.items() if tier in tiers}
            assert committed == in_tree
            # nothing unverified was ever stored (keys of verified prefixes only)
            assert committed <= self.verified_keys


TestSequencesModel = SequencesModel.TestCase
TestSequencesModel.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
