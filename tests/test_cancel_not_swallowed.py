"""A cancelled call raises ``CancelledError``, even when what it awaited finished at the
same moment.

Python 3.11's ``asyncio.wait_for`` returns its awaitable's result when that finishes just
as the caller is cancelled: the cancellation is lost. kvtier awaited it in the tier's
room-making wait (``Tier.wait_change``), and redis-py awaits it on every write, which ran
in the caller's task for a remote call of one batch. A docs-only probe (a disk tier on a
full tmpfs over a Redis tier) saw 11-19 of about 100 cancelled ``load()`` calls return a
``LoadResult`` instead, with the pages pinned for a caller that would never release them
(``asyncio.wait_for`` or a task group drops the result).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import numpy as np
import pytest
import redis.asyncio.client
from cache_kit import config, open_cache
from kvtier.backends.remote import RedisStore

from kvtier.keys import Namespace, page_keys
from kvtier.testing.servers import RedisServer, unavailable_reason


async def test_wait_change_raises_a_cancellation_that_comes_with_the_notification(
    tmp_path: Any,
) -> None:
    async with open_cache(config(tmp_path)) as cache:
        tier = cache.tiers[0]
        for _ in range(20):
            waiter = asyncio.create_task(tier.wait_change(30.0))
            await asyncio.sleep(0)  # waiting now
            tier.notify()  # the change and the cancellation in one loop turn
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        waiter = asyncio.create_task(tier.wait_change(30.0))
        await asyncio.sleep(0)
        tier.notify()
        await asyncio.wait_for(waiter, 5)  # a notification alone ends the wait
        await asyncio.wait_for(tier.wait_change(0.01), 5)  # and so does the timeout


@pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)
async def test_a_remote_call_of_one_batch_raises_its_callers_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pipeline's ``execute`` behaves as redis-py's write under Python 3.11's
    ``wait_for`` does when the write ends as the caller is cancelled: it returns."""
    sent = asyncio.Event()

    async def swallowing_execute(pipe: Any, raise_on_error: bool = True) -> list[int]:
        sent.set()
        with contextlib.suppress(asyncio.CancelledError):  # the write ended as it came
            await asyncio.sleep(30)
        return [1] * len(pipe.command_stack)

    keys = page_keys(np.arange(4 * 16), Namespace("cancel-test", page_tokens=16))
    with RedisServer("valkey") as server:
        store = RedisStore(
            page_bytes=4096,
            capacity_pages=8,
            url=server.url,
            key_prefix=f"t-{uuid.uuid4().hex[:8]}",
            op_timeout_s=5.0,
        )
        await store.open()
        try:
            with monkeypatch.context() as m:
                m.setattr(redis.asyncio.client.Pipeline, "execute", swallowing_execute)
                call = asyncio.create_task(store.contains(keys[:1]))
                await asyncio.wait_for(sent.wait(), 5)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(call, 10)
            assert await store.contains(keys) == [False] * 4  # the store works on
        finally:
            await store.close()
