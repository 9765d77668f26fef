"""A pytest plugin that says where a hung test waits.

A test still running after ``KVTIER_TEST_HANG_S`` seconds (default 600; 0 turns the
watch off) gets one report on stderr: every thread's stack and, for every unfinished
asyncio task, the chain of coroutines it awaits down to the future it waits on. The test
is not stopped: the report is what CI's log shows when a test waits forever (an event
loop idle in ``select`` tells nothing by itself).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

HANG_S = float(os.environ.get("KVTIER_TEST_HANG_S", "600"))


def await_chain(task: asyncio.Task[Any]) -> Iterator[str]:
    """``file:line function`` for each coroutine ``task`` awaits, outermost first."""
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)


def report(nodeid: str, out: Any, threads: Any = None) -> None:
    """Write every pending task's await chain to ``out``, and the threads' stacks to
    ``threads`` (a real file: faulthandler writes to its descriptor; default ``out``)."""
    print(f"\n=== {nodeid} still running after {HANG_S:g} s ===", file=out, flush=True)
    faulthandler.dump_traceback(file=threads or out, all_threads=True)
    # type(), not isinstance(): isinstance reads __class__, which some lazy module
    # attributes (torch.distributed.reduce_op) answer with a warning
    tasks = [o for o in gc.get_objects() if issubclass(type(o), asyncio.Task) and not o.done()]
    for task in tasks:
        print(f"--- task {task.get_name()}", file=out)
        for line in await_chain(task):
            print(f"    {line}", file=out)
        print(f"    waits on {task._fut_waiter!r}"[:400], file=out, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if HANG_S <= 0:
        yield
        return
    capture = item.config.pluginmanager.getplugin("capturemanager")

    def uncaptured() -> None:  # pytest would hold captured output until the test ends
        if capture is None:
            report(item.nodeid, sys.stderr)
            return
        with capture.global_and_fixture_disabled():
            report(item.nodeid, sys.stderr)

    timer = threading.Timer(HANG_S, uncaptured)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
