"""Health bookkeeping shared by tiers and stores: a cause logged once, one outage at a time."""

from __future__ import annotations

from kvtier.health import LogEvery, LogOnce, Outage


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


def test_log_every_holds_back_repeats_within_the_interval(monkeypatch) -> None:
    """A condition that repeats on every call (a write-through blocked on each store: 45
    warnings in one short probe run) logs once per interval, with the count held back."""
    import kvtier.health as health

    now = [100.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    every = LogEvery(60.0)
    assert every.due("nvme") == 0  # the first line
    assert [every.due("nvme") for _ in range(5)] == [None] * 5
    assert every.due("dram") == 0  # causes are apart
    now[0] += 60.0
    assert every.due("nvme") == 5  # the next line says how many were held back
    assert every.due("nvme") is None
