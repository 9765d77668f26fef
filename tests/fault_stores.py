"""Backends that fail on demand in ways a real device, file system or library does, for
tests/test_failure_paths.py (and a slow file store for tests/test_read_order.py).

Each is a real built-in backend (DRAM arena, file store, NVMe store) with one failure
switched on by a class attribute; configs name them ``fault_stores:Class``, exactly as a
third-party backend is named. The failures are injected through public methods only: an
override of a public backend method, or a public function (``os.preadv``, ``os.unlink``,
:meth:`PosixEngine.read_batch`, :meth:`StoreIndex.delete`) replaced for the length of
one call.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from kvtier.backends import filestore as filestore_module
from kvtier.backends.dram import DramArena
from kvtier.backends.filestore import FileStore
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_engines import PosixEngine
from kvtier.backends.nvme_index import StoreIndex

from kvtier.backend import CHUNK_MIN_BYTES


@contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


class ChunkFault:
    """One read cut into chunks run at once, the first of which raises (as a library a
    worker calls can) while the others sleep ``delay_s`` and then read on into the
    caller's buffers. ``arm`` starts it; ``chunks`` counts the chunk reads since."""

    armed: ClassVar[bool] = False
    delay_s: ClassVar[float] = 0.3
    chunks: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def arm(cls, delay_s: float = 0.3) -> None:
        cls.armed, cls.delay_s, cls.chunks = True, delay_s, 0

    @classmethod
    def enter_chunk(cls) -> None:
        """Called by each chunk's worker thread before it reads."""
        if not cls.armed:
            return
        with cls.lock:
            cls.chunks += 1
            first = cls.chunks == 1
        if first:
            raise RuntimeError("injected: a worker failed on its chunk")
        time.sleep(cls.delay_s)


class ChunkFailFileStore(FileStore):
    """A file store that cuts every read into chunks (one per I/O thread, however small
    the batch) and fails one of them while :class:`ChunkFault` is armed."""

    async def run_blocking_chunks(
        self, fn: Any, jobs: Any, min_bytes: int = CHUNK_MIN_BYTES
    ) -> Any:
        return await super().run_blocking_chunks(fn, jobs, 0 if ChunkFault.armed else min_bytes)

    def read_files(self, jobs: Any) -> Any:
        ChunkFault.enter_chunk()
        return super().read_files(jobs)


@contextmanager
def nvme_group_reads_fail() -> Iterator[None]:
    """The NVMe store's POSIX engine runs :meth:`ChunkFault.enter_chunk` before reading
    each worker group's batch."""
    read_batch = PosixEngine.read_batch

    def failing(engine: PosixEngine, items: Any) -> Any:
        ChunkFault.enter_chunk()
        return read_batch(engine, items)

    with replaced(PosixEngine, "read_batch", failing):
        yield


class AbortFailArena(DramArena):
    """A DRAM arena whose ``abort`` raises ``fail_abort`` more times."""

    fail_abort: ClassVar[int] = 0

    async def abort(self, reservations: Any) -> None:
        cls = type(self)
        if cls.fail_abort:
            cls.fail_abort -= 1
            raise RuntimeError("injected: abort failed")
        await super().abort(reservations)


class ShortReserveArena(AbortFailArena):
    """A DRAM arena that, while ``short_reserve`` is set, gives no slot to the last key
    of a ``reserve`` (it is full); its ``abort`` fails as :class:`AbortFailArena`'s."""

    short_reserve: ClassVar[bool] = False

    async def reserve(self, keys: Any, namespace: str = "") -> Any:
        out = await super().reserve(keys, namespace)
        if type(self).short_reserve and out and out[-1] is not None:
            await DramArena.abort(self, [out[-1]])
            out[-1] = None
        return out


class ReserveFailArena(DramArena):
    """A DRAM arena whose ``reserve`` raises while ``fail_reserve`` is set (a third-party
    arena's allocator failing)."""

    fail_reserve: ClassVar[bool] = False

    async def reserve(self, keys: Any, namespace: str = "") -> Any:
        if type(self).fail_reserve:
            raise RuntimeError("injected: reserve failed")
        return await super().reserve(keys, namespace)


class HangingPutArena(DramArena):
    """A DRAM arena whose ``put`` never returns (a network store without a deadline)."""

    async def put(self, keys: Any, pages: Any, namespace: str = "") -> Any:
        await asyncio.Event().wait()


