"""A private asyncio event loop on a daemon thread, for engines that are not asyncio.

vLLM's workers and scheduler call the connector from plain threads; kvtier's
:class:`~kvtier.cache.KVCache` belongs to one event loop. :class:`LoopThread` runs that
loop and carries coroutines to it: :meth:`submit` returns a
:class:`concurrent.futures.Future`, :meth:`run` waits for the result. Calling :meth:`run`
from the loop's own thread raises instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvtier.errors import KVTierUsageError

T = TypeVar("T")


def close_at_exit(owner: Any, method: str = "shutdown") -> None:
    """Call ``owner.<method>()`` at interpreter exit (unless ``owner`` is gone by then),
    before :mod:`concurrent.futures` stops taking work: its exit hook runs in threading's
    shutdown, and closing a cache needs executors (a single-process vLLM engine that is
    never shut down explicitly ended with "cannot schedule new futures after interpreter
    shutdown" from every backend). threading runs its exit hooks in reverse order of
    registration, and concurrent.futures registers its own when it is imported, so a hook
    registered here runs first. Falls back to :mod:`atexit` where threading has no such
    hook."""
    ref = weakref.ref(owner)

    def close() -> None:
        target = ref()
        if target is not None:
            getattr(target, method)()

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        atexit.register(close)
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down already
        register(close)


class LoopThread:
    """An event loop running on its own daemon thread until :meth:`stop`."""

    def __init__(self, name: str = "kvtier-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future of its result."""
        if not self.alive:
            coro.close()
            raise KVTierUsageError("kvtier's event loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds:
        then :class:`TimeoutError`, and the coroutine is cancelled)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise KVTierUsageError("LoopThread.run called from its own loop thread")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"kvtier call did not finish within {timeout} s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (pending callbacks are dropped) and join the thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
