"""The planner's decisions on hand-built states: room and victims by the watermarks, where
a victim goes, what each write policy copies down, where a fetch reads from, and the
policy hooks of every reference."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.plan import Planner, PlanTier, Spare, TierLimits
from kvtier.policy.admission import FrequencyAdmission
from kvtier.policy.base import AdmitAll
from kvtier.policy.eviction import LRUPolicy
from kvtier.policy.write import WritePolicy
from kvtier.sim.engine import SimView


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def _planner(
    caps: list[int], write_policy: str = "write-back", wm: tuple[float, float] = (1.0, 1.0)
) -> tuple[Planner, SimView]:
    names = ["dram", "disk", "remote"][: len(caps)]
    view = SimView(names, [set() for _ in caps])
    tiers = [
        PlanTier(n, TierLimits.of(c, *wm), LRUPolicy()) for n, c in zip(names, caps, strict=True)
    ]
    return Planner(tiers, view, write_policy, AdmitAll(), batch_pages=4), view


def _fill(planner: Planner, view: SimView, tier: int, keys: list[int]) -> None:
    for i in keys:
        view.resident[tier].add(k(i))
        planner.landed(tier, k(i), None)


def test_limits_from_watermarks() -> None:
    assert TierLimits.of(10, 0.8, 0.7) == TierLimits(10, 8, 7)
    assert TierLimits.of(3, 0.1, 0.1) == TierLimits(3, 1, 0)  # at least one page
    with pytest.raises(KVTierUsageError, match="high_watermark"):
        TierLimits.of(10, 1.5, 0.5)
    with pytest.raises(KVTierUsageError, match="capacity"):
        TierLimits.of(-1)


def test_room_evicts_down_to_the_low_watermark_when_crossing_the_high_one() -> None:
    planner, view = _planner([10, 100], wm=(0.8, 0.5))
    _fill(planner, view, 0, list(range(7)))
    assert planner.fits(0, 1)  # 8 <= high 8
    assert not planner.fits(0, 2)
    assert not planner.fits(0, 1, pending=1)  # a claim not yet reserved counts
    # 7 + 2 = 9 > 8: evict down to low 5 -> 4 victims, least recently used first
    assert planner.room_victims(0, 2) == [k(0), k(1), k(2), k(3)]
    assert planner.room_victims(0, 2, spare=Spare({k(0)}, {k(2)})) == [k(1), k(3), k(4), k(5)]
    view.pinned = {k(1)}
    assert k(1) not in planner.room_victims(0, 2)


def test_a_batch_larger_than_the_watermark_needs_only_its_own_size() -> None:
    planner, _ = _planner([10, 100], wm=(0.5, 0.3))
    assert planner.batch_size(0) == 4  # batch_pages 4, under the 5-page watermark
    assert planner.fits(0, 7)  # an empty tier takes one batch of 7 > high 5
    assert planner.batches(0, [k(i) for i in range(9)]) == [
        [k(0), k(1), k(2), k(3)],
        [k(4), k(5), k(6), k(7)],
        [k(8)],
    ]


def test_trim_brings_a_tier_above_its_high_watermark_to_its_low_one() -> None:
    planner, view = _planner([10, 100], wm=(0.6, 0.4))
    _fill(planner, view, 0, list(range(6)))
    assert planner.trim_victims(0) == []
    _fill(planner, view, 0, [6, 7])
    assert planner.trim_victims(0, spare={k(0)}) == [k(1), k(2), k(3), k(4)]


def test_evict_plan_frees_what_is_below_sends_down_or_drops() -> None:
    planner, view = _planner([4, 4])
    _fill(planner, view, 0, [1, 2])
    _fill(planner, view, 1, [2, 9])
    plan = planner.evict_plan(0, [k(1), k(2)])
    assert (plan.down, plan.drop, plan.free) == ([k(1)], [], [k(2)])
    last = planner.evict_plan(1, [k(9)])
    assert (last.down, last.drop, last.free) == ([], [k(9)], [])


def test_selective_drops_what_the_admission_policy_refuses() -> None:
    names = ["dram", "disk"]
    view = SimView(names, [set(), set()])
    adm = FrequencyAdmission(threshold=2)
    planner = Planner(
        [PlanTier(n, TierLimits.of(4), LRUPolicy()) for n in names], view, "selective", adm
    )
    planner.note_store(k(1), None)
    planner.note_store(k(1), None)
    planner.note_store(k(2), None)
    assert planner.write_through(0, [k(1), k(2)]) == [k(1)]
    plan = planner.evict_plan(0, [k(1), k(2)])
    assert (plan.down, plan.drop) == ([k(1)], [k(2)])


@pytest.mark.parametrize(
    ("policy", "copies"),
    [("write-through", [1, 2]), ("write-back", []), ("selective", [1, 2])],
)
def test_write_through_per_write_policy(policy: str, copies: list[int]) -> None:
    planner, view = _planner([4, 4, 4], policy)
    assert planner.write_policy is WritePolicy(policy)
    _fill(planner, view, 1, [3])
    assert planner.write_through(0, [k(1), k(2), k(3)]) == [k(i) for i in copies]
    assert planner.write_through(2, [k(1)]) == []  # nothing below the last tier
    assert planner.dirty(0, [k(1), k(3)]) == [k(1)]


def test_source_is_the_highest_tier_below_the_top_that_did_not_fail() -> None:
    planner, view = _planner([4, 4, 4])
    _fill(planner, view, 1, [1])
    _fill(planner, view, 2, [1, 2])
    assert planner.source(k(1)) == 1
    assert planner.source(k(1), exclude={"disk"}) == 2
    assert planner.source(k(3)) is None
    assert planner.holder(k(2)) == 2


def test_a_lookup_counts_once_and_touches_the_tier_that_hits() -> None:
    planner, view = _planner([3, 8])
    _fill(planner, view, 0, [1, 2, 3])
    assert planner.note_lookup(k(1)) == 0  # 1 becomes most recently used
    assert planner.room_victims(0, 1) == [k(2)]
    assert planner.note_lookup(k(7)) is None


def test_bad_planners_are_refused() -> None:
    view = SimView(["a"], [set()])
    tier = PlanTier("a", TierLimits.of(4), LRUPolicy())
    with pytest.raises(KVTierUsageError, match="at least one tier"):
        Planner([], view, "write-back", AdmitAll())
    with pytest.raises(KVTierUsageError, match="distinct"):
        Planner([tier, tier], view, "write-back", AdmitAll())
    with pytest.raises(ConfigError, match="write policy: must be one of"):
        Planner([tier], view, "lazy", AdmitAll())