class CancelledGetStore(FileStore):
    """A file store whose ``get`` raises asyncio.CancelledError while ``cancel_gets`` is
    set: a future inside the backend was cancelled (its executor or connection pool shut
    down under it); the caller itself is not cancelled."""

    cancel_gets: ClassVar[bool] = False

    async def get(self, keys: Any, out: Any) -> list[bool]:
        if type(self).cancel_gets:
            raise asyncio.CancelledError()
        return await super().get(keys, out)


class CancelledAbortStore(FileStore):
    """While ``failing`` is set: ``write`` fails every page (``False``, as a full disk
    does) and ``abort`` raises asyncio.CancelledError (a future inside the backend was
    cancelled; the caller was not)."""

    failing: ClassVar[bool] = False

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        if type(self).failing:
            return [False] * len(reservations)
        return await super().write(reservations, data)

    async def abort(self, reservations: Any) -> None:
        if type(self).failing:
            raise asyncio.CancelledError()
        await super().abort(reservations)


class CommitThenRaiseStore(FileStore):
    """A file store whose ``commit`` commits and then raises while ``raise_after_commit``
    is set: the reply was lost (a timeout after the work was done)."""

    raise_after_commit: ClassVar[bool] = False

    async def commit(self, reservations: Any) -> list[bool]:
        ok = await super().commit(reservations)
        if type(self).raise_after_commit:
            raise TimeoutError("injected: commit reply lost")
        return ok


class ShortReadFileStore(FileStore):
    """A file store on a file system whose next ``preadv`` returns short (POSIX allows
    it; FUSE and network file systems do it, a signal can) while ``short_reads`` is
    positive: at most ``short_limit`` bytes, the rest of the file still there."""

    short_reads: ClassVar[int] = 0
    short_limit: ClassVar[int] = 100

    def read_files(self, jobs: Any) -> Any:
        if not type(self).short_reads:
            return super().read_files(jobs)
        cls, preadv = type(self), os.preadv

        def short_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            if cls.short_reads <= 0:
                return preadv(fd, buffers, offset, *flags)
            cls.short_reads -= 1
            first = memoryview(buffers[0]).cast("B")
            return preadv(fd, [first[: cls.short_limit]], offset, *flags)

        with replaced(os, "preadv", short_preadv):
            return super().read_files(jobs)


class UnlinkFailStore(FileStore):
    """A file store whose page files cannot be removed while ``read_only`` is set: the
    file system went read-only (as ext4 does after an error)."""

    read_only: ClassVar[bool] = False

    async def delete(self, keys: Any) -> list[bool]:
        if not type(self).read_only:
            return await super().delete(keys)
        root, unlink = Path(self.path).resolve(), os.unlink

        def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).resolve().is_relative_to(root):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            unlink(path, *args, **kwargs)

        with replaced(os, "unlink", refuse):
            return await super().delete(keys)


class FsyncFailStore(FileStore):
    """A file store (``fsync`` on) whose directory fsyncs fail with EIO while
    ``fail_fsync`` is set (a disk that lost a write)."""

    fail_fsync: ClassVar[bool] = False

    def commit_files(self, jobs: Any) -> Any:
        if not type(self).fail_fsync:
            return super().commit_files(jobs)

        def failing(path: Any) -> None:
            raise OSError(errno.EIO, "Input/output error", str(path))

        with replaced(filestore_module, "fsync_dir", failing):
            return super().commit_files(jobs)


class IndexDeleteFailNvme(NvmeStore):
    """An NVMe store whose SQLite index refuses deletes while ``fail_index_delete`` is
    set (``disk I/O error``; also ``database is locked`` past the busy timeout, or a full
    disk for the WAL)."""

    fail_index_delete: ClassVar[bool] = False

    async def delete(self, keys: Any) -> list[bool]:
        if not type(self).fail_index_delete:
            return await super().delete(keys)

        def refuse(index: StoreIndex, keys: Any) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        with replaced(StoreIndex, "delete", refuse):
            return await super().delete(keys)


class SlowGetStore(FileStore):
    """A file store whose every ``get`` first sleeps ``delay_s`` seconds (a slow tier),
    counting its calls in ``gets`` and, over all its instances, the gets running at once
    (``in_flight``; the most seen in ``most_in_flight``)."""

    delay_s: ClassVar[float] = 0.3
    gets: ClassVar[list[int]] = []  # the page count of each call
    in_flight: ClassVar[int] = 0
    most_in_flight: ClassVar[int] = 0

    async def get(self, keys: Any, out: Any) -> list[bool]:
        cls = SlowGetStore
        cls.gets.append(len(keys))
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            await asyncio.sleep(cls.delay_s)
            return await super().get(keys, out)
        finally:
            cls.in_flight -= 1
