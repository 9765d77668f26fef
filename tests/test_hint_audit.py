"""The hint audit: which hints count as true or false, and that ``adaptive`` measures its
hints with it (exact hints all true, half of them wrong well below the trust level)."""

from __future__ import annotations

import pytest

from kvtier.keys import PageKey
from kvtier.policy.adaptive import TRUST_ACCURACY, AdaptivePolicy
from kvtier.policy.hint_audit import HintAudit
from kvtier.policy.hints import Hint
from kvtier.sim.hintnoise import corrupt_hints
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.workloads import workload


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


#: Every page counts as held by the audited tier.
ALL = range(0, 10**6)


class Held:
    """The keys ``k(i)`` for ``i`` in ``ids``."""

    def __init__(self, ids: range | set[int]) -> None:
        self.ids = ids

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and int.from_bytes(key, "little") in self.ids


def test_a_next_turn_is_true_when_the_page_comes_back_in_its_window() -> None:
    audit = HintAudit()
    audit.hint(Hint("next_turn", (k(1), k(2)), 10.0), 0.0, 100, Held(ALL))
    audit.referenced(k(1), 5.0)  # early: another session's use, not this forecast's
    assert audit.judged == 0
    audit.referenced(k(1), 10.5)  # in the window
    audit.referenced(k(2), 30.0)  # after the window (2 x gap + 1 = 21 s)
    assert audit.judged == 2
    assert audit.accuracy == pytest.approx(0.5, abs=1e-3)  # counts decay a little
    audit.referenced(k(1), 11.0)  # nothing pending any more
    assert audit.judged == 2


def test_nothing_is_judged_without_a_reference_the_tier_saw() -> None:
    audit = HintAudit()
    audit.hint(Hint("next_turn", (k(1), k(2), k(3)), 10.0), 0.0, 100, Held({1, 2}))
    audit.hint(Hint("next_turn", (k(1),), 10.0), 40.0, 100, Held(ALL))  # supersedes
    audit.forget(k(2))  # left the tier (an upper tier may serve it now)
    audit.referenced(k(2), 60.0)
    audit.referenced(k(3), 60.0)  # not held when hinted: never audited
    assert audit.judged == 0
    audit.referenced(k(1), 50.5)  # the newer hint's window
    assert (audit.judged, audit.accuracy) == (1, 1.0)


def test_a_close_is_judged_false_even_after_its_page_left_the_tier() -> None:
    """A session said closed comes back after its pages were evicted (at 1 % capacity
    the usual case): still a wrong close. Before, the page leaving dropped the judgement,
    so wrong closes were judged only on pages other sessions kept using."""
    audit = HintAudit()
    audit.hint(Hint("close", (k(1), k(2))), 0.0, 100, Held(ALL))
    audit.forget(k(1))  # evicted
    audit.referenced(k(1), 90.0)  # the session's next turn
    assert (audit.judged, audit.accuracy) == (1, 0.0)
    audit.hint(Hint("next_turn", (k(3),), 10.0), 0.0, 100, Held(ALL))
    audit.forget(k(3))  # a next_turn's page that left: a lower tier may never see it
    audit.referenced(k(3), 60.0)
    assert audit.judged == 1


def test_a_close_is_false_when_used_again_and_never_counted_true() -> None:
    audit = HintAudit(history=1.0)
    audit.hint(Hint("close", (k(1), k(2))), 0.0, 1, Held(ALL))
    audit.referenced(k(1), 1.0)
    assert (audit.judged, audit.accuracy) == (1, 0.0)
    # k(2) is forgotten, unused, once 64 (the floor of history x capacity) newer pages are
    # hinted: nothing is judged (a close cannot be proved true)
    audit.hint(Hint("close", tuple(k(i) for i in range(100, 170))), 2.0, 1, Held(ALL))
    assert audit.judged == 1
    audit.referenced(k(2), 3.0)  # forgotten: judges nothing either
    assert audit.judged == 1
    audit.referenced(k(169), 3.0)  # still pending: a close proved false
    assert audit.judged == 2


def test_wishes_are_not_judged() -> None:
    audit = HintAudit()
    for kind, value in (("pin", None), ("unpin", None), ("ttl", 5.0), ("priority", 2.0)):
        audit.hint(Hint(kind, (k(1),), value), 0.0, 100, Held(ALL))
    audit.referenced(k(1), 100.0)
    assert (audit.judged, audit.accuracy) == (0, 1.0)


def _accuracy(trace: object, cap: int) -> float:
    made: list[AdaptivePolicy] = []

    def policy() -> AdaptivePolicy:
        made.append(AdaptivePolicy())
        return made[-1]

    replay(trace, make_tiers([cap], policy), hints=True)  # type: ignore[arg-type]
    return float(made[0].describe()["hint_accuracy"])


def test_adaptive_finds_exact_hints_true_and_half_wrong_ones_untrusted() -> None:
    tr = workload("chat", n=600, seed=3)
    cap = max(1, tr.distinct_blocks() // 100)
    assert _accuracy(tr, cap) == 1.0
    assert _accuracy(corrupt_hints(tr, 0.5, seed=4), cap) < TRUST_ACCURACY
