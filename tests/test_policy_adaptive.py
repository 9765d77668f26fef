"""The default policy's parts: the two-class family, prefix cuts, miniature caches, and
``adaptive`` itself (deterministic, equal to its point when alone, within MIN)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.base import first_evictable
from kvtier.policy.eviction import make_policy
from kvtier.policy.prefix_cut import PageForest, PrefixCutPolicy
from kvtier.policy.shadow import KeySampler, MiniCache, key_hash
from kvtier.policy.twoclass import TwoClassPolicy
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace
from kvtier.sim.workloads import workload


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def every(_key: PageKey) -> bool:
    return True


def rate(trace: object, cap: int, factory: object) -> float:
    return replay(trace, make_tiers([cap], factory)).prefix_hit_rate  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("point", "classic"), [((0.0, "last"), "lru"), ((math.inf, "kth"), "lru-k")]
)
def test_two_class_ends_are_lru_and_lru2_exactly(point: tuple[float, str], classic: str) -> None:
    tr = workload("tenants", n=600, seed=4).without_hints()
    cap = tr.distinct_blocks() // 20
    fam = replay(tr, make_tiers([cap], lambda: TwoClassPolicy(*point)))
    ref = replay(tr, make_tiers([cap], functools.partial(make_policy, classic)))
    assert fam.req_hits.tolist() == ref.req_hits.tolist()


def test_two_class_orders_hand_computed() -> None:
    p = TwoClassPolicy(bonus=1.0, order="freq", capacity=4)
    for i in (1, 2, 3, 4):
        p.on_insert(k(i))  # times 1..4, all cold
    p.on_access(k(1))  # t5: 1 is hot, 2 uses -> score 5 + 1 x 4 = 9
    p.on_access(k(2))
    p.on_access(k(2))  # t7: 2 has 3 uses -> score 7 + 2 x 4 = 15
    # cold 3 (t3), cold 4 (t4), hot 1 (9), hot 2 (15)
    assert p.victims(4, every) == [k(3), k(4), k(1), k(2)]
    lru2 = TwoClassPolicy(bonus=math.inf, order="kth", capacity=4)
    for i in (1, 2, 3):
        lru2.on_insert(k(i))
    lru2.on_access(k(2))  # 2 hot (2nd most recent ref t2)
    lru2.on_access(k(1))  # 1 hot (t1): older 2nd ref, evicted before 2; cold 3 first
    assert lru2.victims(3, every) == [k(3), k(1), k(2)]
    with pytest.raises(ConfigError, match="order"):
        TwoClassPolicy(order="mru")
    with pytest.raises(ConfigError, match="probation"):
        TwoClassPolicy(probation=1.0)


def test_page_forest_cuts_from_the_tail_and_orphans_go_first() -> None:
    f = PageForest()
    f.add(k(1), None)
    f.add(k(2), k(1))
    f.add(k(3), k(2))
    f.add(k(4), k(1))  # 1 -> 2 -> 3 and 1 -> 4
    f.add(k(9), None)

    def order(_done: object) -> list[PageKey]:  # a policy that offers 1, then 9
        return [k(1), k(9)]

    def victims(n: int) -> list[PageKey]:
        return first_evictable(f.order(order), n, every)

    assert victims(3) == [k(3), k(2), k(4)]  # 1's subtree, deepest first
    assert victims(5) == [k(3), k(2), k(4), k(1), k(9)]

    def not_1(x: PageKey) -> bool:
        return x != k(1)

    # 1 pinned: its descendants are not pulled forward (the policy offers only 1 and 9)
    assert first_evictable(f.order(order, not_1), 5, not_1) == [k(9)]
    f.remove(k(2))  # 3 is an orphan now: it goes before anything else
    assert victims(1) == [k(3)]
    f.add(k(2), k(1))  # 2 came back: 3 is its child again, no longer an orphan
    assert f.orphans == {} and f.parent[k(3)] == k(2)


def _roots_reached(f: PageForest) -> bool:
    """Whether every page's chain of parents ends at a root within ``len(f)`` steps."""
    for key in f.parent:
        node: PageKey | None = key
        for _ in range(len(f) + 1):
            node = f.parent[node] if node is not None else None
            if node is None:
                break
        else:
            return False
    return True


