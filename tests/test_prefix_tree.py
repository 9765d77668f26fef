"""The prefix tree: matches, leaves, hollow nodes, and a stateful check against a model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import KVTierUsageError
from kvtier.index.directory import Directory
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import ROOT_KEY, Namespace, PageKey, page_keys
from kvtier.spec import KVSpec

NS = Namespace("test-model", page_tokens=4)
TIERS = ["dram", "disk", "remote"]


def chain(tokens: list[int]) -> list[PageKey]:
    return page_keys(tokens, NS)


def test_match_reports_longest_prefix_and_top_tier() -> None:
    tree = PrefixTree(TIERS)
    keys = chain(list(range(20)))  # 5 pages
    tree.insert(keys[:3], "disk")
    tree.insert(keys[:2], "dram")
    m = tree.match(keys)
    assert m.keys == keys[:3]
    assert m.tiers == ["dram", "dram", "disk"]
    assert tree.match_length(keys) == 3
    assert tree.tiers_of(keys[0]) == ["dram", "disk"]
    assert tree.pages_in("dram") == 2 and tree.pages_in("disk") == 3


def test_shared_prefix_branches_and_leaves() -> None:
    tree = PrefixTree(TIERS)
    a = chain([1, 2, 3, 4, 5, 6, 7, 8])
    b = chain([1, 2, 3, 4, 9, 9, 9, 9])
    assert a[0] == b[0] and a[1] != b[1]
    tree.insert(a, "dram")
    tree.insert(b, "disk")
    assert not tree.is_leaf(a[0])
    assert not tree.is_leaf(a[0], "dram") and not tree.is_leaf(a[0], "disk")
    assert tree.is_leaf(a[0], "remote")
    assert tree.is_leaf(a[1]) and tree.is_leaf(b[1])
    evict = tree.evictable("dram")
    assert [k for k in [a[0], a[1]] if evict(k)] == [a[1]]
    not_pinned = tree.evictable("dram", also=lambda k: k != a[1])
    assert not not_pinned(a[1])


def test_hollow_node_ends_match_and_is_pruned() -> None:
    tree = PrefixTree(TIERS)
    keys = chain(list(range(12)))
    tree.insert(keys, "dram")
    assert tree.discard(keys[1], "dram")
    assert tree.match_length(keys) == 1
    assert keys[1] not in tree and tree.node_count() == 3
    assert not tree.is_leaf(keys[1])  # still has a cached descendant
    tree.discard(keys[2], "dram")
    assert tree.node_count() == 1  # the hollow middle went with its last descendant
    assert not tree.discard(keys[2], "dram")


def test_child_added_before_parent_links_up() -> None:
    tree = PrefixTree(TIERS)
    keys = chain(list(range(8)))
    tree.add(keys[1], keys[0], "disk")
    assert tree.match_length(keys) == 0
    assert not tree.is_leaf(keys[0], "disk")
    tree.add(keys[0], ROOT_KEY, "dram")
    assert tree.match(keys).tiers == ["dram", "disk"]


def test_a_parent_that_contradicts_the_chain_is_not_recorded() -> None:
    """Parents given by a caller (``store_pages`` takes any) may contradict the chain:
    a page after itself, or a hollow page (it left every tier, its children stayed) said
    to follow one of its own descendants. Recording either would close a cycle in which
    no page is ever a leaf; the tree keeps the page a root instead."""
    a, b, c = (PageKey(bytes([i]) * 16) for i in (1, 2, 3))
    tree = PrefixTree(TIERS)
    tree.insert([a, b, c], "dram")
    tree.discard(a, "dram")  # hollow: b and c keep it
    tree.add(a, c, "dram")  # "a after c": a -> b -> c -> a
    assert tree.parent_of(a) is None and tree.parent_of(b) == a
    assert tree.is_leaf(c, "dram") and tree.evictable("dram")(c)
    tree.add(b, b, "disk")
    tree.insert([c, c], "remote")
    assert tree.parent_of(b) == a and tree.parent_of(c) == b
    d = PageKey(bytes([4]) * 16)
    tree.insert([d], "dram", parent=d)
    assert tree.parent_of(d) is None and tree.is_leaf(d, "dram")
    tree.add(a, None, "disk")
    tree.discard(a, "dram")
    tree.discard(a, "disk")
    e = PageKey(bytes([5]) * 16)
    tree.add(a, e, "disk")  # a consistent parent is still learned
    assert tree.parent_of(a) == e and not tree.is_leaf(e, "disk")


def test_bad_input() -> None:
    with pytest.raises(KVTierUsageError, match="at least one tier"):
        PrefixTree([])
    with pytest.raises(KVTierUsageError, match="duplicate"):
        PrefixTree(["a", "a"])
    tree = PrefixTree(TIERS)
    with pytest.raises(KVTierUsageError, match="unknown tier 'hbm'"):
        tree.add(chain([1, 2, 3, 4])[0], None, "hbm")
    with pytest.raises(KVTierUsageError, match="16 bytes"):
        tree.add(PageKey(b"short"), None, "dram")


def test_attach_follows_directory_events() -> None:
    tree = PrefixTree(TIERS)
    d = Directory([*TIERS, "other"])
    keys = chain(list(range(12)))
    d.reserve(keys[0], "dram", parent=None)
    d.commit(keys[0], "dram")
    unsubscribe = tree.attach(d)  # picks up what is already committed
    d.reserve(keys[1], "dram", parent=keys[0])
    assert tree.match_length(keys) == 1  # reserved is invisible
    d.commit(keys[1], "dram")
    d.reserve(keys[2], "other", parent=keys[1])
    d.commit(keys[2], "other")  # a tier the tree does not track
    assert tree.match(keys).keys == keys[:2]
    d.reserve(keys[2], "disk", parent=keys[1])
    d.abort(keys[2], "disk")  # a failed write never shows
    assert tree.match_length(keys) == 2
    assert not tree.is_leaf(keys[0], "dram")
    d.remove(keys[1], "dram")
    assert tree.match_length(keys) == 1 and tree.is_leaf(keys[0], "dram")
    unsubscribe()
    d.remove(keys[0], "dram")
    assert tree.match_length(keys) == 1


# A pool of chains sharing prefixes: 3 roots, branching.
_TOKENS = [[r] * 4 + [b] * 4 + [c] * 4 for r in range(3) for b in range(2) for c in range(2)]
_CHAINS = [chain(t) for t in _TOKENS]
_PAGES: dict[PageKey, PageKey] = {}
for _c in _CHAINS:
    for _i, _k in enumerate(_c):
        _PAGES[_k] = _c[_i - 1] if _i else ROOT_KEY
_KEYS = sorted(_PAGES)


class PrefixTreeModel(RuleBasedStateMachine):
    """Random adds and discards; the tree must answer as a plain set-of-tiers model."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = PrefixTree(TIERS)
        self.model: dict[PageKey, set[str]] = {k: set() for k in _KEYS}

    @rule(key=st.sampled_from(_KEYS), tier=st.sampled_from(TIERS))
    def add(self, key: PageKey, tier: str) -> None:
        self.tree.add(key, _PAGES[key], tier)
        self.model[key].add(tier)

    @rule(
        c=st.sampled_from(_CHAINS),
        i=st.integers(0, 2),
        j=st.integers(1, 3),
        tier=st.sampled_from(TIERS),
    )
    def insert_chain(self, c: list[PageKey], i: int, j: int, tier: str) -> None:
        part = c[i : max(i, j)]
        if not part:
            return
        self.tree.insert(part, tier, parent=_PAGES[part[0]])
        for k in part:
            self.model[k].add(tier)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        held = [(k, t) for k, ts in self.model.items() for t in sorted(ts)]
        key, tier = data.draw(st.sampled_from(held))
        assert self.tree.discard(key, tier)
        self.model[key].discard(tier)

    @rule(key=st.sampled_from(_KEYS))
    def discard_all(self, key: PageKey) -> None:
        assert sorted(self.tree.discard_all(key)) == sorted(self.model[key])
        self.model[key].clear()

    @invariant()
    def agrees_with_model(self) -> None:
        assert dict(self.tree.items()) == {k: frozenset(v) for k, v in self.model.items() if v}
        for c in _CHAINS:
            expect = []
            for k in c:
                if not self.model[k]:
                    break
                expect.append(k)
            m = self.tree.match(c)
            assert m.keys == expect
            assert m.tiers == [next(t for t in TIERS if t in self.model[k]) for k in expect]
        children = {k: [c for c, p in _PAGES.items() if p == k] for k in _KEYS}
        for k in _KEYS:
            # a node survives while some descendant (or itself) is cached
            for tier in TIERS:
                expect_leaf = not any(tier in self.model[c] for c in children[k])
                assert self.tree.is_leaf(k, tier) == expect_leaf
        live = {k for k in _KEYS if self.model[k]}
        needed = set(live)
        for k in live:
            p = _PAGES[k]
            while p != ROOT_KEY:
                needed.add(p)
                p = _PAGES[p]
        # hollow nodes exist only on the path of a cached page: nothing leaks
        assert len(live) <= self.tree.node_count() <= len(needed)


