"""kvtier's classic policies against textbook reference caches (kvtier/sim/reference.py).

The reference caches are independent transcriptions of the papers; LRU and LRU-K must
give the very same prefix hits as kvtier's policy objects driven by the replay, request
by request. (ARC and S3-FIFO differ from the references in documented details: kvtier's
capacity is learned, not given; only their own hand-computed tests apply.)
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.eviction import LRUKPolicy, LRUPolicy, make_policy
from kvtier.sim.reference import make_reference, reference_prefix_hits
from kvtier.sim.replay import SimTier, replay
from kvtier.sim.trace import Trace, requests_from_ids


def trace_of(reqs: list[list[int]]) -> Trace:
    rows = [(float(i), 4 * len(r), 1, r) for i, r in enumerate(reqs)]
    return Trace("t", 4, requests_from_ids(rows, 4))


def kvtier_hits(reqs: list[list[int]], capacity: int, policy: object) -> list[int]:
    res = replay(trace_of(reqs), [SimTier("t", capacity, policy)])  # type: ignore[arg-type]
    return [int(h) for h in res.req_hits[:, 0]]


def test_lru2_keeps_history_of_evicted_pages_hand_computed() -> None:
    # Capacity 2. a, b, a (hit: a has 2 refs), c (evicts b: 1 ref), d (evicts c), b comes
    # back: with b's history kept it has 2 refs (K-th ref at t=2) and evicts the cold d;
    # e then evicts a (its 2nd most recent ref, t=1, is older than b's, t=2); b hits.
    # An LRU-K that forgets evicted pages sees b as new and cold, evicts b for e, misses.
    reqs = [[1], [2], [1], [3], [4], [2], [5], [2]]
    want = [0, 0, 1, 0, 0, 0, 0, 1]
    blocks = [r.blocks for r in trace_of(reqs).requests]
    assert reference_prefix_hits(blocks, 2, "lru-k") == want
    assert kvtier_hits(reqs, 2, LRUKPolicy(k=2)) == want


def test_lru2_beats_lru_where_the_textbook_says_so() -> None:
    # A hot pair (1, 2) reused every other request, one-hit pages in between: LRU-2
    # keeps the pair, LRU lets each scan of two one-hit pages push it out.
    reqs: list[list[int]] = []
    nxt = 100
    for _ in range(20):
        reqs += [[1], [2], [nxt], [nxt + 1]]
        nxt += 2
    lru = sum(kvtier_hits(reqs, 3, LRUPolicy()))
    lru2 = sum(kvtier_hits(reqs, 3, LRUKPolicy(k=2)))
    ref = sum(reference_prefix_hits([r.blocks for r in trace_of(reqs).requests], 3, "lru-k"))
    assert lru2 == ref
    assert lru2 > lru


requests_strategy = st.lists(
    st.lists(st.integers(0, 14), min_size=1, max_size=3, unique=True), min_size=1, max_size=60
)
#: Capacities that hold every request: a batch bigger than the tier is refused whole (the
#: live cache raises CapacityError, the replay drops it), a reference cache keeps a part.
capacity_strategy = st.integers(3, 8)


@settings(max_examples=150, deadline=None)
@given(reqs=requests_strategy, capacity=capacity_strategy, k=st.integers(1, 3))
def test_lru_k_equals_the_textbook_reference(reqs: list[list[int]], capacity: int, k: int) -> None:
    blocks = [r.blocks for r in trace_of(reqs).requests]
    want = reference_prefix_hits(blocks, capacity, "lru-k", k=k)
    got = kvtier_hits(reqs, capacity, LRUKPolicy(k=k, history=1e9))
    assert got == want


@settings(max_examples=100, deadline=None)
@given(reqs=requests_strategy, capacity=capacity_strategy)
def test_lru_equals_the_textbook_reference(reqs: list[list[int]], capacity: int) -> None:
    blocks = [r.blocks for r in trace_of(reqs).requests]
    assert kvtier_hits(reqs, capacity, LRUPolicy()) == reference_prefix_hits(
        blocks, capacity, "lru"
    )


def test_lru_k_history_is_bounded() -> None:
    pol = LRUKPolicy(k=2, history=2.0, capacity=3)
    keys = [PageKey(i.to_bytes(16, "little")) for i in range(50)]
    for key in keys:
        pol.on_insert(key)
        if len(pol) > 3:
            (victim,) = pol.victims(1, lambda _k: True)
            pol.on_remove(victim)
    assert len(pol) == 3
    assert len(pol._hist) <= 3 + 2 * 3  # resident + retained histories


def test_lru_k_and_reference_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="history"):
        make_policy("lru-k", history=-1)
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("lru-k", capacity=0)
    with pytest.raises(KVTierUsageError, match="unknown reference algorithm"):
        make_reference("fifo", 3)
    with pytest.raises(KVTierUsageError, match="capacity"):
        make_reference("lru", 0)


@pytest.mark.parametrize("algorithm", ["arc", "s3-fifo"])
def test_reference_arc_and_s3fifo_stay_within_capacity_and_min(algorithm: str) -> None:
    from kvtier.sim.belady import belady_min
    from kvtier.sim.workloads import workload

    tr = workload("zipf", n=600, seed=3)
    blocks = [r.blocks for r in tr.requests]
    cap = max(tr.distinct_blocks() // 20, 4)
    hits = sum(reference_prefix_hits(blocks, cap, algorithm))
    assert 0 < hits <= belady_min(blocks, cap).prefix_hits
