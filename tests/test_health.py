"""Health bookkeeping shared by tiers and stores: a cause logged once, one outage at a time."""

from __future__ import annotations

from kvtier.health import LogOnce, Outage


def test_log_once_answers_true_only_for_a_new_cause() -> None:
    seen = LogOnce()
    assert seen.first("ENOSPC") and not seen.first("ENOSPC") and seen.first("EIO")
    assert "EIO" in seen and "EPERM" not in seen


def test_an_outage_opens_on_the_first_failure_and_closes_on_the_first_success() -> None:
    out = Outage()
    assert out.healthy and out.succeeded() is None
    assert out.failed(3) and not out.failed(2)  # only the first one opens it
    assert not out.healthy and out.outages == 1
    ended = out.succeeded()
    assert ended is not None and ended[1] == 5 and ended[0] >= 0
    assert out.healthy and out.succeeded() is None
    assert out.failed() and out.outages == 2
