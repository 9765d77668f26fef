"""The kvikio engine's own logic, against a test-only stand-in for KvikIO's Python API.

Real KvikIO needs a CUDA driver library (``libcuda.so.1``) even in compat mode, so on a
machine without one the engine's conformance run skips (see test_nvme_conformance.py).
This file checks what *our* engine does with KvikIO's documented surface
(``CuFile(path, flags)``, ``pread``/``pwrite(buf, size, file_offset) -> IOFuture``,
``IOFuture.get()``, ``close()``): header placement, futures awaited off the event loop,
short reads reported as integrity errors, and that a store written through it reads back
through the posix engine and vice versa (one format). The stand-in below is NOT KvikIO
and proves nothing about KvikIO itself.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from kvtier.backends import nvme_base, nvme_engines
from kvtier.backends.nvme import NvmeStore

from kvtier.keys import PageKey
from kvtier.testing.conformance import Case, conformance_cases

PAGE = 3 * 4096 + 77


class _StandInFuture:
    def __init__(self, fut: concurrent.futures.Future[int]) -> None:
        self._fut = fut

    def get(self) -> int:
        return self._fut.result()

    def done(self) -> bool:
        return self._fut.done()


class _StandInCuFile:
    """os.pread/os.pwrite on a thread pool, shaped like kvikio.CuFile (test-only)."""

    pool: ClassVar[concurrent.futures.ThreadPoolExecutor] = concurrent.futures.ThreadPoolExecutor(4)
    opened: ClassVar[list[str]] = []

    def __init__(self, file: Path, flags: str = "r") -> None:
        assert flags == "r+", "the engine opens slabs for read and write"
        self._fd = os.open(file, os.O_RDWR)
        _StandInCuFile.opened.append(str(file))

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int) -> _StandInFuture:
        data = memoryview(buf).cast("B")[:size]
        return _StandInFuture(self.pool.submit(os.pwrite, self._fd, data, file_offset))

    def pread(self, buf: np.ndarray, size: int, file_offset: int) -> _StandInFuture:
        view = memoryview(buf).cast("B")[:size]
        return _StandInFuture(self.pool.submit(os.preadv, self._fd, [view], file_offset))

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def standin_kvikio(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = types.ModuleType("kvikio")
    module.CuFile = _StandInCuFile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setattr(nvme_engines, "kvikio_unavailable_reason", lambda: None)
    monkeypatch.setattr(nvme_base, "kvikio_unavailable_reason", lambda: None)
    _StandInCuFile.opened.clear()
    return module


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


def make(path: Path, engine: str) -> NvmeStore:
    return NvmeStore(
        page_bytes=PAGE, capacity_pages=32, path=path, engine=engine, slab_bytes=8 * 20480
    )


async def test_kvikio_engine_writes_the_shared_format(standin_kvikio: Any, tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with make(root, "kvikio") as s:
        assert s.engine_name == "kvikio"
        assert all(await s.put([key(i) for i in range(12)], [page(i) for i in range(12)]))
        outs = [np.empty(PAGE, np.uint8) for _ in range(12)]
        assert await s.get([key(i) for i in range(12)], outs) == [True] * 12
        assert all(np.array_equal(o, page(i)) for i, o in enumerate(outs))
    assert _StandInCuFile.opened, "the engine did its I/O through CuFile"
    async with make(root, "posix") as s:  # same format, other engine
        outs = [np.empty(PAGE, np.uint8) for _ in range(12)]
        assert await s.get([key(i) for i in range(12)], outs) == [True] * 12
        assert all(np.array_equal(o, page(i)) for i, o in enumerate(outs))
        assert all(await s.put([key(40)], [page(40)]))
    async with make(root, "kvikio") as s:
        out = np.empty(PAGE, np.uint8)
        assert await s.get([key(40)], [out]) == [True]
        assert np.array_equal(out, page(40))


async def test_kvikio_engine_detects_truncation(standin_kvikio: Any, tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with make(root, "kvikio") as s:
        assert all(await s.put([key(1)], [page(1)]))
        # Cut while open (at open, rows past a slab's end are dropped before any read).
        os.truncate(root / "slabs" / "slab-00000.dat", PAGE // 2)
        assert await s.get([key(1)], [np.empty(PAGE, np.uint8)]) == [False]
        assert s.stats()["integrity_errors"] == 1


@pytest.mark.parametrize("case", conformance_cases(), ids=str)
async def test_conformance_through_the_standin(
    case: Case, standin_kvikio: Any, tmp_path: Path
) -> None:
    """The whole contract, with every page moved by the kvikio engine's code."""
    result = await case.run(lambda: make(tmp_path / "s", "kvikio"), persistent=True)
    if result.skipped:
        pytest.skip(result.detail)


async def test_a_failed_payload_read_still_waits_for_its_header_read(
    standin_kvikio: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a page's payload read failed, its header read (into a buffer local to the
    batch) was never waited for: the buffer could be freed while a KvikIO worker still
    wrote into it. Both are now waited for, and the page is a miss."""
    root = tmp_path / "s"
    async with make(root, "kvikio") as s:
        assert all(await s.put([key(1)], [page(1)]))
        waited: list[str] = []
        real_pread = _StandInCuFile.pread

        def pread(self: _StandInCuFile, buf: np.ndarray, size: int, offset: int) -> Any:
            if size == PAGE:  # the payload: fails
                failed: concurrent.futures.Future[int] = concurrent.futures.Future()
                failed.set_exception(OSError(5, "injected EIO"))
                return _StandInFuture(failed)
            inner = real_pread(self, buf, size, offset)

            class Watched:
                def get(self) -> int:
                    waited.append("header")
                    return inner.get()

            return Watched()

        monkeypatch.setattr(_StandInCuFile, "pread", pread)
        assert await s.get([key(1)], [np.empty(PAGE, np.uint8)]) == [False]
        assert waited == ["header"]
