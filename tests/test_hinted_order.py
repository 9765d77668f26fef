"""``hinted``'s order as kept up to date (the pages without a forecast followed event by
event and through the clock, the forecast ranking reused on a large tier) against the
same order found by brute force from its definition, after every step of random traffic
with random hints."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.policy.hinted as hinted_module
from kvtier.keys import PageKey
from kvtier.policy.hinted import HintedPolicy
from kvtier.policy.hints import Hint


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def brute_force_order(p: HintedPolicy, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
    """The order of :mod:`kvtier.policy.hinted`'s docstring, computed from its
    definitions (``forecast``, the dead and expired pages, the pins and weights, the
    fallback's whole order) with nothing kept between calls."""
    held = [key for key in p.fallback.ordered_keys() if key in p._resident]  # type: ignore[attr-defined]
    assert set(held) == p._resident
    pinned = p._pinned
    if sum(1 for key in pinned if key in p._resident) > p.pin_share * p.c:
        pinned = set()
    out: list[PageKey] = []

    def take(key: PageKey) -> None:
        if key not in out and key in p._resident and evictable(key):
            out.append(key)

    now = p.now
    for key in [*p._dead, *(key for key, exp in p._expiry.items() if exp <= now)]:
        if key not in pinned:
            take(key)
    plain = [key for key in held if key not in pinned and p.forecast(key) is None]
    for heavy in (False, True):
        for key in plain:
            if (p._weight.get(key, 1.0) > 1.0) == heavy:
                take(key)
    scored = []
    for key in held:
        at = p.forecast(key)
        if at is not None and key not in pinned:
            scored.append(((at - now) / p._weight.get(key, 1.0), key))
    for _, key in sorted(scored, reverse=True):
        take(key)
    for key in held:
        take(key)
    return out


PAGES = 8
steps = st.lists(
    st.one_of(
        st.tuples(st.just("ref"), st.integers(0, PAGES - 1)),
        st.tuples(st.just("remove"), st.integers(0, PAGES - 1)),
        st.tuples(st.just("time"), st.sampled_from([0.0005, 0.5, 2.0, 7.0, 40.0])),
        st.tuples(
            st.sampled_from(["next_turn", "open", "close", "ttl", "priority", "pin", "unpin"]),
            st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=4),
            st.sampled_from([0.5, 1.0, 3.0, 10.0]),
        ),
    ),
    min_size=5,
    max_size=60,
)


def _run(ops: list[tuple[object, ...]], odd: Callable[[PageKey], bool]) -> None:
    p = HintedPolicy(fallback="lru-k", history=1.0, rate_history=2.0)
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "ref":
            p.on_insert(k(int(op[1])))  # type: ignore[call-overload]
        elif kind == "remove":
            p.on_remove(k(int(op[1])))  # type: ignore[call-overload]
        elif kind == "time":
            now += float(op[1])  # type: ignore[arg-type]
            p.on_time(now)
        else:
            keys = tuple(k(int(i)) for i in op[1])  # type: ignore[attr-defined]
            value = None if kind in ("close", "pin", "unpin", "open") else float(op[2])  # type: ignore[arg-type]
            p.on_hint(Hint(str(kind), keys, value), now)  # type: ignore[arg-type]
        for evictable in (lambda _key: True, odd):
            assert p.victims(len(p), evictable) == brute_force_order(p, evictable)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_hinted_order_matches_its_definition(ops: list[tuple[object, ...]]) -> None:
    _run(ops, lambda key: key[0] % 3 != 0)


unhinted_steps = st.lists(
    st.one_of(  # references twice as likely as the rest: most pages get a rate
        st.tuples(st.just("ref"), st.integers(0, 3 * PAGES - 1)),
        st.tuples(st.just("ref"), st.integers(0, 3 * PAGES - 1)),
        st.tuples(st.just("remove"), st.integers(0, 3 * PAGES - 1)),
        st.tuples(st.just("time"), st.sampled_from([0.0005, 0.5, 2.0, 7.0, 40.0])),
    ),
    min_size=20,
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(unhinted_steps)
def test_unhinted_order_matches_its_definition(ops: list[tuple[object, ...]]) -> None:
    # Without hints (``interval``) the ranking comes from the vectorised rate table, and
    # plain pages, when few, are sorted into LRU-K's order instead of sought along it.
    _run(ops, lambda key: key[0] % 3 != 0)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_hinted_reused_ranking_matches_between_rebuilds(ops: list[tuple[object, ...]]) -> None:
    # Past EXACT_RANKING_PAGES the ranking is reused between walks (here: never rebuilt
    # once built); every change but the clock's drift is merged in, so with a stopped
    # clock it is still exact.
    _run_reused([op for op in ops if op[0] != "time"])


@settings(max_examples=100, deadline=None)
@given(unhinted_steps)
def test_unhinted_ranking_kept_as_a_list_matches(ops: list[tuple[object, ...]]) -> None:
    # A large tier keeps the rate table's ranking as a list (here: rebuilt for every walk,
    # so the clock may run and rates form).
    _run_reused(ops, share=-1.0)


def _run_reused(ops: list[tuple[object, ...]], share: float = 1e9) -> None:
    saved = hinted_module.EXACT_RANKING_PAGES, hinted_module.RANKING_REUSE_SHARE
    hinted_module.EXACT_RANKING_PAGES, hinted_module.RANKING_REUSE_SHARE = 0, share
    try:
        _run(ops, lambda key: key[0] % 3 != 0)
    finally:
        hinted_module.EXACT_RANKING_PAGES, hinted_module.RANKING_REUSE_SHARE = saved


def test_a_page_falls_overdue_on_its_remaining_prediction() -> None:
    p = HintedPolicy(fallback="lru")
    every: Callable[[PageKey], bool] = lambda _key: True  # noqa: E731
    p.on_time(0.0)
    p.on_insert(k(1))
    p.on_insert(k(2))
    p.on_hint(Hint("next_turn", (k(1),), 10.0), 0.0)  # wanted at 10, overdue after 21
    p.on_hint(Hint("next_turn", (k(1),), 5.0), 8.0)  # wanted at 13, overdue after 19
    p.on_time(10.0)
    p.on_access(k(1))  # the use at 10 happened; the one at 13 is still pending
    p.on_hint(Hint("next_turn", (k(2),), 100.0), 10.0)
    p.on_time(20.0)  # 1's remaining prediction is overdue: no forecast, it goes first
    assert p.victims(2, every) == brute_force_order(p, every) == [k(1), k(2)]
