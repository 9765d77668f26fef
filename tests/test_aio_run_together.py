"""``kvtier.aio.run_together``: concurrent calls whose failure or cancellation returns
only once every call has ended (they may be writing into the caller's buffers)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.aio import run_together


class Calls:
    """Calls that record when they start and end."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.ended: list[str] = []

    async def sleep(self, name: str, seconds: float, result: int = 0) -> int:
        self.running.add(name)
        try:
            await asyncio.sleep(seconds)
            return result
        finally:
            self.running.discard(name)
            self.ended.append(name)

    async def stubborn(self, name: str, seconds: float) -> int:
        """Finishes its work even when cancelled (as a thread's copy would)."""
        self.running.add(name)
        try:
            await asyncio.shield(asyncio.sleep(seconds))
        except asyncio.CancelledError:
            await asyncio.sleep(seconds)
            raise
        finally:
            self.running.discard(name)
            self.ended.append(name)
        return 0

    async def fail(self, name: str, seconds: float) -> int:
        await asyncio.sleep(seconds)
        self.ended.append(name)
        raise ValueError(f"{name} failed")


async def test_results_come_back_in_the_calls_order_and_the_calls_overlap() -> None:
    calls = Calls()
    got = await run_together([calls.sleep("slow", 0.2, 1), calls.sleep("quick", 0.01, 2)])
    assert got == [1, 2]
    assert calls.ended == ["quick", "slow"]  # in turn, the slow one would end first


async def test_a_failing_call_is_raised_as_it_is_once_the_others_have_ended() -> None:
    calls = Calls()
    with pytest.raises(ValueError, match="bad failed"):
        await run_together([calls.stubborn("stubborn", 0.1), calls.fail("bad", 0.01)])
    assert not calls.running  # the stubborn call was cancelled and waited for
    assert calls.ended == ["bad", "stubborn"]


async def test_a_cancelled_caller_raises_once_every_call_has_ended() -> None:
    calls = Calls()
    task = asyncio.ensure_future(
        run_together([calls.stubborn("stubborn", 0.1), calls.sleep("plain", 10)])
    )
    await asyncio.sleep(0.02)
    assert calls.running == {"stubborn", "plain"}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not calls.running
    assert sorted(calls.ended) == ["plain", "stubborn"]
