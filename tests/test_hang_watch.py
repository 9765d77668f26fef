"""The hang watch (tests/hang_watch.py) names the coroutine a waiting task is stuck in."""

from __future__ import annotations

import asyncio
import io
import tempfile

from hang_watch import report


async def test_the_report_follows_each_task_down_to_what_it_awaits() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def stuck_deep_inside() -> None:
        await never

    async def outer() -> None:
        await stuck_deep_inside()

    task = asyncio.create_task(outer(), name="the-stuck-one")
    await asyncio.sleep(0)
    with tempfile.TemporaryFile("w+") as threads:  # faulthandler writes to a real file
        out = io.StringIO()
        report("tests/x.py::test_y", out, threads)
        threads.seek(0)
        stacks = threads.read()
    text = out.getvalue()
    assert "tests/x.py::test_y still running" in text
    chain = text.split("--- task the-stuck-one", 1)[1].split("--- task", 1)[0]
    assert chain.index(" outer") < chain.index(" stuck_deep_inside")
    assert "waits on <Future pending" in chain
    assert "test_the_report_follows_each_task_down_to_what_it_awaits" in stacks
    task.cancel()