def test_page_forest_refuses_a_parent_that_would_close_a_cycle() -> None:
    """Parents given by a caller (``KVCache.store_pages`` takes any) may contradict the
    ones before: 2 came after 1 and 3 after 2, then 1 comes back "after 3". Linking it
    would close a cycle (1 gets its orphan 2 back), which no walk ends: 1 becomes a root
    instead, and every page is offered once."""
    f = PageForest()
    f.add(k(1), None)
    f.add(k(2), k(1))
    f.add(k(3), k(2))
    f.remove(k(1))  # 2 waits for 1
    f.add(k(1), k(3))
    assert f.parent[k(1)] is None and f.parent[k(2)] == k(1) and _roots_reached(f)
    assert list(f.order(lambda _done: [k(3), k(1)])) == [k(3), k(2), k(1)]
    f.remove(k(2))  # 3 waits for 2; 2 "after 3" would close 2 -> 3 -> 2
    f.add(k(2), k(3))
    assert f.parent[k(2)] is None and f.parent[k(3)] == k(2) and _roots_reached(f)
    f.add(k(4), k(3))  # a consistent parent still links
    assert f.parent[k(4)] == k(3)
    pol = AdaptivePolicy(capacity=8)
    pol.on_insert(k(1))
    pol.on_insert(k(2), k(1))
    pol.on_remove(k(1))
    pol.on_insert(k(1), k(2))
    assert sorted(pol.victims(4, every)) == [k(1), k(2)]


def test_prefix_cut_never_beats_min_and_helps_lru_on_long_shared_prompts() -> None:
    tr = workload("toolagent", n=800, seed=3).without_hints()
    cap = tr.distinct_blocks() // 100
    ceiling = belady_min([r.blocks for r in tr.requests], cap).prefix_hit_rate
    plain = rate(tr, cap, functools.partial(make_policy, "lru"))
    cut = rate(tr, cap, lambda: PrefixCutPolicy(make_policy("lru")))
    assert plain < cut <= ceiling


def test_key_sampler_halving_keeps_a_subset() -> None:
    s = KeySampler()
    keys = [k(i) for i in range(2000)]
    assert all(s.keeps(x) for x in keys)
    s.halve()
    half = {x for x in keys if s.keeps(x)}
    s.halve()
    quarter = {x for x in keys if s.keeps(x)}
    assert quarter <= half and 800 < len(half) < 1200 and 350 < len(quarter) < 650
    assert key_hash(k(5)) == key_hash(k(5))


def test_mini_cache_stays_within_capacity_and_counts() -> None:
    m = MiniCache(make_policy("lru"), capacity=8.0, recent=2)
    hits = [m.reference(k(i % 12), None, 1.0) for i in range(60)]
    assert len(m.resident) <= 8 and m.refs == 60 and m.hits == sum(hits)
    m.capacity = 4.0
    m.shrink_to(4)
    assert len(m.resident) <= 4


def test_adaptive_alone_with_one_point_is_that_point_with_cuts() -> None:
    tr = workload("chat", n=700, seed=2).without_hints()
    cap = tr.distinct_blocks() // 30
    one = rate(tr, cap, lambda: AdaptivePolicy(points=["16:last"], experts=()))
    cut = rate(tr, cap, lambda: PrefixCutPolicy(TwoClassPolicy(16.0, "last")))
    assert one == cut


def _replayed_twice(tr: Trace, cap: int) -> tuple[AdaptivePolicy, float]:
    """``tr`` replayed twice through a tier of ``cap`` pages under ``adaptive``: the first
    run's policy and prefix hit rate, once the two runs were checked to hit alike."""
    pols: list[AdaptivePolicy] = []

    def fac() -> AdaptivePolicy:
        pols.append(AdaptivePolicy())
        return pols[-1]

    a = replay(tr, make_tiers([cap], fac))
    b = replay(tr, make_tiers([cap], fac))
    assert a.req_hits.tolist() == b.req_hits.tolist()
    return pols[0], a.prefix_hit_rate


def test_adaptive_is_deterministic_and_below_min() -> None:
    tr = workload("docqa", n=500, seed=1)
    cap = tr.distinct_blocks() // 20
    pol, hit_rate = _replayed_twice(tr, cap)
    assert 0 < hit_rate <= belady_min([r.blocks for r in tr.requests], cap).prefix_hit_rate
    info = pol.describe()
    assert info["leader"] in pol.names and 0 < info["sample_rate"] <= 1


