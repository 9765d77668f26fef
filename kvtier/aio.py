"""asyncio helpers shared by backends and the transfer layer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def finish_before_raising(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every one of ``tasks`` is done, even when the caller is cancelled
    meanwhile (it is, typically: this runs before a CancelledError is re-raised). Used
    where work still running reads or writes a caller's buffers: the caller must not get
    control of them back (by the exception) while a thread still copies them. The tasks'
    own exceptions are retrieved, not raised."""
    pending = [t for t in tasks if not t.done()]
    if not pending:
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: the caller raises its own
        return
    done = asyncio.gather(*pending, return_exceptions=True)
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            continue  # cancelled again: the caller raises CancelledError anyway, after this


async def finish_even_if_cancelled(call: Awaitable[T]) -> T:
    """Await ``call`` (a coroutine, run as a task of its own, or a future); when the caller
    is cancelled meanwhile, let it run to its end (uncancelled) and only then raise
    CancelledError. For work whose threads may use the caller's buffers and which does
    not wait for them when cancelled (a thread's future; a backend's ``get`` without
    ``get_finishes_before_raising``)."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await finish_before_raising([task])
        raise


async def gather_to_the_end(futures: Sequence[asyncio.Future[T]]) -> list[T]:
    """Await every one of ``futures`` (work running on threads) and return their results
    in order. When one fails, or the caller is cancelled, raise only once every one is
    done. The futures are never cancelled: a thread cannot be stopped, and the asyncio
    wrapper of a running thread's future reports "cancelled" at once while the thread
    still runs (a plain ``gather`` cancelled by its caller does exactly that)."""
    together = asyncio.gather(*futures)
    try:
        return await asyncio.shield(together)
    except BaseException:
        await finish_before_raising(futures)
        raise


async def run_together(calls: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``calls`` concurrently, each as a task, and return their results in order.
    When one raises, or the caller is cancelled, the others are cancelled and every one
    is waited for to its end; only then is the first exception (or the CancelledError)
    raised, as it is (no ExceptionGroup). Each call decides what its cancellation waits
    for (a backend's ``get`` its threads, say)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()  # a done task ignores it
        await finish_before_raising(tasks)
        raise
