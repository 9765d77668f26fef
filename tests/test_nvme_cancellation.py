"""The NVMe store under cancellation: I/O that outlives a cancelled caller.

A worker thread cannot be stopped: when a caller of ``write``/``get``/``put`` is cancelled,
the page I/O it started keeps running. These tests hold such I/O on a gate (the real
engine, delayed) and check that the store neither hands its slot to another page nor
tears the store down under it, and that a cancelled ``put`` leaves no space taken.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_engines import PageWrite, WriteResult
from kvtier.backends.nvme_index import StoreLockedError
from kvtier.backends.nvme_layout import BLOCK

from kvtier.keys import PageKey

PAGE = 2 * BLOCK


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


class WriteGate:
    """Holds the first engine write batch until :meth:`release`; later batches pass."""

    def __init__(self, s: NvmeStore) -> None:
        assert s._engine is not None
        self._real = s._engine.write_batch
        self.entered = threading.Event()
        self.finished = threading.Event()
        self._open = threading.Event()
        self._first = True
        self.results: list[WriteResult] = []
        s._engine.write_batch = self._write  # type: ignore[method-assign]

    def _write(self, items: Sequence[PageWrite]) -> list[WriteResult]:
        if not self._first:
            return self._real(items)
        self._first = False
        self.entered.set()
        self._open.wait(30)
        try:
            self.results = self._real(items)
            return self.results
        finally:
            self.finished.set()

    def release(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30)


async def test_slot_of_a_cancelled_write_is_not_reused_while_the_write_runs(
    tmp_path: Path,
) -> None:
    s = NvmeStore(page_bytes=PAGE, capacity_pages=1, path=tmp_path / "s", engine="posix")
    await s.open()
    try:
        gate = WriteGate(s)
        (r1,) = await s.reserve([key(1)])
        assert r1 is not None
        writing = asyncio.ensure_future(s.write([r1], [page(1)]))
        await gate.wait_entered()
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        await s.abort([r1])
        # The stale write still runs: its slot is not free, so the store is full.
        assert await s.put([key(2)], [page(2)]) == [False]
        gate.release()
        assert await asyncio.to_thread(gate.finished.wait, 30)
        for _ in range(100):  # the slot comes back once the write's thread is done
            if s.used_pages() == 0:
                break
            await asyncio.sleep(0.01)
        assert s.used_pages() == 0
        assert await s.put([key(2)], [page(2)]) == [True]
        out = np.empty(PAGE, np.uint8)
        assert await s.get([key(2)], [out]) == [True]
        np.testing.assert_array_equal(out, page(2))
    finally:
        gate.release()
        await s.close()


async def test_close_waits_for_the_io_of_a_cancelled_call(tmp_path: Path) -> None:
    s = NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s", engine="posix")
    await s.open()
    gate = WriteGate(s)
    writing = asyncio.ensure_future(s.put([key(1)], [page(1)]))
    await gate.wait_entered()
    writing.cancel()
    await asyncio.gather(writing, return_exceptions=True)
    closing = asyncio.ensure_future(s.close())
    await asyncio.sleep(0.05)
    assert not closing.done(), "close tore the store down under a running write"
    # The write still runs, so the store is still held: nobody else may open it yet.
    with pytest.raises(StoreLockedError):
        await NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s").open()
    gate.release()
    await asyncio.wait_for(closing, 30)
    assert gate.finished.is_set()
    assert gate.results == [None], f"the write met a closed store: {gate.results}"
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s") as again:
        # Nothing of the cancelled put was committed or left reserved.
        assert await again.keys() == [] and again.used_pages() == 0


async def test_a_cancelled_put_leaves_no_space_taken(tmp_path: Path) -> None:
    async with NvmeStore(
        page_bytes=PAGE, capacity_pages=2, path=tmp_path / "s", engine="posix"
    ) as s:
        gate = WriteGate(s)
        writing = asyncio.ensure_future(s.put([key(1), key(2)], [page(1), page(2)]))
        await gate.wait_entered()
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        gate.release()
        assert await asyncio.to_thread(gate.finished.wait, 30)
        for _ in range(100):
            if s.used_pages() == 0:
                break
            await asyncio.sleep(0.01)
        assert s.used_pages() == 0, "a cancelled put kept its reservations"
        assert await s.put([key(3), key(4)], [page(3), page(4)]) == [True, True]


async def test_abort_during_a_running_commit_does_not_free_the_committed_slot(
    tmp_path: Path,
) -> None:
    async with NvmeStore(
        page_bytes=PAGE, capacity_pages=2, path=tmp_path / "s", engine="posix"
    ) as s:
        assert s._index is not None
        real_insert = s._index.insert
        entered, go = threading.Event(), threading.Event()

        def slow_insert(rows: object) -> None:
            entered.set()
            go.wait(30)
            real_insert(rows)  # type: ignore[arg-type]

        s._index.insert = slow_insert  # type: ignore[method-assign]
        (r1,) = await s.reserve([key(1)])
        assert r1 is not None
        assert await s.write([r1], [page(1)]) == [True]
        committing = asyncio.ensure_future(s.commit([r1]))
        assert await asyncio.to_thread(entered.wait, 30)
        committing.cancel()
        await asyncio.gather(committing, return_exceptions=True)
        await s.abort([r1])  # too late: the commit is already on its way to the index
        go.set()
        for _ in range(100):
            if s._commit_task is None:
                break
            await asyncio.sleep(0.01)
        s._index.insert = real_insert  # type: ignore[method-assign]
        # Whatever the commit's fate, its slot is not handed to another page while the
        # page it holds is visible.
        assert await s.put([key(2)], [page(2)]) == [True]
        outs = [np.empty(PAGE, np.uint8) for _ in range(2)]
        hits = await s.get([key(1), key(2)], outs)
        assert hits[1] and np.array_equal(outs[1], page(2))
        assert hits[0], "the committed page was overwritten through a slot freed by abort"
        np.testing.assert_array_equal(outs[0], page(1))
        assert s.stats().get("integrity_errors", 0) == 0


async def test_a_reserve_cancelled_while_its_slab_is_made_takes_no_space(
    tmp_path: Path,
) -> None:
    async with NvmeStore(
        page_bytes=PAGE, capacity_pages=2, path=tmp_path / "s", engine="posix"
    ) as s:
        real_ensure = s._ensure_slabs
        entered, go = threading.Event(), threading.Event()

        def slow_ensure(slabs: list[int]) -> dict[int, BaseException]:
            entered.set()
            go.wait(30)
            return real_ensure(slabs)

        s._ensure_slabs = slow_ensure  # type: ignore[method-assign]
        reserving = asyncio.ensure_future(s.put([key(1), key(2)], [page(1), page(2)]))
        assert await asyncio.to_thread(entered.wait, 30)
        reserving.cancel()
        await asyncio.gather(reserving, return_exceptions=True)
        go.set()
        assert s.used_pages() == 0, "a cancelled reserve kept its slots"
        s._ensure_slabs = real_ensure  # type: ignore[method-assign]
        assert await s.put([key(3), key(4)], [page(3), page(4)]) == [True, True]


async def test_a_cancelled_open_releases_the_store(tmp_path: Path) -> None:
    s = NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s", engine="posix")
    real_open = s._open_blocking
    entered, go = threading.Event(), threading.Event()

    def slow_open() -> None:
        entered.set()
        go.wait(30)
        real_open()

    s._open_blocking = slow_open  # type: ignore[method-assign]
    opening = asyncio.ensure_future(s.open())
    assert await asyncio.to_thread(entered.wait, 30)
    opening.cancel()
    go.set()
    await asyncio.gather(opening, return_exceptions=True)
    assert opening.cancelled()
    # The lock and files the open had taken are released: the store opens again, here
    # through another object and through the same one.
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s") as other:
        assert await other.put([key(1)], [page(1)]) == [True]
    s._open_blocking = real_open  # type: ignore[method-assign]
    async with s:
        assert await s.keys() == [key(1)]


async def test_a_cancelled_close_leaves_the_store_open_and_closable(tmp_path: Path) -> None:
    s = NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s", engine="posix")
    await s.open()
    gate = WriteGate(s)
    writing = asyncio.ensure_future(s.put([key(1)], [page(1)]))
    await gate.wait_entered()
    closing = asyncio.ensure_future(s.close())
    await asyncio.sleep(0.01)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    gate.release()
    assert await writing == [True]
    assert await s.contains([key(1)]) == [True]  # still open and serving
    await s.close()
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path / "s") as again:
        assert await again.keys() == [key(1)]
