"""The NVMe tier: a crash-safe, checksummed, persistent page store on a local disk.

Layout under ``path`` (see :mod:`~kvtier.backends.nvme_layout`,
:mod:`~kvtier.backends.nvme_index`)::

    <path>/index.sqlite     SQLite (WAL) index: key -> slab, offset, length, checksum,
                            namespace, times; the store's format version and geometry
    <path>/slabs/slab-N.dat preallocated slab files of 4 KiB-aligned slots
    <path>/lock             flock'ed by the one process that has the store open

Guarantees:

* **Visible only when durable.** A page's bytes are durable before its index row is
  committed: with O_DIRECT each write carries ``RWF_DSYNC`` (durable when it returns),
  otherwise ``commit`` runs one ``fdatasync`` per touched slab first. The rows of a commit
  go in one SQLite transaction; only then do the pages become visible to
  ``get``/``contains``/``keys``. Concurrent ``commit`` calls are grouped: one sync pass and
  one transaction per group, not per page.
* **Crash-safe.** After ``kill -9`` at any point, reopening recovers every page whose
  commit returned ``True``; pages not yet committed are simply absent (their slots are
  free again). Recovery reads the index only; its duration is ``stats()["recovery_seconds"]``.
* **Verified reads.** Every page has a header (:mod:`kvtier.pageformat`) after its payload;
  every read checks header, key, namespace, length and payload checksum. A page that
  fails is a miss: counted, logged once with its key, slab and offset, dropped from the
  index and its slot quarantined (never reused, never served).
* **Capacity.** At most ``capacity_pages`` slots are in use (committed + reserved +
  quarantined + freed but still under running I/O + deleted while the index could not
  record it); ``reserve`` answers ``None`` beyond that. Deleted slots are reused, never
  while a read or write on them still runs.
* **Faults.** A full disk or an I/O error fails the affected pages only (``None`` from
  ``reserve``, ``False`` from ``write``/``commit``/``get``), is logged once per cause, and
  leaves the store consistent; a read that meets an I/O error (rather than bad bytes)
  keeps the page, since a later read may succeed (a missing slab file is not such an
  error: its pages are quarantined like bad bytes).
* **Closing.** ``close`` waits for the calls in flight and their page I/O (which outlives
  a cancelled caller: worker threads cannot be stopped) and refuses new calls, then waits
  for pending commits; uncommitted reservations are dropped.
* **Cancellation.** A cancelled ``reserve`` or ``put`` gives back the space it had not
  committed; a reservation whose commit already reached the index cannot be aborted.

Options (besides ``page_bytes``, ``capacity_pages``, ``io_threads``):

* ``path``: the store directory (created when missing; must be empty or a store).
* ``engine``: ``"posix"`` (``os.pwritev``/``os.preadv`` on the worker pool), ``"kvikio"``
  (KvikIO ``CuFile``; needs a CUDA driver) or ``"auto"`` (kvikio when it can run).
* ``direct_io``: ``"auto"`` (O_DIRECT when the file system supports it), ``True``
  (required), ``False`` (buffered I/O).
* ``slab_bytes``: size of each slab file (default 1 GiB, at most ``capacity_pages`` slots;
  fixed when a store is created).
* ``preallocate``: reserve slab space up front (``posix_fallocate``, default) so a full
  disk fails ``reserve`` rather than ``write``.
* ``group_access``: files ``0660`` and directories ``0770`` instead of the private
  ``0600`` / ``0700`` (default false; see :mod:`~kvtier.backends.store_files`).

Opening checks and repairs the store (:mod:`~kvtier.backends.nvme_open`): no symlink
inside it is followed, every index row is validated (bad ones are quarantined and
logged), and an index that is missing or lost its pages while slabs hold data is rebuilt
from the slabs' self-describing page headers (:mod:`~kvtier.backends.nvme_rebuild`).
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
from kvtier.backends.nvme_engines import (
    ENGINES,
    IoEngine,
    PageRead,
    PageWrite,
    kvikio_unavailable_reason,
)
from kvtier.backends.nvme_index import PageRow, StoreIndex, StoreLock
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_open import OpenedStore, open_store
from kvtier.backends.nvme_slabs import SlabFiles
from kvtier.backends.store_files import Modes, check_path_text

from kvtier.backend import BackendClosedError, Reservation, StoreBackend, check_buffers
from kvtier.errors import BackendUnavailableError, ConfigError, IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.log import get_logger
from kvtier.pageformat import encode_header, namespace_digest, verify_page


def _log() -> Any:
    """The module logger, looked up per use: a logger bound at import time would keep the
    logging configuration of that moment, not the one the application sets later."""
    return get_logger("kvtier.backends.nvme")


EngineName = Literal["posix", "kvikio", "auto"]
DEFAULT_SLAB_BYTES = 1 << 30
_CHECKSUM_AT = struct.Struct("<Q")  # payload checksum at byte 16 of the header


@dataclass
class _Pending:
    """A reserved slot: whose page it will hold and whether its bytes are written."""

    key: bytes
    namespace: str
    written: bool = False
    checksum: int = 0


def _check_key(key: Any, i: int) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise KVTierUsageError(
            f"key {i} must be {KEY_BYTES} bytes, got {type(key).__name__} "
            f"of length {len(key) if isinstance(key, bytes) else '?'}"
        )
    return key


_T = TypeVar("_T")
_R = TypeVar("_R")


def _split(items: Sequence[_T], parts: int) -> list[list[_T]]:
    """``items`` cut into at most ``parts`` contiguous, non-empty chunks."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out: list[list[_T]] = []
    start = 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _cause(exc: BaseException) -> str:
    """A short name for an error's cause, for log-once de-duplication."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


class NvmeStore(StoreBackend):
    """Slab files + SQLite index; see the module docstring for the guarantees."""

    default_io_threads: ClassVar[int] = 8

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        path: str | os.PathLike[str] | None = None,
        engine: str = "auto",
        direct_io: bool | str = "auto",
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        preallocate: bool = True,
        io_threads: int | None = None,
        group_access: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads, **options
        )
        if path is None or str(path) == "":
            raise ConfigError("nvme: option 'path' (the store directory) is required")
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"nvme: option 'path' must be a path, got {path!r}")
        if not isinstance(preallocate, bool):
            raise ConfigError(
                f"nvme: option 'preallocate' must be true or false, got {preallocate!r}"
            )
        self._modes = Modes.for_option(group_access, "nvme")
        if engine not in ("posix", "kvikio", "auto"):
            raise ConfigError(
                f"nvme: option 'engine' must be posix, kvikio or auto, got {engine!r}"
            )
        if direct_io not in (True, False, "auto"):
            raise ConfigError(
                f"nvme: option 'direct_io' must be true, false or 'auto', got {direct_io!r}"
            )
        if isinstance(slab_bytes, bool) or not isinstance(slab_bytes, int) or slab_bytes <= 0:
            raise ConfigError(
                f"nvme: option 'slab_bytes' must be a positive integer, got {slab_bytes!r}"
            )
        if engine == "kvikio":
            reason = kvikio_unavailable_reason()
            if reason is not None:
                raise BackendUnavailableError(f"nvme engine 'kvikio' is unavailable here: {reason}")
        self.path = check_path_text(path, "nvme: option 'path'")
        self.engine_name: str = (
            engine
            if engine != "auto"
            else ("kvikio" if kvikio_unavailable_reason() is None else "posix")
        )
        self._direct_opt = direct_io
        self._slab_opt = slab_bytes
        self._preallocate = preallocate
        self._reset_state()

    def _reset_state(self) -> None:
        self._lock: StoreLock | None = None
        self._index: StoreIndex | None = None
        self._slabs: SlabFiles | None = None
        self._engine: IoEngine | None = None
        self.layout: SlotLayout | None = None
        self.direct = False
        self.direct_reason: str | None = None
        self._entries: dict[bytes, PageRow] = {}
        self._reserved: dict[int, _Pending] = {}
        self._quarantined: dict[int, str] = {}
        self._free: list[int] = []
        self._hwm = 0
        self._ready_slabs: set[int] = set()
        self._slab_lock = asyncio.Lock()
        self._busy: Counter[int] = Counter()  # slot -> page I/O batches running on it
        self._free_after_io: set[int] = set()  # freed slots waiting for that I/O to end
        self._committing: dict[int, _Pending] = {}  # rows on their way into the index
        self._undeleted: set[int] = set()  # slots whose delete never reached the index
        self._accessed: dict[bytes, float] = {}
        self._commit_queue: list[
            tuple[list[tuple[int, _Pending]], asyncio.Future[dict[int, bool]]]
        ] = []
        self._commit_task: asyncio.Task[None] | None = None
        self._logged: set[str] = set()
        self._counters: Counter[str] = Counter()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self.recovery_seconds = 0.0
        self.recovered_pages = 0
        self.rebuilt_index = False
        self.dropped_index_rows = 0

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Open (creating or recovering) the store. Idempotent.

        Raises :class:`~kvtier.backends.nvme_index.NotAStoreError` (path is not a store),
        :class:`~kvtier.backends.nvme_index.StoreVersionError` (newer format),
        :class:`~kvtier.backends.nvme_index.StoreLockedError` (opened elsewhere),
        :class:`~kvtier.backends.nvme_index.StoreReadOnlyError` (cannot write),
        :class:`ConfigError` (page size differs from the store's, O_DIRECT required but
        unsupported).
        """
        if self._opened:
            return
        await super().open()
        try:
            await self.run_blocking(self._open_blocking)
        except BaseException:
            await super().close()  # waits for the open's thread, even when cancelled
            # Release what that thread took all the same (a cancelled open's lock).
            await asyncio.get_running_loop().run_in_executor(None, self._close_blocking, {})
            self._reset_state()
            raise

    def _open_blocking(self) -> None:
        start = time.perf_counter()
        opened = open_store(
            self.path,
            page_bytes=self.page_bytes,
            slab_bytes=self._slab_opt,
            capacity_pages=self.capacity_pages,
            engine=self.engine_name,
            direct_io=self._direct_opt,
            modes=self._modes,
        )
        try:
            engine = ENGINES[self.engine_name](opened.layout, opened.slabs)
        except BaseException:
            opened.close()
            raise
        self._lock, self._index, self._slabs, self._engine = (
            opened.lock,
            opened.index,
            opened.slabs,
            engine,
        )
        self.layout = opened.layout
        self.direct, self.direct_reason = opened.direct, opened.direct_reason
        self._recover(opened)
        self.recovery_seconds = time.perf_counter() - start

    def _recover(self, opened: OpenedStore) -> None:
        """Take the checked rows, quarantine and free slots :func:`open_store` found."""
        self._entries = {r.key: r for r in opened.rows}
        self._quarantined = dict(opened.quarantined)
        self._hwm = opened.hwm
        self._free = list(opened.free)
        heapq.heapify(self._free)
        self._ready_slabs = set(opened.ready_slabs)
        self.recovered_pages = len(opened.rows)
        self.rebuilt_index = opened.rebuilt is not None
        self.dropped_index_rows = opened.dropped_rows

    async def close(self) -> None:
        """Wait for calls in flight and pending commits, drop uncommitted reservations,
        release the store. Calls made once closing has begun raise
        :class:`~kvtier.backend.BackendClosedError`. A close cancelled while it waits
        leaves the store open (and closable again)."""
        if not self._opened or self._closing:
            return
        self._closing = True
        try:
            await self._idle.wait()
            if self._commit_task is not None:
                await asyncio.shield(self._commit_task)
        except BaseException:
            self._closing = False  # cancelled before anything was released: still open
            raise
        self._reserved.clear()
        accessed, self._accessed = self._accessed, {}
        try:
            await self.run_blocking(self._close_blocking, accessed)
        finally:
            await super().close()
            self._reset_state()

    def _close_blocking(self, accessed: dict[bytes, float]) -> None:
        try:
            if self._index is not None and accessed:
                self._index.touch(accessed)
        except Exception as exc:  # access times are advisory
            _log().warning("nvme.touch_failed", path=str(self.path), error=str(exc))
        if self._engine is not None:
            self._engine.close()
        if self._slabs is not None:
            self._slabs.close()
        if self._index is not None:
            self._index.close()
        if self._lock is not None:
            self._lock.release()

    # -- helpers -----------------------------------------------------------------------

    def _enter(self) -> None:
        """Start a call: refused once closing began; :meth:`close` waits for it."""
        self._check_open()
        if self._closing:
            raise BackendClosedError(f"NvmeStore {self.path} is closing")
        self._active += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._active -= 1
        if not self._active:
            self._idle.set()

    def _log_once(self, cause: str, event: str, **fields: Any) -> None:
        """Log an error the first time its cause is seen (counted every time)."""
        self._counters[f"errors.{event}"] += 1
        if cause in self._logged:
            return
        self._logged.add(cause)
        _log().error(event, path=str(self.path), cause=cause, **fields)

    def _alloc_slot(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        slot = self._hwm
        self._hwm += 1
        return slot

    def _free_slot(self, slot: int) -> None:
        if self._busy[slot]:
            self._free_after_io.add(slot)
        else:
            heapq.heappush(self._free, slot)

    async def _slot_io(
        self, fn: Callable[[list[_T]], _R], groups: list[list[_T]], slots: Sequence[int]
    ) -> list[_R]:
        """Run ``fn`` on each group on the worker pool, with ``slots`` busy until every
        thread is done.

        A worker thread cannot be stopped: when the caller is cancelled its page I/O runs
        on, so the slots stay busy (a slot freed meanwhile is handed out only after that
        I/O ends) and :meth:`close` waits for it, not just for the caller.
        """
        for slot in slots:
            self._busy[slot] += 1
        self._active += 1
        self._idle.clear()
        io = asyncio.gather(*(self.run_blocking(fn, g) for g in groups))

        def done(fut: asyncio.Future[list[_R]]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved, for when the caller is gone
            for slot in slots:
                self._busy[slot] -= 1
                if not self._busy[slot]:
                    del self._busy[slot]
                    if slot in self._free_after_io:
                        self._free_after_io.discard(slot)
                        heapq.heappush(self._free, slot)
            self._exit()

        io.add_done_callback(done)
        return await asyncio.shield(io)

    def _release(self, slot: int) -> None:
        if self._reserved.pop(slot, None) is not None:
            self._free_slot(slot)

    def _ensure_slabs(self, slabs: list[int]) -> dict[int, BaseException]:
        assert self._slabs is not None
        failed: dict[int, BaseException] = {}
        for slab in slabs:
            try:
                self._slabs.ensure(slab, self._preallocate)
            except OSError as exc:
                failed[slab] = exc
        return failed

    # -- the keyed, two-phase interface ------------------------------------------------

    def used_pages(self) -> int:
        """Slots taken: committed, reserved, being committed, quarantined, freed but
        still under running I/O, or deleted here but not in the index (until reopen)."""
        return (
            len(self._entries)
            + len(self._reserved)
            + len(self._committing)
            + len(self._quarantined)
            + len(self._free_after_io)
            + len(self._undeleted)
        )

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        self._enter()
        try:
            return await self._reserve(keys, namespace)
        finally:
            self._exit()

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit as one call (``close`` waits for all of it). A put
        cancelled part-way gives back the space of the pages it had not committed."""
        self._enter()
        reservations: list[Reservation | None] = []
        try:
            bufs = check_buffers(data, len(keys), self.page_bytes)
            reservations = await self._reserve(keys, namespace)
            ok = [False] * len(keys)
            taken = [(i, r) for i, r in enumerate(reservations) if r is not None]
            if not taken:
                return ok
            written = await self._write([r for _, r in taken], [bufs[i] for i, _ in taken])
            self._abort_now([r for (_, r), w in zip(taken, written, strict=True) if not w])
            to_commit = [(i, r) for (i, r), w in zip(taken, written, strict=True) if w]
            if to_commit:
                committed = await self._commit([r for _, r in to_commit])
                for (i, _), c in zip(to_commit, committed, strict=True):
                    ok[i] = c
            return ok
        except BaseException:
            self._abort_now(reservations)
            raise
        finally:
            self._exit()

    async def _reserve(self, keys: Sequence[PageKey], namespace: str) -> list[Reservation | None]:
        assert self.layout is not None
        out: list[Reservation | None] = []
        needed: dict[int, list[int]] = {}
        first: dict[bytes, int] = {}  # a key repeated in one batch shares one slot
        for i, key in enumerate(keys):
            k = _check_key(key, i)
            row = self._entries.get(k)
            if row is not None:
                out.append(Reservation(PageKey(k), row.slot, present=True))
                continue
            if k in first:
                twin = out[first[k]]
                out.append(twin)
                if twin is not None and self.layout.locate(twin.handle)[0] in needed:
                    needed[self.layout.locate(twin.handle)[0]].append(i)
                continue
            first[k] = i
            if self.used_pages() >= self.capacity_pages:
                self._counters["reserve_full"] += 1
                out.append(None)
                continue
            slot = self._alloc_slot()
            self._reserved[slot] = _Pending(k, namespace)
            slab = self.layout.locate(slot)[0]
            if slab not in self._ready_slabs:
                needed.setdefault(slab, []).append(i)
            out.append(Reservation(PageKey(k), slot))
        if needed:
            try:
                async with self._slab_lock:
                    todo = sorted(s for s in needed if s not in self._ready_slabs)
                    failed = await self.run_blocking(self._ensure_slabs, todo) if todo else {}
            except BaseException:
                self._abort_now(out)  # cancelled: the caller never sees these slots
                raise
            for slab, exc in failed.items():
                self._log_once(
                    f"slab:{_cause(exc)}", "nvme.slab_allocation_failed", slab=slab, error=str(exc)
                )
                for i in needed[slab]:
                    r = out[i]
                    assert r is not None
                    self._release(r.handle)
                    out[i] = None
            self._ready_slabs.update(s for s in needed if s not in failed)
        return out

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        self._enter()
        try:
            return await self._write(reservations, data)
        finally:
            self._exit()

    async def _write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        ok = [False] * len(reservations)
        jobs: list[tuple[int, int, _Pending, np.ndarray]] = []
        twins: dict[int, list[int]] = {}
        for i, (r, buf) in enumerate(zip(reservations, bufs, strict=True)):
            if r.present:
                ok[i] = True
                continue
            pending = self._reserved.get(r.handle)
            if pending is None or pending.key != bytes(r.key):
                continue  # aborted, committed or unknown reservation
            if r.handle in twins:
                twins[r.handle].append(i)  # same slot twice in one batch: write it once
                continue
            twins[r.handle] = []
            jobs.append((i, r.handle, pending, buf))
        if not jobs:
            return ok
        assert self._engine is not None
        groups = _split(jobs, self.io_threads) if self._engine.splits_batches else [jobs]
        results = await self._slot_io(self._write_blocking, groups, [j[1] for j in jobs])
        for group, res in zip(groups, results, strict=True):
            for (i, slot, job_pending, _), (checksum, err) in zip(group, res, strict=True):
                if err is None:
                    if job_pending is self._reserved.get(slot):
                        job_pending.written, job_pending.checksum = True, checksum
                        ok[i] = True
                        for j in twins[slot]:
                            ok[j] = True
                        self._counters["pages_written"] += 1
                        self._counters["bytes_written"] += self.page_bytes
                else:
                    slab, offset = self.layout.locate(slot) if self.layout else (-1, -1)
                    self._log_once(
                        f"write:{_cause(err)}",
                        "nvme.write_failed",
                        key=job_pending.key.hex(),
                        slab=slab,
                        offset=offset,
                        error=str(err),
                    )
        return ok

    def _write_blocking(
        self, jobs: list[tuple[int, int, _Pending, np.ndarray]]
    ) -> list[tuple[int, BaseException | None]]:
        assert self._engine is not None and self.layout is not None
        items: list[PageWrite] = []
        sums: list[int] = []
        for _, slot, pending, buf in jobs:
            header = encode_header(pending.key, pending.namespace, buf)
            sums.append(_CHECKSUM_AT.unpack_from(header, 16)[0])
            slab, offset = self.layout.locate(slot)
            items.append(PageWrite(slab, offset, buf, header))
        return list(zip(sums, self._engine.write_batch(items), strict=True))

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self._enter()
        try:
            return await self._commit(reservations)
        finally:
            self._exit()

    async def _commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        ok = [False] * len(reservations)
        batch: list[tuple[int, _Pending]] = []
        where: list[tuple[int, int]] = []
        queued_slots: set[int] = set()
        for i, r in enumerate(reservations):
            if r.present:
                ok[i] = bytes(r.key) in self._entries
                continue
            pending = self._reserved.get(r.handle)
            if pending is None or pending.key != bytes(r.key):
                continue
            where.append((i, r.handle))
            if r.handle in queued_slots:
                continue  # the same reservation twice in one call: commit it once
            if not pending.written:
                self._release(r.handle)
                continue
            queued_slots.add(r.handle)
            batch.append((r.handle, pending))
        if not batch:
            return ok
        fut: asyncio.Future[dict[int, bool]] = asyncio.get_running_loop().create_future()
        self._commit_queue.append((batch, fut))
        if self._commit_task is None:
            self._commit_task = asyncio.create_task(self._commit_runner())
        done = await fut
        for i, slot in where:
            ok[i] = done.get(slot, False)
        return ok

    async def _commit_runner(self) -> None:
        """Group commit: drain every queued commit into one fsync pass + one transaction."""
        queued: list[tuple[list[tuple[int, _Pending]], asyncio.Future[dict[int, bool]]]] = []
        try:
            while self._commit_queue:
                queued, self._commit_queue = self._commit_queue, []
                results: dict[int, bool] = {}
                rows: list[PageRow] = []
                seen: set[bytes] = set()
                row_slots: set[int] = set()
                now = time.time()
                assert self.layout is not None
                for batch, _ in queued:
                    for slot, pending in batch:
                        if slot in results or slot in row_slots:
                            continue  # committed twice concurrently: once is enough
                        if self._reserved.get(slot) is not pending:
                            results[slot] = False
                        elif pending.key in self._entries or pending.key in seen:
                            results[slot] = True  # same key committed already: no-op
                            self._release(slot)
                        else:
                            # From here abort cannot touch it: the row is in flight.
                            self._committing[slot] = self._reserved.pop(slot)
                            seen.add(pending.key)
                            row_slots.add(slot)
                            slab, offset = self.layout.locate(slot)
                            rows.append(
                                PageRow(
                                    pending.key,
                                    slot,
                                    slab,
                                    offset,
                                    self.page_bytes,
                                    pending.checksum,
                                    pending.namespace,
                                    now,
                                )
                            )
                error: BaseException | None = None
                if rows:
                    try:
                        await self.run_blocking(self._durable_commit, rows)
                    except Exception as exc:
                        error = exc
                        self._log_once(
                            f"commit:{_cause(exc)}",
                            "nvme.commit_failed",
                            pages=len(rows),
                            error=str(exc),
                        )
                for row in rows:
                    del self._committing[row.slot]
                    if error is None:
                        self._entries[row.key] = row
                    else:
                        self._free_slot(row.slot)
                    results[row.slot] = error is None
                if rows and error is None:
                    self._counters["group_commits"] += 1
                    self._counters["pages_committed"] += len(rows)
                for _, fut in queued:
                    if not fut.done():
                        fut.set_result(results)
        except BaseException as exc:
            # Never leave a committer waiting: whatever broke the runner reaches them.
            for _, fut in [*queued, *self._commit_queue]:
                if not fut.done():
                    fut.set_exception(exc)
            self._commit_queue = []
            raise
        finally:
            self._commit_task = None

    def _durable_commit(self, rows: list[PageRow]) -> None:
        assert self._slabs is not None and self._index is not None
        assert self._engine is not None
        if not self._engine.durable_writes:
            self._slabs.sync(r.slab for r in rows)
        self._index.insert(rows)

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self._check_open()
        self._abort_now(reservations)

    def _abort_now(self, reservations: Sequence[Reservation | None]) -> None:
        """Release the reservations still open (not committed, not being committed)."""
        for r in reservations:
            if r is not None and not r.present:
                pending = self._reserved.get(r.handle)
                if pending is not None and pending.key == bytes(r.key):
                    self._release(r.handle)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        self._enter()
        try:
            return await self._get(keys, out)
        finally:
            self._exit()

    async def _get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        ok = [False] * len(keys)
        jobs: list[tuple[int, PageRow, np.ndarray]] = []
        for i, key in enumerate(keys):
            row = self._entries.get(_check_key(key, i))
            if row is None:
                self._counters["misses"] += 1
                continue
            jobs.append((i, row, bufs[i]))
        if not jobs:
            return ok
        assert self._engine is not None
        groups = _split(jobs, self.io_threads) if self._engine.splits_batches else [jobs]
        results = await self._slot_io(self._read_blocking, groups, [row.slot for _, row, _ in jobs])
        bad: list[tuple[PageRow, BaseException]] = []
        now = time.time()
        for group, res in zip(groups, results, strict=True):
            for (i, row, _), err in zip(group, res, strict=True):
                if err is None:
                    ok[i] = True
                    self._accessed[row.key] = now
                    self._counters["hits"] += 1
                    self._counters["bytes_read"] += self.page_bytes
                else:
                    self._counters["misses"] += 1
                    bad.append((row, err))
        if bad:
            await self._quarantine(bad)
        return ok

    def _read_blocking(
        self, jobs: list[tuple[int, PageRow, np.ndarray]]
    ) -> list[BaseException | None]:
        assert self._engine is not None
        items = [PageRead(row.slab, row.offset, buf) for _, row, buf in jobs]
        out: list[BaseException | None] = []
        for (_, row, buf), res in zip(jobs, self._engine.read_batch(items), strict=True):
            if isinstance(res, FileNotFoundError):
                # Unlike an I/O error this never heals: the page is gone (quarantined),
                # not kept as present forever, which would refuse every put of it again.
                out.append(IntegrityError(f"slab file {row.slab} is missing"))
                continue
            if isinstance(res, BaseException):
                out.append(res)
                continue
            try:
                header = verify_page(res, row.key, buf)
                if header.checksum != row.checksum:
                    raise IntegrityError("payload checksum differs from the index")
                if header.namespace_digest != namespace_digest(row.namespace):
                    raise IntegrityError(f"page header namespace differs from {row.namespace!r}")
                out.append(None)
            except IntegrityError as exc:
                out.append(exc)
        return out

    async def _quarantine(self, bad: list[tuple[PageRow, BaseException]]) -> None:
        """Drop pages that failed verification from the index and take their slots out of
        service; pages that met an I/O error are only counted and logged."""
        entries: list[tuple[int, bytes | None, str]] = []
        for row, err in bad:
            if not isinstance(err, IntegrityError):
                # An I/O error says nothing about the bytes on disk: a miss this time, the
                # page stays (a later read may succeed), the cause is logged once.
                self._log_once(
                    f"read:{_cause(err)}",
                    "nvme.read_failed",
                    key=row.key.hex(),
                    slab=row.slab,
                    offset=row.offset,
                    error=str(err),
                )
                self._counters["io_errors"] += 1
                continue
            kind = "integrity"
            self._counters["integrity_errors"] += 1
            _log().error(
                "nvme.page_unreadable",
                path=str(self.path),
                key=row.key.hex(),
                slab=row.slab,
                offset=row.offset,
                error=str(err),
                kind=kind,
            )
            if self._entries.get(row.key) is row:
                del self._entries[row.key]
                self._quarantined[row.slot] = str(err)
                entries.append((row.slot, row.key, str(err)))
        if entries:
            assert self._index is not None
            try:
                await self.run_blocking(self._index.quarantine, entries)
            except Exception as exc:
                self._log_once(
                    f"quarantine:{_cause(exc)}", "nvme.quarantine_failed", error=str(exc)
                )

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [_check_key(k, i) in self._entries for i, k in enumerate(keys)]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        self._enter()
        try:
            return await self._delete(keys)
        finally:
            self._exit()

    async def _delete(self, keys: Sequence[PageKey]) -> list[bool]:
        gone: list[PageRow] = []
        ok = []
        for i, key in enumerate(keys):
            row = self._entries.pop(_check_key(key, i), None)
            ok.append(row is not None)
            if row is not None:
                gone.append(row)
                self._accessed.pop(row.key, None)
        if gone:
            assert self._index is not None
            try:
                await self.run_blocking(self._index.delete, [r.key for r in gone])
            except Exception as exc:
                # The rows stay on disk (and come back on reopen); their slots stay taken.
                self._log_once(f"delete:{_cause(exc)}", "nvme.delete_failed", error=str(exc))
                self._counters["slots_leaked_until_reopen"] += len(gone)
                self._undeleted.update(r.slot for r in gone)
                return ok
            for row in gone:
                self._free_slot(row.slot)
        return ok

    async def keys(self) -> list[PageKey]:
        self._check_open()
        return [PageKey(k) for k in self._entries]

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            {
                "path": str(self.path),
                "engine": self.engine_name,
                "direct_io": self.direct,
                "direct_io_reason": self.direct_reason,
                "write_durability": (
                    None
                    if self._engine is None
                    else "RWF_DSYNC per write"
                    if self._engine.durable_writes
                    else "fdatasync per commit"
                ),
                "committed_pages": len(self._entries),
                "reserved_pages": len(self._reserved),
                "quarantined_slots": len(self._quarantined),
                "recovered_pages": self.recovered_pages,
                "recovery_seconds": self.recovery_seconds,
                "index_rebuilt_at_open": self.rebuilt_index,
                "index_rows_dropped_at_open": self.dropped_index_rows,
                "slot_bytes": self.layout.slot_bytes if self.layout else None,
                "slabs": len(self._ready_slabs),
            }
        )
        out.update(dict(self._counters))
        return out
