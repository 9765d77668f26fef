"""``interval``: the furthest forecast next use first, by the mean interval of each page's
uses; ``adaptive`` runs it as an expert and gives it the clock."""

from __future__ import annotations

import pytest

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import Hint
from kvtier.policy.interval import IntervalPolicy


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def every(_key: PageKey) -> bool:
    return True


def _uses(policy: IntervalPolicy | object, times: dict[int, list[float]]) -> None:
    """Reference each page at its times, in time order (inserting it the first time)."""
    events = sorted((t, i) for i, ts in times.items() for t in ts)
    for t, i in events:
        policy.on_time(t)  # type: ignore[attr-defined]
        policy.on_insert(k(i))  # type: ignore[attr-defined]


def test_interval_ranks_by_forecast_next_use_not_by_second_last_use() -> None:
    # Page 1: used every 10 s (0, 10, 20, 30): next use expected at 40.
    # Page 2: used at 21 and 30.9: its second most recent use (21) is later than page
    # 1's (20), so LRU-2 evicts page 1 first; its next use is expected at 40.8, so
    # interval evicts page 2 first. Page 3, used once, goes before both.
    times = {1: [0.0, 10.0, 20.0, 30.0], 2: [21.0, 30.9], 3: [30.95]}
    interval = IntervalPolicy(fallback="lru")
    _uses(interval, times)
    interval.on_time(31.0)
    assert interval.victims(3, every) == [k(3), k(2), k(1)]
    lru2 = make_policy("lru-k")
    for _, i in sorted((t, i) for i, ts in times.items() for t in ts):
        lru2.on_insert(k(i))
    assert lru2.victims(3, every) == [k(3), k(1), k(2)]


def test_interval_ignores_hints_but_keeps_their_clock() -> None:
    p = IntervalPolicy(fallback="lru")
    _uses(p, {1: [0.0, 1.0], 2: [0.5]})
    p.on_hint(Hint("close", (k(1),)), 50.0)  # not its input: page 1 is not dead
    p.on_hint(Hint("pin", (k(2),)), 50.0)  # nor is page 2 pinned
    assert p.now == 50.0
    assert p.victims(2, every) == [k(2), k(1)]


@pytest.mark.parametrize("lateness", [0.0, 1.0])
def test_lateness_makes_a_page_whose_traffic_stopped_go_before_a_slow_steady_one(
    lateness: float,
) -> None:
    # Page 1: used every second from 0 to 9, then never again: at 100 s it is 90 s past
    # its forecast (10 s). Page 2: used at 60 and 90 s, next expected at 120 s (20 s off).
    # The wait alone stretches page 1's mean interval to 100 / 9 = 11.1 s, so it still
    # looks sooner than page 2 and page 2 goes first; with lateness 1 the 90 s it is late
    # count too (101.1 s) and page 1 goes first.
    p = IntervalPolicy(fallback="lru", lateness=lateness)
    _uses(p, {1: [float(t) for t in range(10)], 2: [60.0, 90.0]})
    p.on_time(100.0)
    assert p.victims(2, every) == ([k(1), k(2)] if lateness else [k(2), k(1)])
    assert p.forecast(k(1)) == pytest.approx(100.0 + 100.0 / 9 + lateness * 90.0)


def test_interval_rejects_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="rate_history"):
        make_policy("interval", rate_history=-2)
    for bad in (-0.5, float("inf"), float("nan"), "1"):
        with pytest.raises(ConfigError, match="lateness"):
            make_policy("interval", lateness=bad)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        make_policy("interval", fallback="nope")


def test_adaptive_gives_its_clock_to_the_interval_expert_and_its_miniature() -> None:
    pol = AdaptivePolicy()
    at = pol.names.index("interval")
    expert, mini = pol.experts[at], pol.minis[at].policy
    pol.on_time(12.5)
    assert isinstance(expert, IntervalPolicy) and expert.now == 12.5
    inner = getattr(mini, "inner", None)
    assert isinstance(inner, IntervalPolicy) and inner.now == 12.5