def test_adaptive_samples_large_tiers() -> None:
    pol = AdaptivePolicy(mini_pages=16, capacity=1000)
    for i in range(1000):
        pol.on_insert(k(i))
    assert pol.sampler.rate <= 32 / 1000
    pol.victims(1, every)  # bounded from the tier's first eviction on
    assert all(m.capacity <= 33 and len(m.resident) <= 33 for m in pol.minis)


def test_adaptive_bad_parameters() -> None:
    for params, match in (
        ({"points": "0:last"}, "points"),
        ({"points": ["x:last"]}, "bad point"),
        ({"points": ["1:mru"]}, "order"),
        ({"points": ["1:last", "1:last"]}, "repeat"),
        ({"experts": ["adaptive"]}, "cannot be an expert"),
        ({"experts": ["nope"]}, "unknown eviction policy"),
        ({"experts": "s3-fifo"}, "experts must be a list of names"),
        ({"experts": {"s3-fifo": 1}}, "experts must be a list of names"),  # before: its keys
        ({"mini_pages": 4}, "mini_pages"),
        ({"window": 0}, "window"),
        ({"margin": -1}, "margin"),
        ({"capacity": 0}, "capacity"),
        ({"start": "lru"}, "neither one of the points"),
        ({"start": "2:last"}, "neither one of the points"),
        ({"start": "x:last"}, "bad point"),
    ):
        with pytest.raises(ConfigError, match=match):
            make_policy("adaptive", **params)


def test_adaptive_starts_on_a_point_or_an_expert() -> None:
    assert AdaptivePolicy(start="16:last").describe()["leader"] == "two-class(bonus=16,order=last)"
    assert AdaptivePolicy(start="s3-fifo").describe()["leader"] == "s3-fifo"
    pol = AdaptivePolicy(start="interval", capacity=8)
    assert pol.describe()["leader"] == "interval"
    for i in range(8):
        pol.on_insert(k(i))
    pol.on_access(k(0))
    assert pol.victims(1, every) == [k(1)]  # interval's order: the pages used once, oldest first


def _random_adaptive(seed: int, leader: int) -> tuple[AdaptivePolicy, list[PageKey]]:
    """An ``adaptive`` tier fed a small chat trace (chains, shared prefixes, reuse,
    removals that orphan pages), its leader then set to ``leader``."""
    import random

    rng = random.Random(seed)
    pol = AdaptivePolicy(capacity=64)
    held: list[PageKey] = []
    for r in range(120):
        parent: PageKey | None = None
        for i in range(rng.randint(1, 6)):
            key = k(rng.randint(0, 30) * 100 + i)
            pol.on_insert(key, parent)
            if key not in held:
                held.append(key)
            parent = key
        if r % 7 == 0 and held:
            gone = held.pop(rng.randrange(len(held)))
            pol.on_remove(gone)
    pol.leader = leader
    return pol, held


Ask = Callable[[int, Callable[[PageKey], bool]], list[PageKey]]


def _victim_by_victim(
    forest: PageForest, ask: Ask, n: int, ev: Callable[[PageKey], bool]
) -> list[PageKey]:
    """The prefix cuts' victims asked one at a time (the reference the one-pass order is
    checked against): evictable orphans, then for each page the policy offers (excluding
    those chosen), its evictable subtree deepest first."""
    out = [o for o in forest.orphans if ev(o)][:n]
    chosen = set(out)
    while len(out) < n:
        offered = ask(1, lambda x: x not in chosen and ev(x))
        if not offered:
            break
        for x in _deepest_first(forest, offered[0], chosen):
            if len(out) < n and ev(x):
                out.append(x)
                chosen.add(x)
        if offered[0] not in chosen:
            break
    return out


def _deepest_first(forest: PageForest, top: PageKey, skip: set[PageKey]) -> list[PageKey]:
    """``top``'s subtree without ``skip``'s subtrees, children (oldest first) before
    their parent (recursive post-order)."""
    out: list[PageKey] = []
    for c in forest.kids[top]:
        if c not in skip:
            out += _deepest_first(forest, c, skip)
    return [*out, top]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("leader", range(6))
