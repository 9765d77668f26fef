"""``RateTable`` (the vectorised rate forecasts behind ``interval`` and ``hinted``) against
the scalar formula and a plain sort, and LRU-K's ``order_of`` against its own walk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.policy.rate_table as rate_table_module
from kvtier.keys import PageKey
from kvtier.policy.eviction import LRUKPolicy
from kvtier.policy.rate_table import RateTable


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "big"))


def scalar_score(
    first: float, last: float, count: float, now: float, lateness: float = 0.0
) -> float:
    """The rate forecast's distance from now, as ``HintedPolicy._rate_forecast`` and
    ``_score`` compute it one page at a time."""
    at = last + (last - first) / (count - 1.0)
    if at < now:
        at = now + (now - first) / (count - 1.0) + lateness * (now - at)
    return at - now


# Few distinct times, so that many pages tie and the key decides.
times = st.sampled_from([0.0, 0.1, 0.3, 1.0, 2.5, 7.0, 1e6 + 0.1])
entries = st.lists(
    st.tuples(st.integers(0, 300), times, times, st.integers(2, 5), st.booleans()),
    max_size=400,
)


@settings(max_examples=200, deadline=None)
@given(entries, times, st.sampled_from([0.0, 0.25, 1.0, 3.0]))
def test_ranked_is_the_scalar_ranking_entry_for_entry(
    ops: list[tuple[int, float, float, int, bool]], now: float, lateness: float
) -> None:
    table = RateTable(lateness)
    want: dict[PageKey, tuple[float, float, float]] = {}
    for i, a, b, count, drop in ops:
        first, last = min(a, b), max(a, b)
        if drop:
            table.discard(k(i))
            want.pop(k(i), None)
        else:
            table.set(k(i), first, last, float(count))
            want[k(i)] = (first, last, float(count))
    expected = sorted(
        ((scalar_score(*v, now, lateness), key) for key, v in want.items()), reverse=True
    )
    assert list(table.ranked(now)) == expected
    assert len(table) == len(want)
    if lateness == 0:  # the lateness term adds exactly nothing: the floats of before it
        plain = []
        for key, (first, last, count) in want.items():
            at = last + (last - first) / (count - 1.0)
            plain.append(((at if at >= now else now + (now - first) / (count - 1.0)) - now, key))
        assert expected == sorted(plain, reverse=True)


def test_ranked_reads_lazily_and_crosses_chunks_through_ties() -> None:
    # 3 x FIRST_CHUNK pages in 5 tied groups: the chunk cuts fall inside groups.
    table = RateTable()
    n = 3 * rate_table_module.FIRST_CHUNK
    for i in range(n):
        table.set(k(i), 0.0, float(i % 5), 2.0)
    ranked = table.ranked(1.0)
    head = [next(ranked) for _ in range(3)]
    # The furthest group: last reference 4, forecast 8 (7 from now), highest keys first.
    top = [i for i in range(n) if i % 5 == 4][::-1]
    assert head == [(7.0, k(i)) for i in top[:3]]
    rest = list(ranked)
    assert head + rest == sorted(
        ((scalar_score(0.0, i % 5, 2.0, 1.0), k(i)) for i in range(n)), reverse=True
    )


def test_an_empty_table_ranks_nothing() -> None:
    table = RateTable()
    assert list(table.ranked(1.0)) == []
    table.set(k(1), 0.0, 1.0, 2.0)
    table.discard(k(1))
    table.discard(k(2))  # absent: no-op
    assert list(table.ranked(1.0)) == [] and k(1) not in table


lru_ops = st.lists(
    st.tuples(st.sampled_from(["ref", "remove"]), st.integers(0, 20)), min_size=1, max_size=150
)


@settings(max_examples=200, deadline=None)
@given(lru_ops, st.sets(st.integers(0, 25)), st.integers(1, 3))
def test_lru_k_order_of_sorts_keys_as_its_walk_finds_them(
    ops: list[tuple[str, int]], wanted: set[int], kk: int
) -> None:
    p = LRUKPolicy(k=kk, history=1.0)
    for kind, i in ops:
        if kind == "ref":
            p.on_insert(k(i))
        else:
            p.on_remove(k(i))
    keys = {k(i) for i in wanted}
    assert p.order_of(keys) == [key for key in p.ordered_keys() if key in keys]
