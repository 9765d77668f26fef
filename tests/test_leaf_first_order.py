"""LeafFirstPolicy over a policy with one preference order (``ordered_keys``): the victims
of one call equal those of one-victim calls made one after the other (each after the
previous victim left), and a call walks the order once instead of rescanning every chain's
ancestors (quadratic in the chain length)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import ROOT_KEY, Namespace, PageKey, page_keys
from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.eviction import LRUKPolicy, LRUPolicy
from kvtier.policy.leaf_first import LeafFirstPolicy

NS = Namespace("leaf-first-order", page_tokens=1)
TIERS = ["dram", "disk"]


class _NoOrder(LRUPolicy):
    """The same LRU without the hook: the wrapper's generic path (the reference)."""

    ordered_keys = None  # type: ignore[assignment]


def _build(
    forest: list[tuple[int, int]], inner: Callable[[], EvictionPolicy], tier: str,
    touches: list[int], in_disk: list[int],
) -> tuple[PrefixTree, LeafFirstPolicy, list[PageKey]]:  # fmt: skip
    """Chains ``(branch point, length)``: chain i forks off chain ``branch point % i``'s
    pages (shared prefix), stored root first into ``tier``; then some pages are touched
    (moved to the recent end) and some are also held by ``disk``."""
    tree = PrefixTree(TIERS)
    policy = LeafFirstPolicy(inner(), tree, tier, last=tier == "disk")
    keys: list[PageKey] = []
    chains: list[list[PageKey]] = []
    for i, (fork, length) in enumerate(forest):
        prefix: list[PageKey] = []
        if chains:
            base = chains[fork % len(chains)]
            prefix = base[: fork % (len(base) + 1)]
        parent = prefix[-1] if prefix else ROOT_KEY
        new = page_keys(list(range(1000 * (i + 1), 1000 * (i + 1) + length)), NS, parent)
        for k in new:
            tree.add(k, parent, tier)
            policy.on_insert(k, parent)
            parent = k
        chains.append(prefix + new)
        keys += new
    for i in touches:
        if keys:
            policy.on_access(keys[i % len(keys)])
    for i in in_disk:
        if keys and tier == "dram":
            k = keys[i % len(keys)]
            tree.add(k, tree.parent_of(k), "disk")
    return tree, policy, keys


def _one_by_one(
    tree: PrefixTree, policy: LeafFirstPolicy, tier: str, n: int,
    evictable: Callable[[PageKey], bool],
) -> list[PageKey]:  # fmt: skip
    out: list[PageKey] = []
    for _ in range(n):
        got = policy.victims(1, evictable)
        if not got:
            break
        out.append(got[0])
        tree.discard(got[0], tier)
        policy.on_remove(got[0])
    return out


#: Random cached forests: chains (fork point, length), pages touched, pages also on disk,
#: pinned pages, and the tier asked.
FOREST_CASES = {
    "forest": st.lists(st.tuples(st.integers(0, 50), st.integers(1, 12)), min_size=1, max_size=6),
    "touches": st.lists(st.integers(0, 80), max_size=10),
    "in_disk": st.lists(st.integers(0, 80), max_size=6),
    "pinned": st.sets(st.integers(0, 80), max_size=5),
    "tier": st.sampled_from(TIERS),
}


@settings(max_examples=150, deadline=None)
@given(**FOREST_CASES, n=st.integers(1, 40), kind=st.sampled_from(["lru", "lru-k"]))
def test_one_pass_equals_one_victim_at_a_time(
    forest: list[tuple[int, int]], touches: list[int], in_disk: list[int], pinned: set[int],
    n: int, tier: str, kind: str,
) -> None:  # fmt: skip
    inner, reference = _KINDS[kind]
    _tree, policy, keys = _build(forest, inner, tier, touches, in_disk)
    pins = {keys[i % len(keys)] for i in pinned}

    def evictable(k: PageKey) -> bool:
        return k not in pins

    got = policy.victims(n, evictable)
    ref_tree, ref_policy, _ = _build(forest, reference, tier, touches, in_disk)
    assert got == _one_by_one(ref_tree, ref_policy, tier, n, evictable)
    assert len(set(got)) == len(got) and not pins & set(got)


class _NoOrderK(LRUKPolicy):
    ordered_keys = None  # type: ignore[assignment]


