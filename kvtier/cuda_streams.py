"""CUDA copy streams, events bridged to asyncio, per-slot stream ordering, pinned memory.

Host<->device copies run on dedicated non-blocking streams (never the default stream, so
they overlap with the engine's compute). Completion is awaited without blocking the event
loop and without spinning a core:

* :class:`EventPoller` runs one daemon thread that queries pending CUDA events
  (``cudaEventQuery``, via ``event.done``) with exponential backoff (20 us doubling to
  200 us) and sleeps on a condition variable when nothing is pending. A completed event
  resolves its asyncio future through ``loop.call_soon_threadsafe``.
  Why not ``cudaLaunchHostFunc``: its callback runs on a driver thread that must take the
  GIL, and while it waits for the GIL (up to the 5 ms switch interval when the loop thread
  is busy) the copy stream stalls. Polling never holds up a stream.
* :class:`SlotOrdering` makes stream ordering explicit: a copy that reads a slot first
  waits (``stream.wait_event``, on the device, not the host) for the event of the last
  write to that slot, and a copy that writes a slot waits for the last write and every
  read since. A page is never read on one stream before its copy on another has finished
  (the missing-sync bug that corrupted KV in other projects).

Everything CUDA-specific is imported lazily: this module imports (and its poller and
ordering logic are tested) on machines without CuPy. Only :class:`CopyStreams` and
:func:`pinned_host_array` need CuPy and a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import resource
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvtier.errors import BackendUnavailableError, KVTierError, KVTierUsageError

if TYPE_CHECKING:
    from kvtier.placement import HostPlacement


class EventLike(Protocol):
    """What the poller needs of an event (``cupy.cuda.Event`` has it)."""

    @property
    def done(self) -> bool: ...


@dataclass(eq=False)  # one wait each: removed by identity
class _Pending:
    event: EventLike
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


class EventPoller:
    """Resolves asyncio futures when CUDA events complete, from one polling thread.

    Thread-safe; one poller serves any number of loops. :meth:`close` stops the thread
    and fails pending waits with :class:`KVTierError`.
    """

    def __init__(self, min_sleep_s: float = 20e-6, max_sleep_s: float = 2e-4) -> None:
        if not 0 < min_sleep_s <= max_sleep_s:
            raise KVTierUsageError(
                f"poller sleeps must satisfy 0 < min <= max, got {min_sleep_s}, {max_sleep_s}"
            )
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Event queries made (for tests and stats: shows the backoff works).
        self.polls = 0

    def wait(self, event: EventLike) -> asyncio.Future[None]:
        """A future (of the running loop) that completes once ``event`` has fired.

        Cancelling the future just stops watching; the GPU work is not affected.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if event.done:
            fut.set_result(None)
            return fut
        with self._cond:
            if self._closed:
                raise KVTierError("EventPoller is closed")
            self._pending.append(_Pending(event, fut, loop))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvtier-cuda-events", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return fut

    def pending(self) -> int:
        """Events being watched."""
        with self._cond:
            return len(self._pending)

    def _run(self) -> None:
        sleep = self.min_sleep_s
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()  # idle: no polling at all
                    sleep = self.min_sleep_s
                if self._closed:
                    return
                batch = list(self._pending)
            # (item, the query's exception or None): events that fired, failed or whose
            # wait was cancelled.
            fired: list[tuple[_Pending, Exception | None]] = []
            for item in batch:
                if item.future.cancelled() or item.loop.is_closed():
                    fired.append((item, None))  # nobody can be told any more
                    continue
                self.polls += 1
                try:
                    done = item.event.done
                except Exception as exc:  # a failed CUDA query fails that wait only
                    fired.append((item, exc))
                    continue
                if done:
                    fired.append((item, None))
            with self._cond:
                if self._closed:  # close() took the pending list and failed its waits
                    return
                for item, _ in fired:  # no longer watched once its future is resolved
                    self._pending.remove(item)
                more = bool(self._pending)
            for item, error in fired:
                try:
                    if error is not None:
                        item.loop.call_soon_threadsafe(_set_exception, item.future, error)
                    elif not item.future.cancelled():
                        item.loop.call_soon_threadsafe(_set_result, item.future)
                except RuntimeError:  # its loop closed meanwhile: the wait has no one
                    pass  # to tell, and the poller must live on for the other loops
            if fired:
                sleep = self.min_sleep_s
            elif more:
                with self._cond:  # sleep, but wake at once for a new event or close
                    self._cond.wait(sleep)
                sleep = min(sleep * 2, self.max_sleep_s)

    def close(self) -> None:
        """Stop the thread; pending waits fail with :class:`KVTierError`. Idempotent."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
            thread = self._thread
        for item in pending:
            item.loop.call_soon_threadsafe(
                _set_exception, item.future, KVTierError("EventPoller closed while waiting")
            )
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_default_poller: EventPoller | None = None
_default_lock = threading.Lock()


def default_poller() -> EventPoller:
    """The process-wide poller (created on first use)."""
    global _default_poller
    with _default_lock:
        if _default_poller is None or _default_poller._closed:
            _default_poller = EventPoller()
        return _default_poller


async def wait_event(event: EventLike, poller: EventPoller | None = None) -> None:
    """Await ``event`` without blocking the loop (see :class:`EventPoller`)."""
    await (poller or default_poller()).wait(event)


@dataclass
class _SlotState:
    last_write: Any = None
    reads: list[Any] = field(default_factory=list)


class SlotOrdering:
    """Which events a copy touching a slot must wait for. Owned by one thread.

    Record every copy's event with :meth:`wrote` / :meth:`read`; before issuing a copy,
    make its stream wait for :meth:`before_read` or :meth:`before_write`. Completed
    events are dropped as they are seen, so the lists stay short.
    """

    def __init__(self) -> None:
        self._slots: dict[int, _SlotState] = {}

    @staticmethod
    def _live(events: Sequence[Any]) -> list[Any]:
        return [e for e in events if e is not None and not e.done]

    def before_read(self, slot: int) -> list[Any]:
        """Events a reader of ``slot`` must wait for: the last unfinished write."""
        state = self._slots.get(slot)
        if state is None:
            return []
        return self._live([state.last_write])

    def before_write(self, slot: int) -> list[Any]:
        """Events a writer of ``slot`` must wait for: the last write and reads since."""
        state = self._slots.get(slot)
        if state is None:
            return []
        state.reads = self._live(state.reads)
        return self._live([state.last_write, *state.reads])

    def wrote(self, slot: int, event: Any) -> None:
        """A write of ``slot`` was issued; ``event`` fires when it is done."""
        state = self._slots.setdefault(slot, _SlotState())
        state.last_write = event
        state.reads = []

    def read(self, slot: int, event: Any) -> None:
        """A read of ``slot`` was issued; ``event`` fires when it is done."""
        state = self._slots.setdefault(slot, _SlotState())
        state.reads = [*self._live(state.reads), event]

    def forget(self, slot: int) -> None:
        """Drop what is known of ``slot`` (after its page is gone and copies are done)."""
        self._slots.pop(slot, None)


def cupy_unavailable_reason() -> str | None:
    """Why CuPy cannot drive a GPU here, or ``None``. Cheap after the first call."""
    return _cupy_reason()


_reason_cache: list[str | None] = []


def _cupy_reason() -> str | None:
    if _reason_cache:
        return _reason_cache[0]
    reason: str | None
    try:
        import cupy
    except ImportError as exc:
        reason = (
            f"CuPy is not installed ({exc}); install the GPU extra: "
            "pip install 'kvtier[gpu]' (cupy-cuda13x matching your CUDA driver)"
        )
    except Exception as exc:  # a broken CUDA install raises all sorts at import
        reason = f"CuPy failed to import: {exc!r}"
    else:
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:
            reason = (
                f"no usable CUDA driver ({exc}); install the NVIDIA driver, or check "
                "that /dev/nvidia* is visible (containers: --gpus all)"
            )
        else:
            reason = None if count > 0 else "the CUDA driver reports no GPU"
    _reason_cache.append(reason)
    return reason


def require_cupy() -> Any:
    """Import CuPy or raise :class:`BackendUnavailableError` with the reason and fix."""
    reason = _cupy_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)
    import cupy

    return cupy


class CopyStreams:
    """Dedicated copy streams of one GPU: ``streams`` for device-to-host and as many for
    host-to-device, used round-robin, each non-blocking (they never wait for the default
    stream implicitly, so they overlap with compute)."""

    def __init__(self, device: int = 0, streams: int = 1) -> None:
        cupy = require_cupy()
        if streams < 1:
            raise KVTierUsageError(f"streams per direction must be >= 1, got {streams}")
        self.device = device
        with cupy.cuda.Device(device):
            self.d2h = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)]
            self.h2d = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)]
        self._next = {"d2h": 0, "h2d": 0}

    def stream(self, direction: str) -> Any:
        """The next stream for ``d2h`` or ``h2d``."""
        pool = self.d2h if direction == "d2h" else self.h2d
        i = self._next[direction]
        self._next[direction] = (i + 1) % len(pool)
        return pool[i]

    @staticmethod
    def new_event() -> Any:
        """A timing-free event (cheaper to record and query)."""
        import cupy

        return cupy.cuda.Event(disable_timing=True)


# -- pinned host memory -------------------------------------------------------------------


class HostMapping(mmap.mmap):
    """An anonymous memory mapping that runs cleanups before it goes back to the kernel.

    A CUDA host registration (``cudaHostRegister``) must be undone before its memory is
    unmapped: a registration left behind on a freed range makes the next mapping at that
    address fail to register (``cudaErrorHostMemoryAlreadyRegistered``) and can break
    later device allocations (``cudaErrorAlreadyMapped``), as the first GPU run showed.
    Numpy arrays made with ``np.frombuffer`` keep the mapping alive, so a cleanup added
    with :meth:`before_unmap` runs once the last view of it is gone.
    """

    def before_unmap(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` once: at :meth:`run_cleanups`, or when this mapping is
        released, whichever comes first. ``fn`` must not raise."""
        cleanups: list[Any] = self.__dict__.setdefault("_cleanups", [])  # weakref.finalize
        cleanups.append(weakref.finalize(self, fn, *args))

    def run_cleanups(self) -> None:
        """Run the cleanups now (each runs once; the memory stays mapped). Idempotent."""
        for cleanup in self.__dict__.get("_cleanups", []):
            cleanup()


