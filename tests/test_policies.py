"""Each eviction/admission policy against small hand-computed cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.admission import CountMinSketch, FrequencyAdmission, ReusePredictor
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy
from kvtier.policy.prefetch import LookaheadPredictor, PrefixPredictor
from kvtier.policy.prefix_aware import PrefixLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.session import SessionPolicy


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def every(_key: PageKey) -> bool:
    return True


def test_registered_on_import() -> None:
    for name in ("lru", "lru-k", "arc", "s3-fifo", "prefix-lru", "session"):
        assert name in EVICTION_POLICIES
        assert make_policy(name) is not None


def test_arc_ghost_hit_in_b1_grows_p_and_enters_t2() -> None:
    arc = ARCPolicy(capacity=2)
    arc.on_insert(k(1))
    arc.on_insert(k(2))
    # T1 = [1, 2], p = 0 -> victim is T1's LRU.
    assert arc.victims(1, every) == [k(1)]
    arc.on_remove(k(1))
    assert k(1) in arc.b1
    arc.on_insert(k(1))  # ghost hit in B1: p grows by max(|B2|/|B1|, 1) = 1
    assert arc.p == 1.0
    assert k(1) in arc.t2 and k(1) in arc
    # |T1| = 1 is not > p = 1, so the victim comes from T2.
    assert arc.victims(1, every) == [k(1)]


def test_arc_access_promotes_to_t2_and_respects_evictable() -> None:
    arc = ARCPolicy(capacity=3)
    for i in (1, 2, 3):
        arc.on_insert(k(i))
    arc.on_access(k(1))
    assert list(arc.t1) == [k(2), k(3)] and list(arc.t2) == [k(1)]
    assert arc.victims(2, lambda x: x != k(2)) == [k(3), k(1)]


def test_s3fifo_one_hit_pages_leave_through_small_queue() -> None:
    s3 = S3FIFOPolicy(small_ratio=0.5)
    for i in range(4):
        s3.on_insert(k(i))
    s3.on_access(k(0))  # accessed while in the small queue -> moves to main on scan
    v = s3.victims(1, every)
    assert v == [k(1)]
    assert k(0) in s3.main
    s3.on_remove(k(1))
    assert k(1) in s3.ghost
    s3.on_insert(k(1))  # ghost hit -> main
    assert k(1) in s3.main


def test_s3fifo_copy_holding_tracks_exactly_the_given_pages_and_leaves_the_original() -> None:
    s3 = S3FIFOPolicy(small_ratio=0.25)
    for i in range(8):
        s3.on_insert(k(i))
    s3.on_access(k(0))
    s3.on_access(k(1))
    s3.on_remove(s3.victims(1, every)[0])  # k(0), k(1) move to main; k(2) leaves for the ghost
    assert list(s3.main) == [k(0), k(1)] and list(s3.ghost) == [k(2)]
    before = (list(s3.small), list(s3.main), list(s3.ghost), dict(s3.freq))

    # Keeps k(1) and k(3)..k(7) but not k(0); k(2) (in the ghost) and k(9) are new to it.
    keys = [k(9), k(2), k(1), *(k(i) for i in range(3, 8))]
    copy = s3.copy_holding(keys)
    assert sorted(copy.freq) == sorted(keys) and len(copy) == len(keys)
    assert k(0) not in copy and k(2) not in copy.ghost
    assert list(copy.main) == [k(9), k(2), k(1)]  # the new ones first, in the order given
    assert all(copy.freq[x] == 0 for x in (k(9), k(2)))
    assert (list(s3.small), list(s3.main), list(s3.ghost), dict(s3.freq)) == before

    copy.on_access(k(3))
    assert s3.freq[k(3)] == 0  # independent counters
    # Small queue (k(3)..k(7), 5 pages) above its share: it goes first; k(3) was used.
    assert copy.victims(1, every) == [k(4)]
    small = S3FIFOPolicy(small_ratio=0.9)
    for i in range(4):
        small.on_insert(k(i))
    moved = small.copy_holding([k(7), k(0), k(1), k(2), k(3)])
    # The small queue (4 of 5 pages) is at its share: the new page at the main head goes.
    assert moved.victims(2, every) == [k(7), k(0)]


def test_s3fifo_bad_ratio() -> None:
    with pytest.raises(ConfigError, match="small_ratio"):
        S3FIFOPolicy(small_ratio=1.5)


def test_prefix_lru_evicts_leaves_and_whole_cold_chain() -> None:
    p = PrefixLRUPolicy()
    # Chain a: 1 -> 2 -> 3 ; chain b shares 1: 1 -> 4
    p.on_insert(k(1))
    p.on_insert(k(2), k(1))
    p.on_insert(k(3), k(2))
    p.on_insert(k(4), k(1))
    p.on_access(k(4))
    # Leaves: 3 (older) and 4. The cold chain 3 -> 2 goes as a unit, stopping at 1
    # (shared with 4).
    assert p.victims(3, every) == [k(3), k(2), k(4)]
    assert p.victims(2, every) == [k(3), k(2)]
    # A parent never leaves before its children: 1 comes last, after both chains.
    assert p.victims(4, every) == [k(3), k(2), k(4), k(1)]


def test_prefix_lru_parent_becomes_leaf_after_children_removed() -> None:
    p = PrefixLRUPolicy()
    p.on_insert(k(1))
    p.on_insert(k(2), k(1))
    assert p.victims(1, every) == [k(2)]
    p.on_remove(k(2))
    assert p.victims(1, every) == [k(1)]
    assert len(p) == 1


def test_prefix_lru_survives_a_parent_leaving_before_its_child() -> None:
    """A delete can take a page out before its children: they become roots (victims()
    used to raise KeyError on the missing parent), and a parent that comes back and
    loses a child again becomes a leaf again."""
    p = PrefixLRUPolicy()
    p.on_insert(k(1))
    p.on_insert(k(2), k(1))
    p.on_insert(k(3), k(2))
    p.on_remove(k(2))  # the middle of the chain goes first
    assert p.victims(3, every) == [k(1), k(3)]  # 1 lost its only child; 3 is a root now
    p.on_insert(k(2), k(1))
    p.on_remove(k(3))
    assert p.victims(2, every) == [k(2), k(1)]
    p.on_remove(k(2))
    assert p.victims(1, every) == [k(1)] and len(p) == 1


def test_prefix_lru_falls_back_to_the_ancestors_of_a_spared_leaf() -> None:
    """A batch extending chain 1 -> 2 -> 3 spares 3 (its parent): victims() offers
    nothing, the fallback (ancestors, which a tier above the last moves down) offers 2
    then 1, and the other chain's leaf first."""
    p = PrefixLRUPolicy()
    p.on_insert(k(1))
    p.on_insert(k(2), k(1))
    p.on_insert(k(3), k(2))
    p.on_insert(k(9))
    spared = {k(3), k(9)}
    assert p.victims(2, lambda key: key not in spared) == []
    assert p.fallback_victims(2, lambda key: key not in spared) == [k(2), k(1)]
    assert p.fallback_victims(3, lambda key: key != k(3)) == [k(2), k(1), k(9)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("iira"), st.integers(0, 11), st.integers(0, 11))))
