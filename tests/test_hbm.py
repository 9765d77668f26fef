"""The HBM arena and the CUDA stream/event bridge.

On a machine without CuPy or a GPU the GPU tests skip with the reason printed (pytest
``-ra``) and the CPU tests check what does not need a GPU: the backend is listed as
unavailable with its reason, bad options are rejected, and the event poller and stream
ordering logic run against stand-in events (objects with the ``done`` property that
``cupy.cuda.Event`` has, flipped by a timer thread instead of a GPU), and the arena's own
logic (conformance suite, slot-reuse ordering) runs against a test-only stand-in for the
small CuPy surface it uses (tests/cupy_standin.py; it proves nothing about CuPy).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest
from cupy_standin import install_standin
from kvtier.backends.hbm import HbmArena

from kvtier import registry
from kvtier.backend import Reservation
from kvtier.cuda_streams import EventPoller, SlotOrdering, cupy_unavailable_reason
from kvtier.errors import BackendUnavailableError, ConfigError, KVTierError, KVTierUsageError
from kvtier.keys import PageKey

GPU_REASON = cupy_unavailable_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")


class TimerEvent:
    """Stands in for a CUDA event: ``done`` turns true ``delay_s`` after creation."""

    def __init__(self, delay_s: float) -> None:
        self._flag = threading.Event()
        self.queries = 0
        timer = threading.Timer(delay_s, self._flag.set)
        timer.daemon = True
        timer.start()

    @property
    def done(self) -> bool:
        self.queries += 1
        return self._flag.is_set()


class BrokenEvent:
    @property
    def done(self) -> bool:
        raise RuntimeError("cudaErrorLaunchFailure")


# -- discovery and options (CPU) -------------------------------------------------------


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present: HBM is available here")
def test_hbm_listed_unavailable_with_reason() -> None:
    info = registry.describe("hbm")
    assert info.kind == "arena"
    assert info.available is False
    assert info.reason == GPU_REASON
    assert "CuPy" in GPU_REASON or "CUDA" in GPU_REASON or "GPU" in GPU_REASON
    with pytest.raises(BackendUnavailableError, match="hbm' is unavailable here"):
        registry.resolve("hbm")


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present")
async def test_open_without_gpu_says_why() -> None:
    arena = HbmArena(page_bytes=4096, capacity_pages=4)
    with pytest.raises(BackendUnavailableError) as err:
        await arena.open()
    assert str(err.value) == GPU_REASON


def test_bad_options_are_rejected_before_any_gpu_work() -> None:
    with pytest.raises(KVTierUsageError, match="device must be a CUDA device index"):
        HbmArena(page_bytes=4096, capacity_pages=4, device=-1)
    with pytest.raises(KVTierUsageError, match="copy_streams must be an integer >= 1"):
        HbmArena(page_bytes=4096, capacity_pages=4, copy_streams=0)
    with pytest.raises(ConfigError, match=r"unknown option.*numa_node"):
        HbmArena(page_bytes=4096, capacity_pages=4, numa_node=0)
    with pytest.raises(KVTierUsageError, match="no numpy view: use device_view"):
        HbmArena(page_bytes=4096, capacity_pages=4).view(0)


# -- event poller (CPU, stand-in events) -----------------------------------------------


async def test_a_resolved_wait_is_no_longer_pending_and_close_races_no_thread() -> None:
    """A wait's future resolves only after its event left the pending list (it used to
    resolve first, so ``pending()`` could still count it), and closing the poller while
    its thread is polling does not crash the thread (it used to remove items from the
    list ``close`` had emptied)."""
    crashes: list[BaseException | None] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: crashes.append(args.exc_value)
    try:
        for i in range(100):
            poller = EventPoller()
            await poller.wait(TimerEvent(0.0005))
            assert poller.pending() == 0
            late = poller.wait(TimerEvent(1.0))
            await asyncio.sleep(0.0001 * (i % 10))  # close at varied points of a poll
            poller.close()
            with pytest.raises(KVTierError, match="closed while waiting"):
                await late
    finally:
        threading.excepthook = old_hook
    assert crashes == []


async def test_poller_resolves_without_blocking_the_loop() -> None:
    poller = EventPoller()
    try:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        beat = asyncio.create_task(heartbeat())
        start = time.perf_counter()  # before the timers start: they count from creation
        events = [TimerEvent(0.05 + 0.02 * i) for i in range(5)]
        await asyncio.gather(*(poller.wait(e) for e in events))
        elapsed = time.perf_counter() - start
        beat.cancel()
        assert all(e.done for e in events)
        assert elapsed >= 0.05 + 0.02 * 4
        assert ticks >= 5  # the loop kept running while the events were pending
        assert poller.pending() == 0
    finally:
        poller.close()


async def test_poller_backs_off_instead_of_spinning() -> None:
    poller = EventPoller(min_sleep_s=20e-6, max_sleep_s=2e-3)
    try:
        event = TimerEvent(0.2)
        start = time.perf_counter()
        await poller.wait(event)
        elapsed = time.perf_counter() - start
        doubling = math.ceil(math.log2(poller.max_sleep_s / poller.min_sleep_s)) + 1
        # after the doubling phase each query is followed by a sleep >= max_sleep_s
        bound = doubling + elapsed / poller.max_sleep_s + 2
        assert event.queries <= bound, (event.queries, bound)
        idle = poller.polls
        await asyncio.sleep(0.05)
        assert poller.polls == idle  # nothing pending: no polling at all
    finally:
        poller.close()


async def test_poller_cancellation_errors_and_close() -> None:
    poller = EventPoller()
    slow = TimerEvent(10.0)
    fut = poller.wait(slow)
    fut.cancel()
    with pytest.raises(RuntimeError, match="cudaErrorLaunchFailure"):
        await poller.wait(BrokenEvent())
    pending = poller.wait(TimerEvent(10.0))
    for _ in range(100):  # the cancelled wait is dropped by the poller thread
        if poller.pending() == 1:
            break
        await asyncio.sleep(0.01)
    assert poller.pending() == 1
    poller.close()
    with pytest.raises(KVTierError, match="closed while waiting"):
        await pending
    with pytest.raises(KVTierError, match="EventPoller is closed"):
        poller.wait(TimerEvent(10.0))
    with pytest.raises(KVTierUsageError, match="0 < min <= max"):
        EventPoller(min_sleep_s=1.0, max_sleep_s=0.1)


async def test_poller_completes_done_events_immediately() -> None:
    poller = EventPoller()
    ev = TimerEvent(0.0)
    await asyncio.sleep(0.01)
    fut = poller.wait(ev)
    assert fut.done()
    poller.close()


# -- stream ordering (CPU, stand-in events) --------------------------------------------


class ManualEvent:
    def __init__(self) -> None:
        self.done = False


def test_a_wait_whose_loop_closed_does_not_kill_the_poller() -> None:
    """A wait left pending when its loop closed: telling that loop raised 'Event loop is
    closed' on the poller thread, which died, and every later wait of every loop (each
    HBM read and write) hung."""
    poller = EventPoller()
    try:
        first = ManualEvent()
        loop = asyncio.new_event_loop()

        async def start() -> asyncio.Future[None]:
            return poller.wait(first)

        loop.run_until_complete(start())
        loop.close()
        first.done = True  # the copy completes after its loop closed

        async def later() -> None:
            second = TimerEvent(0.05)
            await asyncio.wait_for(poller.wait(second), 5)

        asyncio.run(later())
        assert poller._thread is not None and poller._thread.is_alive()
        assert poller.pending() == 0
    finally:
        poller.close()


def test_slot_ordering_reads_wait_for_writes_and_writes_for_reads() -> None:
    order = SlotOrdering()
    assert order.before_read(3) == [] and order.before_write(3) == []
    w1 = ManualEvent()
    order.wrote(3, w1)
    assert order.before_read(3) == [w1]  # never read before the copy that wrote it
    assert order.before_read(4) == []  # other slots are independent
    r1, r2 = ManualEvent(), ManualEvent()
    order.read(3, r1)
    order.read(3, r2)
    assert order.before_write(3) == [w1, r1, r2]  # overwrite waits for readers too
    w1.done = True
    r1.done = True
    assert order.before_read(3) == []
    assert order.before_write(3) == [r2]
    w2 = ManualEvent()
    order.wrote(3, w2)
    assert order.before_write(3) == [w2]  # reads of the old contents are superseded
    order.forget(3)
    assert order.before_write(3) == []


# -- on a GPU -------------------------------------------------------------------------


def _keys(n: int) -> list[PageKey]:
    rng = np.random.default_rng(7)
    return [PageKey(rng.bytes(16)) for _ in range(n)]


@gpu
async def test_gpu_conformance_suite() -> None:
    from kvtier.testing.conformance import check_backend, conformance_cases

    # arena_zero_copy checks numpy views of slots, which device memory cannot give.
    cases = [c for c in conformance_cases() if c.name != "arena_zero_copy"]
    report = await check_backend(
        lambda: HbmArena(page_bytes=64 * 1024, capacity_pages=16), cases=cases
    )
    assert report.passed


@gpu
async def test_gpu_round_trip_views_and_wrong_device() -> None:
    import cupy
    import torch

    page = 1 << 20
    async with HbmArena(page_bytes=page, capacity_pages=4, copy_streams=2) as arena:
        keys = _keys(3)
        data = [np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8) for i in range(3)]
        assert await arena.put(keys, data) == [True] * 3
        out = [np.empty(page, np.uint8) for _ in range(3)]
        assert await arena.get(keys, out) == [True] * 3
        for a, b in zip(out, data, strict=True):
            np.testing.assert_array_equal(a, b)
        slot = arena.slot_of(keys[0])
        assert slot is not None
        dev = arena.device_view(slot)
        t = arena.tensor(slot)
        assert t.is_cuda and t.data_ptr() == dev.data.ptr
        np.testing.assert_array_equal(cupy.asnumpy(dev), data[0])
        # device-to-device in and out
        d_out = cupy.empty(page, cupy.uint8)
        assert await arena.get(keys[1:2], [d_out]) == [True]
        assert torch.equal(torch.from_dlpack(d_out).cpu(), torch.from_numpy(data[1]))
        if cupy.cuda.runtime.getDeviceCount() > 1:
            with cupy.cuda.Device(1):
                other = cupy.empty(page, cupy.uint8)
            with pytest.raises(KVTierUsageError, match="is on GPU 1 but this HBM arena"):
                await arena.get(keys[:1], [other])
        res = await arena.reserve(_keys(1))
        assert isinstance(res[0], Reservation) and res[0].view is None
        await arena.abort([r for r in res if r is not None])


@gpu
async def test_gpu_out_of_memory_is_a_capacity_error() -> None:
    import cupy

    free, _total = cupy.cuda.runtime.memGetInfo()
    from kvtier.errors import CapacityError

    arena = HbmArena(page_bytes=1 << 30, capacity_pages=int(free // (1 << 30)) + 64)
    with pytest.raises(CapacityError, match="lower the hbm tier's capacity"):
        await arena.open()


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present: the check would run")
def test_gpu_check_script_exits_with_reason_without_gpu() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "no usable GPU on this machine" in proc.stderr
    assert GPU_REASON is not None and GPU_REASON in proc.stderr


# -- the arena's own logic on CPU, against a stand-in for the CuPy surface it uses --------
# (tests/cupy_standin.py; it proves nothing about CuPy)


@pytest.fixture
def standin_cupy(monkeypatch):
    """Install the stand-in as ``cupy`` and clear the cached availability answer."""
    from kvtier import cuda_streams

    yield lambda read_delay_s=0.0: install_standin(monkeypatch, read_delay_s)
    monkeypatch.setattr(cuda_streams, "_reason_cache", [])


async def test_standin_arena_runs_the_conformance_suite(standin_cupy) -> None:
    from kvtier.testing.conformance import check_backend, conformance_cases

    standin_cupy()
    assert HbmArena.unavailable_reason() is None
    cases = [c for c in conformance_cases() if c.name != "arena_zero_copy"]
    report = await check_backend(
        lambda: HbmArena(page_bytes=4096, capacity_pages=16, copy_streams=2), cases=cases
    )
    assert set(report.passed) == {c.name for c in cases} - set(report.skipped)
    assert "round_trip" in report.passed and "loop_not_blocked" in report.passed


async def test_standin_slot_reuse_waits_for_in_flight_read(standin_cupy, monkeypatch) -> None:
    """A read of slot s is in flight on the D2H stream (slow); meanwhile the key is
    deleted and a new page is written into the same slot on the H2D stream. The write must
    wait for the read's event, or the read returns the new page's bytes."""
    standin_cupy(read_delay_s=0.1)
    page = 4096

    async def scenario() -> np.ndarray:
        async with HbmArena(page_bytes=page, capacity_pages=1) as arena:
            old, new = np.full(page, 1, np.uint8), np.full(page, 2, np.uint8)
            (a,) = _keys(1)
            b = PageKey(bytes(16))
            assert await arena.put([a], [old]) == [True]
            out = np.zeros(page, np.uint8)
            reading = asyncio.create_task(arena.get([a], [out]))
            slot = arena.slot_of(a)
            for _ in range(200):  # until the read is queued on its stream
                state = arena._ordering._slots.get(slot or 0)
                if state is not None and state.reads:
                    break
                await asyncio.sleep(0.001)
            assert await arena.delete([a]) == [True]
            assert await arena.put([b], [new]) == [True]  # reuses the only slot
            assert await reading == [True]
            return out

    out = await scenario()
    assert (out == 1).all()  # the read saw the old page

    # the same scenario without the ordering reads the new bytes: the check can fail
    monkeypatch.setattr(SlotOrdering, "before_write", lambda self, slot: [])
    out = await scenario()
    assert (out == 2).all()


def test_a_host_mapping_runs_its_cleanups_once_before_it_is_unmapped() -> None:
    """pinned_host_array and the pinned DRAM arena undo their CUDA registration this way:
    once the last view of the memory is gone, or earlier on request, never twice."""
    import gc
    import mmap

    from kvtier.cuda_streams import HostMapping

    calls: list[int] = []
    region = HostMapping(-1, 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(region, dtype=np.uint8)
    region.before_unmap(calls.append, 1)
    view = arr[10:20]
    del region, arr
    gc.collect()
    assert calls == []  # a view still holds the memory
    view[:] = 7  # and it is still mapped
    del view
    gc.collect()
    assert calls == [1]

    region = HostMapping(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.before_unmap(calls.append, 2)
    region.run_cleanups()
    region.run_cleanups()
    del region
    gc.collect()
    assert calls == [1, 2]


def test_coalesce_merges_runs_of_consecutive_slots_and_host_bytes_only() -> None:
    from cupy_standin import _StandInArray
    from kvtier.backends.hbm import coalesce

    page = 4096
    host = np.zeros(6 * page, np.uint8)
    views = [host[i * page : (i + 1) * page] for i in range(6)]
    # slots 3,4,5 <- views 0,1,2 (one run); slot 7 <- view 3 (slot gap); slot 8 <- view 5
    # (host gap); slot 9 <- a device array (never merged); slot 10 <- view 4
    dev = _StandInArray(np.zeros(page, np.uint8))
    jobs = [(3, views[0]), (4, views[1]), (5, views[2]), (7, views[3]), (8, views[5])]
    jobs += [(9, dev), (10, views[4])]
    runs = coalesce(jobs, page)
    assert [(slot, nbytes) for slot, _, nbytes in runs] == [
        (3, 3 * page), (7, page), (8, page), (9, page), (10, page)
    ]  # fmt: skip
    assert runs[0][1] is views[0] and runs[3][1] is dev
    assert coalesce([], page) == []
    # the same page twice in a row is two copies (the second starts where the first did)
    assert len(coalesce([(0, views[0]), (1, views[0])], page)) == 2


async def test_consecutive_pages_move_in_one_copy_and_keep_their_bytes(
    standin_cupy, monkeypatch
) -> None:
    import cupy_standin

    standin_cupy()
    calls: list[int] = []
    for name in ("copy_from_host_async", "copy_to_host_async"):
        original = getattr(cupy_standin._StandInMemPtr, name)

        def counted(self, ptr, n, stream, original=original):
            calls.append(n)
            return original(self, ptr, n, stream)

        monkeypatch.setattr(cupy_standin._StandInMemPtr, name, counted)
    page, n = 4096, 8
    src = np.random.default_rng(3).integers(0, 256, n * page, dtype=np.uint8)
    async with HbmArena(page_bytes=page, capacity_pages=n) as arena:
        keys = _keys(n)
        assert await arena.put(keys, [src[i * page : (i + 1) * page] for i in range(n)])
        assert calls == [n * page]  # fresh arena: slots 0..7, one run
        out = np.zeros(n * page, np.uint8)
        assert await arena.get(keys, [out[i * page : (i + 1) * page] for i in range(n)])
        assert calls == [n * page, n * page]
        np.testing.assert_array_equal(out, src)
        # reversed order: no run is consecutive on both sides, one copy per page
        calls.clear()
        back = np.zeros(n * page, np.uint8)
        views = [back[i * page : (i + 1) * page] for i in range(n)]
        assert await arena.get(keys[::-1], views[::-1]) == [True] * n
        assert calls == [page] * n
        np.testing.assert_array_equal(back, src)


async def test_a_cancelled_read_has_stopped_writing_the_callers_buffer(standin_cupy) -> None:
    """A ``get`` cancelled while its device-to-host copy ran returned at once, and the
    copy landed in the caller's buffer afterwards (a DRAM slot given to another page by
    then). It now returns, cancelled, only once the copy is done."""
    standin_cupy(read_delay_s=0.2)
    page = 4096
    async with HbmArena(page_bytes=page, capacity_pages=4) as arena:
        (key,) = _keys(1)
        assert await arena.put([key], [np.full(page, 7, np.uint8)]) == [True]
        out = np.zeros(page, np.uint8)
        reading = asyncio.create_task(arena.get([key], [out]))
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        out[:] = 42  # the caller reuses its buffer
        await asyncio.sleep(0.4)
        assert set(out.tolist()) == {42}