def test_adaptive_victims_in_one_pass_equal_the_victim_by_victim_search(
    seed: int, leader: int
) -> None:
    """The one-pass order (``ordered_keys``, used by ``victims`` and by leaf-first
    eviction) gives exactly what asking the leader for one victim at a time under the
    prefix cuts gives, for every point of the family and for the S3-FIFO and interval
    experts (indexes 4 and 5), with some pages not evictable."""
    for n in (1, 3, 17, 200):
        pol, held = _random_adaptive(seed, leader)
        ref_pol, _ = _random_adaptive(seed, leader)
        pinned = set(held[::5])
        ref = _reference_victims(ref_pol, leader, n, pinned)
        assert len(ref) == min(n, len(held) - len(pinned))
        assert pol.victims(n, functools.partial(_not_in, pinned)) == ref
    if leader not in pol.experts:  # (S3-FIFO's choice moves pages between its queues)
        # A partly read order hands back what it held aside: the same answer again.
        assert pol.victims(5, every) == pol.victims(5, every)


def _not_in(pinned: set[PageKey], key: PageKey) -> bool:
    return key not in pinned


def _reference_victims(
    pol: AdaptivePolicy, leader: int, n: int, pinned: set[PageKey]
) -> list[PageKey]:
    def ok(key: PageKey) -> bool:
        return key not in pinned

    expert = pol.experts.get(leader)
    if expert is not None:
        return _victim_by_victim(pol.forest, expert.victims, n, ok)
    bonus, order = pol.grid[leader]

    def ask(m: int, fit: Callable[[PageKey], bool]) -> list[PageKey]:
        return pol.book.victims(m, fit, bonus, order)

    return _victim_by_victim(pol.forest, ask, n, ok)


def test_adaptive_order_is_lazy_when_an_expert_leads() -> None:
    """S3-FIFO (an expert) reorders its queues while it chooses: it is asked one page at
    a time, only as far as the order is read (a leaf-first walk of a few victims does
    not make it scan the tier)."""
    pol, _ = _random_adaptive(0, 0)
    pol.leader = next(iter(pol.experts))
    expert = pol.experts[pol.leader]
    asked: list[int] = []
    real = expert.victims

    def counting(n: int, ok: Callable[[PageKey], bool]) -> list[PageKey]:
        asked.append(n)
        return real(n, ok)

    expert.victims = counting  # type: ignore[method-assign,assignment]
    order = pol.ordered_keys(every)
    first = [next(order) for _ in range(len(pol.forest.orphans) + 3)]  # orphans, then 3
    order.close()
    assert len(set(first)) == len(first)
    assert 1 <= len(asked) <= 3 and set(asked) == {1}