#: Policy kinds: (the one with ``ordered_keys``, the same without it).
_KINDS: dict[str, tuple[Callable[[], EvictionPolicy], Callable[[], EvictionPolicy]]] = {
    "lru": (LRUPolicy, _NoOrder),
    "lru-k": (lambda: LRUKPolicy(2), lambda: _NoOrderK(2)),
}


def _adaptive(point: int) -> Callable[[], EvictionPolicy]:
    """``adaptive`` following one point of its family (so it has one order)."""

    def make() -> EvictionPolicy:
        pol = AdaptivePolicy(capacity=16)
        pol.leader = point
        return pol

    return make


@settings(max_examples=150, deadline=None)
@given(**FOREST_CASES, n=st.integers(1, 60), point=st.integers(0, 3))
def test_adaptive_in_one_pass_takes_leaves_only_and_all_it_may(
    forest: list[tuple[int, int]], touches: list[int], in_disk: list[int], pinned: set[int],
    n: int, tier: str, point: int,
) -> None:  # fmt: skip
    """``adaptive`` cuts a chain from its tail when the chain's root is its victim (its
    order depends on which pages may go, so it is not one-victim-at-a-time LRU): under
    leaf-first eviction, walked once, every victim is a leaf when its turn comes (no
    child left in the tier; in the last tier, none anywhere), none is pinned, and the
    call finds as many as leaf-first eviction can take (``n``, or every page whose
    subtree holds no pinned page)."""
    tree, policy, keys = _build(forest, _adaptive(point), tier, touches, in_disk)
    pins = {keys[i % len(keys)] for i in pinned}
    got = policy.victims(n, lambda k: k not in pins)
    assert len(set(got)) == len(got) and not pins & set(got)
    last = tier == "disk"
    blocked: set[PageKey | None] = set()  # pinned pages and their ancestors
    for pin in pins:
        up: PageKey | None = pin
        while up is not None and up not in blocked:
            blocked.add(up)
            up = tree.parent(up)
    removable = sum(1 for k in keys if k not in blocked)
    for k in got:
        assert tree.is_leaf(k, None if last else tier), "a victim with a child left"
        tree.discard(k, tier)
    assert len(got) == min(n, removable)


class _CountingLRU(LRUPolicy):
    """LRU that counts the keys its order hands out."""

    walked = 0

    def ordered_keys(self, evictable=None):  # type: ignore[no-untyped-def]
        for k in super().ordered_keys(evictable):
            _CountingLRU.walked += 1
            yield k


def test_a_chain_leaves_tail_first_in_one_walk() -> None:
    """64 chains of 64 pages in LRU order: the 64 victims of one call are the oldest
    chain, leaf first, found by walking that chain once (rescanning, a call would walk
    every chain to find one leaf in each)."""
    _CountingLRU.walked = 0
    _tree, policy, keys = _build([(0, 64)] * 64, _CountingLRU, "dram", [], [])
    asked: list[PageKey] = []

    def evictable(k: PageKey) -> bool:
        asked.append(k)
        return True

    got = policy.victims(64, evictable)
    assert got == keys[:64][::-1]
    assert _CountingLRU.walked == 64  # the first chain only
    assert len(asked) == 64  # one question per victim: no ancestor asked twice


def test_a_shared_prefix_stays_while_another_chain_needs_it() -> None:
    """Two chains share a 4-page prefix; evicting the older chain's own pages must stop
    at the fork: the shared pages still have a child here."""
    _tree, policy, keys = _build([(0, 8), (4, 6)], LRUPolicy, "dram", [], [])
    first_own = keys[4:8]  # chain 0's pages after the shared prefix
    got = policy.victims(20, lambda k: True)
    assert got[:4] == first_own[::-1]
    assert set(keys[:4]).isdisjoint(got[: 4 + 6 - 1])  # the prefix goes only after chain 1
    assert got[-4:] == keys[:4][::-1]


def test_the_default_eviction_policy_is_walked_in_one_pass() -> None:
    """A tier that names no policy gets one whose order leaf-first eviction walks once
    (``ordered_keys``): without it every victims call rescans the order once per chain
    level, and a store cost milliseconds per page at 2·10^4 pages (the ``adaptive``
    policy as the default did; benchmarks/control_plane.py)."""
    from kvtier.config import load_config
    from kvtier.policy.eviction import make_policy

    tier = load_config({"tiers": [{"name": "dram", "backend": "dram", "capacity": "64MiB"}]}, {})
    name = tier.config.tiers[0].eviction
    assert callable(getattr(make_policy(name), "ordered_keys", None)), name