TestPrefixTreeModel = PrefixTreeModel.TestCase
TestPrefixTreeModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


async def _evictions_with_children(tmp_path, leaf_first: bool) -> tuple[int, int]:
    """Store a 40-page chain into a 20-page DRAM tier of a real KVCache; count DRAM
    evictions of a page whose child was still in DRAM at that moment."""

    from kvtier.cache import KVCache
    from kvtier.config import KVTierConfig, TierConfig
    from kvtier.policy.leaf_first import LeafFirstPolicy

    spec = KVSpec(1, 1, 8, "float16", 4, name="leaf")
    pb = spec.page_bytes
    config = KVTierConfig(
        spec=spec,
        namespace=Namespace.for_spec(spec),
        tiers=[
            # plain LRU (adaptive cuts chains from the tail by itself)
            TierConfig("dram", "dram", 20 * pb, 0.8, 0.6, "lru"),
            TierConfig("disk", "file", 200 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
        write_policy="write-back",
        leaf_first=leaf_first,
    )
    async with KVCache(config, configure_log=False) as cache:
        d = cache.directory
        tree = cache.prefix_tree
        assert isinstance(cache.tiers[0].policy, LeafFirstPolicy) == leaf_first
        bad = 0
        removed = 0

        class Watch:
            def on_commit(self, key: PageKey, tier: str) -> None:
                pass

            def on_remove(self, key: PageKey, tier: str) -> None:
                nonlocal bad, removed
                if tier != "dram":
                    return
                removed += 1
                for k in d:
                    e = d.get(k)
                    if e is not None and e.parent == key and d.is_committed(k, "dram"):
                        bad += 1
                        return

        d.subscribe(Watch())
        tokens = np.arange(160, dtype=np.int64)
        for chunk in range(0, 160, 16):  # chunked: 4 pages at a time
            part = tokens[: chunk + 16]
            keys = cache.page_keys(part)
            new = keys[chunk // 4 :]
            parents = [keys[i - 1] if i else None for i in range(chunk // 4, len(keys))]
            pages = np.zeros((len(new), pb), dtype=np.uint8)
            await cache.store_pages(new, pages, parents=parents)
        assert tree.match_length(cache.page_keys(tokens)) == 40
    return bad, removed


async def test_leaf_first_policy_never_evicts_a_parent_before_its_child(tmp_path) -> None:
    bad, removed = await _evictions_with_children(tmp_path / "a", leaf_first=True)
    assert removed > 0 and bad == 0
    # control: plain LRU does evict parents first, so the check above can fail
    bad_lru, removed_lru = await _evictions_with_children(tmp_path / "b", leaf_first=False)
    assert removed_lru > 0 and bad_lru > 0


async def test_leaf_first_moves_ancestors_down_when_only_a_pinned_leaf_is_left(tmp_path) -> None:
    """A DRAM tier full of the ancestors of one pinned page still makes room (they move
    down: the prefix stays cached) instead of refusing with CapacityError."""

    from kvtier.cache import KVCache
    from kvtier.config import KVTierConfig, TierConfig

    spec = KVSpec(1, 1, 8, "float16", 4, name="leaf")
    pb = spec.page_bytes
    config = KVTierConfig(
        spec=spec,
        namespace=Namespace.for_spec(spec),
        tiers=[
            TierConfig("dram", "dram", 10 * pb, 1.0, 0.9),
            TierConfig("disk", "file", 100 * pb, 0.9, 0.8, options={"path": str(tmp_path)}),
        ],
        write_policy="write-back",
    )
    rng = np.random.default_rng(5)
    async with KVCache(config, configure_log=False) as cache:
        first = rng.integers(0, 1000, 8 * 4)
        stored = await cache.store(first, np.zeros((8, pb), np.uint8))
        await cache.load(stored.keys[-1:])  # pin the leaf: only its ancestors are free
        more = rng.integers(0, 1000, 4 * 4)
        again = await cache.store(more, np.zeros((4, pb), np.uint8))
        assert all(again.stored)
        found = await cache.lookup(first)
        assert found.keys == stored.keys  # every ancestor still cached (some on disk)
        assert "disk" in found.tiers
        cache.release(stored.keys[-1:])


NS_2 = Namespace("review-model", page_tokens=4)


def test_prefix_tree_insert_with_a_bad_key_keeps_counts_true() -> None:
    tree = PrefixTree(["dram", "disk"])
    keys = page_keys(list(range(12)), NS_2)
    with pytest.raises(KVTierUsageError, match="16 bytes"):
        tree.insert([keys[0], keys[1], PageKey(b"short")], "dram")
    # whatever the tree kept, its per-tier count agrees with its pages
    assert tree.pages_in("dram") == sum(1 for _, tiers in tree.items() if "dram" in tiers)