@pytest.mark.parametrize("point", [(0.0, "last"), (1.0, "freq"), (16.0, "last"), (math.inf, "kth")])
def test_two_class_order_is_its_victims(point: tuple[float, str]) -> None:
    """A point's ``ordered_keys`` (what the miniatures' prefix cuts walk once) lists its
    victims in order; with a probation share it has none (its hot-first switch counts
    the cold pages taken)."""
    pol = TwoClassPolicy(*point, capacity=32)
    for i in range(60):
        pol.on_insert(k(i % 40))
        if i % 3 == 0:
            pol.on_access(k(i // 2))
    pinned = {k(3), k(7)}

    def ok(x: PageKey) -> bool:
        return x not in pinned

    order = [x for x in pol.ordered_keys() or () if ok(x)]
    assert sorted(order) == sorted(x for x in pol.book.resident if ok(x))
    for n in (1, 5, 40):
        assert pol.victims(n, ok) == order[:n]
    assert TwoClassPolicy(*point, probation=0.5).ordered_keys() is None


def _expert_at(pol: AdaptivePolicy, name: str) -> int:
    return pol.names.index(name)


def test_s3fifo_taking_the_lead_takes_over_its_exact_miniatures_state() -> None:
    """While another part leads, the tier's S3-FIFO never chooses, so its queues drift
    from those of the S3-FIFO that ran alone in its miniature (used pages are never moved
    to the main queue); when it takes the lead from an exact miniature (sample rate 1) the
    tier gets a copy of the miniature's S3-FIFO holding exactly the tier's pages, and the
    miniature's own policy is left as it was. ``interval`` (no ``copy_holding``) keeps
    its own state."""
    tr = workload("rag", n=300, seed=1).without_hints()
    # A margin no lead reaches: the tier follows LRU throughout.
    pol = AdaptivePolicy(capacity=tr.distinct_blocks() // 20, start="0:last", margin=1e9)
    pols = iter([pol])
    replay(tr, make_tiers([pol.c], lambda: next(pols)))
    assert pol.sampler.rate == 1.0 and pol.minis[0].evicted and pol.switches == 0
    s3 = _expert_at(pol, "s3-fifo")
    mini = pol.minis[s3].policy.inner  # type: ignore[attr-defined]
    both = pol.book.resident & pol.minis[s3].resident

    def queues(p: object) -> tuple[list[PageKey], list[PageKey]]:
        return (
            [x for x in p.small if x in both],  # type: ignore[attr-defined]
            [x for x in p.main if x in both],  # type: ignore[attr-defined]
        )

    drifted = pol.experts[s3]
    assert queues(drifted) != queues(mini)
    mini_state = (list(mini.small), list(mini.main), dict(mini.freq))

    pol.follow("s3-fifo")
    took = pol.experts[s3]
    assert took is not drifted and pol.takeovers == 1 and pol.switches == 1
    assert sorted(took.freq) == sorted(pol.book.resident)  # type: ignore[attr-defined]
    assert queues(took) == queues(mini)
    assert (list(mini.small), list(mini.main), dict(mini.freq)) == mini_state

    iv = _expert_at(pol, "interval")
    kept = pol.experts[iv]
    pol.follow("interval")
    assert pol.experts[iv] is kept and pol.takeovers == 1 and pol.switches == 2


def test_no_takeover_from_a_sampled_miniature() -> None:
    """A sampled miniature saw only some pages: its expert does not take over."""
    pol = AdaptivePolicy(mini_pages=16, capacity=1000, start="0:last")
    for i in range(1200):
        pol.on_insert(k(i % 1100))
        if len(pol) > 1000:
            pol.on_remove(pol.victims(1, every)[0])
    assert pol.sampler.rate < 1
    s3 = _expert_at(pol, "s3-fifo")
    kept = pol.experts[s3]
    pol.follow("s3-fifo")
    assert pol.experts[s3] is kept and pol.takeovers == 0


def test_adaptive_experts_track_the_tiers_pages_through_takeovers() -> None:
    """Replayed where S3-FIFO takes the lead (``rag`` at 5 %), every expert tracks
    exactly the tier's pages at the end, and the replay is repeatable."""
    tr = workload("rag", n=1500, seed=4).without_hints()
    pol, _ = _replayed_twice(tr, tr.distinct_blocks() // 20)
    assert pol.takeovers >= 1, pol.describe()
    assert pol.describe()["takeovers"] == pol.takeovers
    for expert in pol.experts.values():
        assert len(expert) == len(pol) and all(x in expert for x in pol.book.resident)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert"] * 5 + ["access"] * 3 + ["remove", "evict", "follow"]),
        st.integers(0, 63),
    ),
    min_size=60,
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_every_expert_tracks_the_tiers_pages_whatever_leads(ops: list[tuple[str, int]]) -> None:
    """Inserts (page ``j`` after page ``j - 1``, as content-addressed keys chain: never
    a cycle), hits, removals, evictions to the capacity and forced switches to any part
    in any order: after each step every expert, the ones that took over included, tracks
    exactly the tier's pages, and victims are resident."""
    pol = AdaptivePolicy(capacity=24)
    for op, i in ops:
        j = i % 40
        key = k(j)
        if op == "insert":
            parent = k(j - 1) if j else None
            pol.on_insert(key, parent if parent in pol else None)
        elif op == "access":
            pol.on_access(key)
        elif op == "remove":
            pol.on_remove(key)
        elif op == "evict":
            victims = pol.victims(max(len(pol) - 24, 0) + i % 2, every)
            assert all(v in pol for v in victims) and len(set(victims)) == len(victims)
            for v in victims:
                pol.on_remove(v)
        else:
            parts = [f"{b:g}:{o}" for b, o in pol.grid] + pol.names[len(pol.grid) :]
            pol.follow(parts[i % len(parts)])
        for expert in pol.experts.values():
            assert len(expert) == len(pol) and all(x in expert for x in pol.book.resident)
    assert pol.takeovers <= pol.switches
    with pytest.raises(ConfigError, match="neither one of the points"):
        pol.follow("lru")