def test_prefix_lru_offers_every_page_after_its_children(ops: list[tuple[str, int, int]]) -> None:
    """Any sequence of inserts (under a page present or not), removals in any order and
    accesses: victims() offers every page exactly once, each after all its children."""
    p = PrefixLRUPolicy()
    parent: dict[int, int | None] = {}  # the model: a page's parent while both are here
    for op, a, b in ops:
        if op == "i" and a not in parent:
            parent[a] = b if b in parent and b != a else None
            p.on_insert(k(a), k(b) if parent[a] is not None else None)
        elif op == "r" and a in parent:
            del parent[a]
            parent.update({c: None for c, q in parent.items() if q == a})
            p.on_remove(k(a))
        elif op == "a":
            p.on_access(k(a))
        order = [int.from_bytes(v, "little") for v in p.victims(len(parent) + 1, every)]
        assert sorted(order) == sorted(parent)
        for c, q in parent.items():
            if q is not None:
                assert order.index(c) < order.index(q)


def test_session_demotes_superseded_tail() -> None:
    s = SessionPolicy()
    s.on_insert(k(10))  # an unrelated, older page
    s.on_insert(k(1))
    s.on_insert(k(2), k(1))
    s.on_insert(k(3), k(2))  # the partial tail of turn 1
    s.on_access(k(1))
    s.on_access(k(2))  # turn 2 reuses 1, 2 ...
    s.on_insert(k(4), k(2))  # ... and continues on a new branch: 3 is superseded
    assert list(s.t1) == [k(3), k(10), k(4)] and list(s.t2) == [k(1), k(2)]
    assert s.victims(1, every) == [k(3)]  # plain ARC/LRU would pick 10