def _cupy_host_unregister(addr: int) -> None:
    with contextlib.suppress(Exception):  # the memory stays valid either way
        import cupy

        cupy.cuda.runtime.hostUnregister(addr)


def pinned_host_array(nbytes: int, placement: HostPlacement | None = None) -> np.ndarray:
    """A page-locked uint8 host array of ``nbytes``, on ``placement``'s NUMA node.

    The memory is an anonymous mmap, bound with ``mbind`` *before* it is touched, then
    registered with CUDA (``cudaHostRegister``), which faults it in on the bound node.
    Release it with :func:`unpin_host_array`. Raises :class:`BackendUnavailableError`
    without CuPy/GPU, and :class:`KVTierError` naming the locked-memory limit when pinning
    fails.
    """
    cupy = require_cupy()
    if nbytes <= 0:
        raise KVTierUsageError(f"pinned buffer size must be > 0, got {nbytes}")
    region = HostMapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(region, dtype=np.uint8)
    if placement is not None:
        from kvtier.placement import apply_memory

        apply_memory(placement, arr)
    try:
        cupy.cuda.runtime.hostRegister(arr.ctypes.data, nbytes, 0)
    except Exception as exc:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
        raise KVTierError(
            f"cannot pin {nbytes} bytes of host memory ({exc}); the locked-memory limit is "
            f"{limit}: raise it (ulimit -l unlimited; containers: --ulimit memlock=-1) or "
            "shrink the DRAM tier"
        ) from exc
    region.before_unmap(_cupy_host_unregister, arr.ctypes.data)
    return arr


def unpin_host_array(arr: np.ndarray) -> None:
    """Unregister an array from :func:`pinned_host_array` now, rather than when its last
    view is garbage-collected (its memory stays valid until then). Idempotent."""
    require_cupy()
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, HostMapping):
        base.run_cleanups()
        return
    _cupy_host_unregister(arr.ctypes.data)
