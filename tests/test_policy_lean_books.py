"""The miniatures' lean bookkeeping gives the orders the full bookkeeping gives.

``adaptive``'s miniatures keep less than the tier does: a point's book keeps only the
structures its own order reads, the LRU point (no head start) is a plain LRU list, and
all miniatures share one window of recent (unevictable) references. Each is checked here
against the full version on random reference streams: the same order, page for page.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.keys import PageKey
from kvtier.policy.adaptive import point_policy
from kvtier.policy.eviction import LRUPolicy
from kvtier.policy.prefix_cut import PrefixCutPolicy
from kvtier.policy.shadow import MiniCache, RecentPins
from kvtier.policy.twoclass import ORDERS, TwoClassBook, TwoClassPolicy

POINTS = [
    (0.0, "last"),
    (0.0, "freq"),
    (1.0, "freq"),
    (16.0, "last"),
    (2.0, "kth"),
    (math.inf, "kth"),
]


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


#: A reference stream: page numbers, a negative one removes page ``-n - 1`` if held.
streams = st.lists(st.integers(min_value=-24, max_value=23), min_size=1, max_size=160)


def _drive(book: TwoClassBook, ops: list[int]) -> None:
    for op in ops:
        key = k(op if op >= 0 else -op - 1)
        if op < 0:
            if key in book.resident:
                book.remove(key)
        elif key in book.resident:
            book.access(key)
        else:
            book.insert(key)


@settings(max_examples=60, deadline=None)
@given(ops=streams)
def test_a_one_order_book_orders_as_the_full_book(ops: list[int]) -> None:
    for bonus, order in POINTS:
        full = TwoClassBook(2.0, 8)
        lean = TwoClassBook(2.0, 8, (order,))
        _drive(full, ops)
        _drive(lean, ops)
        for probation in (0.0, 0.25):
            assert list(lean.ordered(bonus, order, probation)) == list(
                full.ordered(bonus, order, probation)
            ), (bonus, order, probation)


def test_a_one_order_book_refuses_another_order() -> None:
    book = TwoClassBook(8.0, None, ("kth",))
    book.insert(k(1))
    with pytest.raises(ValueError, match="'last'"):
        list(book.ordered(0.0, "last"))
    assert set(TwoClassBook().orders) == set(ORDERS)


@settings(max_examples=60, deadline=None)
@given(ops=streams)
def test_the_lru_point_is_plain_lru(ops: list[int]) -> None:
    for order in ("last", "freq"):
        point = TwoClassPolicy(0.0, order, 2.0, 8)
        lean = point_policy(0.0, order, 2.0)
        assert isinstance(lean, LRUPolicy)
        for op in ops:
            key = k(op if op >= 0 else -op - 1)
            for pol in (point, lean):
                if op < 0:
                    pol.on_remove(key)
                else:
                    pol.on_insert(key)
        assert list(lean.ordered_keys()) == list(point.ordered_keys() or ())
    assert isinstance(point_policy(0.0, "kth", 8.0), TwoClassPolicy)
    assert isinstance(point_policy(1.0, "last", 8.0), TwoClassPolicy)


#: Requests walking prefix chains: (chain, how many of its 4 pages), pages in order.
requests = st.lists(
    st.tuples(st.integers(min_value=0, max_value=15), st.integers(min_value=1, max_value=4)),
    min_size=1,
    max_size=120,
)


@settings(max_examples=40, deadline=None)
@given(reqs=requests)
def test_shared_recent_pins_change_nothing(reqs: list[tuple[int, int]]) -> None:
    """Miniatures sharing one window of recent references (one of them added half-way,
    as the ``hinted`` expert's is) hold and hit exactly what each holds and hits with a
    window of its own. (Pins matter here: a chain's root chosen as a victim pulls its
    descendants, the pages just referenced, forward unless they are pinned.)"""
    refs = [4 * chain + i for chain, n in reqs for i in range(n)]
    points = [(0.0, "last"), (math.inf, "kth"), (16.0, "last")]
    half = len(refs) // 2

    def mini(point: tuple[float, str], pins: RecentPins | None) -> MiniCache:
        return MiniCache(PrefixCutPolicy(TwoClassPolicy(*point, 8.0)), 12.0, pins=pins)

    own = [mini(p, None) for p in points]
    pins = RecentPins()
    shared = [mini(p, pins) for p in points]
    for i, r in enumerate(refs):
        if i == half:
            own.append(mini((1.0, "freq"), None))
            shared.append(mini((1.0, "freq"), pins))
        key = k(r)
        parent = k(r - 1) if r % 4 else None
        pins.push(key, shared[0].capacity)
        hits_own = [m.reference(key, parent, 0.99) for m in own]
        hits_shared = [m.reference(key, parent, 0.99) for m in shared]
        assert hits_own == hits_shared
        assert [m.resident for m in own] == [m.resident for m in shared]