def test_session_long_ghost_memory_promotes_returning_pages() -> None:
    s = SessionPolicy(ghost_factor=4.0, capacity=2)
    s.on_insert(k(1))
    s.on_insert(k(2))
    s.on_remove(k(1))
    for i in range(3, 8):  # 5 more one-use pages pass through; ARC's ghost holds 2 - |T1|
        s.on_insert(k(i))
        s.on_remove(k(i))
    assert k(1) in s.b1  # still remembered (ghost bound 4 x 2 = 8 keys with T1)
    s.on_insert(k(1))
    assert k(1) in s.t2 and s.p == 1.0
    arc = ARCPolicy(capacity=2)
    arc.on_insert(k(1))
    arc.on_insert(k(2))
    arc.on_remove(k(1))
    for i in range(3, 8):
        arc.on_insert(k(i))
        arc.on_remove(k(i))
    assert k(1) not in arc.b1  # plain ARC forgot it


def test_session_bad_params() -> None:
    with pytest.raises(ConfigError, match="ghost_factor"):
        SessionPolicy(ghost_factor=0.5)


def test_session_never_returns_pinned() -> None:
    s = SessionPolicy()
    for i in range(5):
        s.on_insert(k(i))
    s.on_access(k(4))
    assert s.victims(5, lambda x: x != k(2)) == [k(0), k(1), k(3), k(4)]


def test_count_min_sketch_counts_and_forgets() -> None:
    cms = CountMinSketch(width=64, sample=8)
    for _ in range(3):
        cms.add(b"a")
    assert cms.estimate(b"a") >= 3
    for i in range(5):
        cms.add(bytes([i]))  # 8th add halves every counter
    assert cms.estimate(b"a") == 1


def test_frequency_admission_threshold() -> None:
    adm = FrequencyAdmission(threshold=2)
    assert not adm.admit(k(1))
    adm.on_access(k(1))
    assert not adm.admit(k(1))
    adm.on_access(k(1))
    assert adm.admit(k(1))
    with pytest.raises(ConfigError):
        FrequencyAdmission(threshold=0)


def test_reuse_predictor_admits_children_of_reused_pages() -> None:
    r = ReusePredictor()
    r.on_access(k(1))
    r.note_parent(k(2), k(1))
    assert not r.admit(k(2))  # parent seen once only
    r.on_access(k(1))
    r.note_parent(k(3), k(1))
    assert r.admit(k(3)) and r.admit(k(1))


def test_lookahead_predictor_weights_by_distance() -> None:
    p = LookaheadPredictor(lookahead=2, decay=0.5, threshold=0.3)
    p.observe([k(1), k(2), k(3)])
    p.observe([k(1), k(2), k(4)])
    # After [.., 1]: 2 follows with 1.0; then 3 and 4 each 0.5 * 0.5 = 0.25 < 0.3.
    assert p.predict([k(1)]) == [k(2)]
    p2 = LookaheadPredictor(lookahead=2, decay=1.0, threshold=0.5)
    p2.observe([k(1), k(2), k(3)])
    p2.observe([k(1), k(2), k(4)])
    assert p2.predict([k(1)]) == [k(2), k(3), k(4)]
    assert PrefixPredictor().predict([k(5), k(6)]) == [k(5), k(6)]


def test_lookahead_predictor_stays_bounded_under_a_shared_prefix() -> None:
    """A page every session starts with (a system prompt) kept one successor per
    session ever seen and every lookup walked them all (20x slower after 6,000
    sessions). Its successors are now capped, and a dominant one still wins."""
    p = LookaheadPredictor(max_successors=8)
    for session in range(10_000):
        p.observe([k(0), k(1), k(10 + session % 2), k(100_000 + session)])
    assert all(len(succ) <= 8 for succ in p._next.values())
    assert p.predict([k(0)])[0] == k(1)  # 1 always follows 0
    p.observe([k(0), k(1), k(7)])
    assert len(p._next[k(1)]) <= 8 and p._next[k(1)][k(7)] == 1


def test_admission_policies_selectable_in_config() -> None:
    from kvtier.config import make_admission

    assert isinstance(make_admission("reuse"), ReusePredictor)
    adm = make_admission("frequency", threshold=3)
    assert isinstance(adm, FrequencyAdmission) and adm.threshold == 3
