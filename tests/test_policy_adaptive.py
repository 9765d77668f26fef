"""The default policy's parts: the two-class family, prefix cuts, miniature caches, and
``adaptive`` itself (deterministic, equal to its point when alone, within MIN)."""

from __future__ import annotations

import functools
import math

import pytest

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.prefix_cut import PageForest, PrefixCutPolicy
from kvtier.policy.shadow import KeySampler, MiniCache, key_hash
from kvtier.policy.twoclass import TwoClassPolicy
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import make_tiers, replay
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

    def order(n: int, ok: object) -> list[PageKey]:  # a policy that always offers 1 first
        return [x for x in (k(1), k(9)) if ok(x)][:n]  # type: ignore[operator]

    assert f.victims(order, 3, every) == [k(3), k(2), k(4)]  # 1's subtree, deepest first
    assert f.victims(order, 5, every) == [k(3), k(2), k(4), k(1), k(9)]
    f.remove(k(2))  # 3 is an orphan now: it goes before anything else
    assert f.victims(order, 1, every) == [k(3)]
    f.add(k(2), k(1))  # 2 came back: 3 is its child again, no longer an orphan
    assert f.orphans == {} and f.parent[k(3)] == k(2)


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


def test_adaptive_is_deterministic_and_below_min() -> None:
    tr = workload("docqa", n=500, seed=1)
    cap = tr.distinct_blocks() // 20
    pols: list[AdaptivePolicy] = []

    def fac() -> AdaptivePolicy:
        pols.append(AdaptivePolicy())
        return pols[-1]

    a = replay(tr, make_tiers([cap], fac))
    b = replay(tr, make_tiers([cap], fac))
    assert a.req_hits.tolist() == b.req_hits.tolist()
    assert 0 < a.prefix_hit_rate <= belady_min([r.blocks for r in tr.requests], cap).prefix_hit_rate
    info = pols[0].describe()
    assert info["leader"] in pols[0].names and 0 < info["sample_rate"] <= 1


def test_adaptive_samples_large_tiers() -> None:
    pol = AdaptivePolicy(mini_pages=16, capacity=1000)
    for i in range(1000):
        pol.on_insert(k(i))
    assert pol.sampler.rate <= 32 / 1000
    assert all(m.capacity <= 33 for m in pol.minis)


def test_adaptive_bad_parameters() -> None:
    for params, match in (
        ({"points": "0:last"}, "points"),
        ({"points": ["x:last"]}, "bad point"),
        ({"points": ["1:mru"]}, "order"),
        ({"points": ["1:last", "1:last"]}, "repeat"),
        ({"experts": ["adaptive"]}, "cannot be an expert"),
        ({"experts": ["nope"]}, "unknown eviction policy"),
        ({"mini_pages": 4}, "mini_pages"),
        ({"window": 0}, "window"),
        ({"margin": -1}, "margin"),
        ({"capacity": 0}, "capacity"),
    ):
        with pytest.raises(ConfigError, match=match):
            make_policy("adaptive", **params)


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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("leader", range(4))
def test_adaptive_victims_in_one_pass_equal_the_victim_by_victim_search(
    seed: int, leader: int
) -> None:
    """The one-pass order (``ordered_keys``, used by ``victims`` and by leaf-first
    eviction) gives exactly what asking the point's order for one victim at a time under
    the prefix cuts gives, for every point, with some pages not evictable."""
    pol, held = _random_adaptive(seed, leader)
    bonus, order = pol.grid[leader]
    pinned = set(held[::5])

    def ok(key: PageKey) -> bool:
        return key not in pinned

    def one_at_a_time(m: int, fit: object) -> list[PageKey]:
        return pol.book.victims(m, fit, bonus, order)  # type: ignore[arg-type]

    for n in (1, 3, 17, len(held) + 5):
        ref = pol.forest.victims(one_at_a_time, n, ok)
        assert pol.victims(n, ok) == ref
        assert [x for x in pol.ordered_keys(ok) or () if ok(x)][:n] == ref  # type: ignore[operator]
    # A partly read order hands back what it held aside: the same answer again.
    assert pol.victims(5, ok) == pol.victims(5, ok)


def test_adaptive_has_no_single_order_while_an_expert_leads() -> None:
    """S3-FIFO (an expert) changes its queues while choosing victims: no one order to
    expose, so ``ordered_keys`` is ``None`` and leaf-first eviction asks ``victims``."""
    pol, _ = _random_adaptive(0, 0)
    assert pol.ordered_keys() is not None
    pol.leader = next(iter(pol.experts))
    assert pol.ordered_keys() is None
    assert pol.victims(4, every)
