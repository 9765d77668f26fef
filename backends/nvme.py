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
* **Faults.** A full disk or an I/O error fails the pages of the calls it meets, is
  logged once per cause, and leaves the store consistent: ``False`` from ``write`` and
  ``get``; a slab file that cannot be allocated, or an index transaction that fails,
  makes ``reserve`` / ``commit`` raise :class:`~kvtier.errors.TierIOError` (the tier is
  marked failing, not full) and ``put`` answer ``False``. A read that meets an I/O error
  (rather than bad bytes) keeps the page, since a later read may succeed (a missing slab
  file is not such an error: its pages are quarantined like bad bytes). A ``delete``
  whose index rows cannot be removed answers ``False`` and keeps the pages (readable,
  counted): they are still on disk and would come back on reopen.
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
  fixed when a store is created). The last slab the capacity reaches holds only the slots
  left, and grows when the store is reopened with more capacity: the slabs never take
  more than ``capacity_pages`` slots (beyond the slots of pages kept from a larger
  capacity). A tier's ``capacity_pages`` counts slots (:meth:`page_footprint`: the page,
  its 64-byte header and the padding to 4 KiB), so a tier takes at most its capacity.
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
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from kvtier.backends.nvme_engines import (
    PageWrite,
)
from kvtier.backends.nvme_index import PageRow

from kvtier.backend import Reservation, check_buffers
from kvtier.keys import PageKey
from kvtier.pageformat import encode_header

from .nvme_base import (
    CHECKSUM_AT,
    DEFAULT_SLAB_BYTES,
    EngineName,
    Pending,
    cause,
    check_key,
    commit_failure,
    slab_failure,
    split,
)
from .nvme_reads import NvmeReads

__all__ = ["DEFAULT_SLAB_BYTES", "EngineName", "NvmeStore"]


class NvmeStore(NvmeReads):
    """Slab files + SQLite index; see the module docstring for the guarantees."""

    # -- the keyed, two-phase interface ------------------------------------------------

    def used_pages(self) -> int:
        """Slots taken: committed, reserved, being committed, quarantined, freed but
        still under running I/O, or deleted here but not in the index (until reopen)."""
        return (
            len(self._entries)
            + len(self._reserved)
            + len(self._committing)
            + len(self._quarantined)
            + self._slots.draining
            + len(self._undeleted)
        )

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """A slot per key, ``None`` at capacity; a slab not allocated raises TierIOError."""
        self._enter()
        try:
            out, failed = await self._reserve(keys, namespace)
            if failed:
                self._abort_now(out)
                raise slab_failure(self.path, failed, len(keys))
            return out
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
            reservations, _ = await self._reserve(keys, namespace)  # failed slabs: False
            ok = [False] * len(keys)
            taken = [(i, r) for i, r in enumerate(reservations) if r is not None]
            if not taken:
                return ok
            written = await self._write([r for _, r in taken], [bufs[i] for i, _ in taken])
            self._abort_now([r for (_, r), w in zip(taken, written, strict=True) if not w])
            to_commit = [(i, r) for (i, r), w in zip(taken, written, strict=True) if w]
            if to_commit:
                committed, _ = await self._commit([r for _, r in to_commit])
                for (i, _), c in zip(to_commit, committed, strict=True):
                    ok[i] = c
            return ok
        except BaseException:
            self._abort_now(reservations)
            raise
        finally:
            self._exit()

    async def _reserve(
        self, keys: Sequence[PageKey], namespace: str
    ) -> tuple[list[Reservation | None], dict[int, BaseException]]:
        """Slots for ``keys`` (``None``: at capacity, or in a slab that could not be
        allocated) and the slabs that could not be allocated, with the error."""
        assert self.layout is not None
        out: list[Reservation | None] = []
        needed: dict[int, list[int]] = {}  # slab -> batch positions past its file's end
        reach: dict[int, int] = {}  # slab -> the furthest slot of it this batch takes
        first: dict[bytes, int] = {}  # a key repeated in one batch shares one slot
        for i, key in enumerate(keys):
            k = check_key(key, i)
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
            self._reserved[slot] = Pending(k, namespace)
            slab, within = divmod(slot, self.layout.slots_per_slab)
            if within >= self._slab_slots.get(slab, 0):
                needed.setdefault(slab, []).append(i)
                reach[slab] = max(reach.get(slab, 0), within)
            out.append(Reservation(PageKey(k), slot))
        failed: dict[int, BaseException] = {}
        if needed:
            try:
                async with self._slab_lock:
                    targets = {s: self._slab_target(s, w) for s, w in sorted(reach.items())}
                    todo = {s: n for s, n in targets.items() if n > self._slab_slots.get(s, 0)}
                    failed = await self.run_blocking(self._ensure_slabs, todo) if todo else {}
                    for s, n in todo.items():
                        if s not in failed:
                            self._slab_slots[s] = max(n, self._slab_slots.get(s, 0))
            except BaseException:
                self._abort_now(out)  # cancelled: the caller never sees these slots
                raise
            for slab, exc in failed.items():
                self._log_once(
                    f"slab:{cause(exc)}", "nvme.slab_allocation_failed", slab=slab, error=str(exc)
                )
                for i in needed[slab]:
                    r = out[i]
                    assert r is not None
                    self._release(r.handle)
                    out[i] = None
        return out, failed

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        self._enter()
        try:
            return await self._write(reservations, data)
        finally:
            self._exit()

    async def _write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        ok = [False] * len(reservations)
        jobs: list[tuple[int, int, Pending, np.ndarray]] = []
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
        groups = split(jobs, self.io_threads) if self._engine.splits_batches else [jobs]
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
                        f"write:{cause(err)}",
                        "nvme.write_failed",
                        key=job_pending.key.hex(),
                        slab=slab,
                        offset=offset,
                        error=str(err),
                    )
        return ok

    def _write_blocking(
        self, jobs: list[tuple[int, int, Pending, np.ndarray]]
    ) -> list[tuple[int, BaseException | None]]:
        assert self._engine is not None and self.layout is not None
        items: list[PageWrite] = []
        sums: list[int] = []
        for _, slot, pending, buf in jobs:
            header = encode_header(pending.key, pending.namespace, buf)
            sums.append(CHECKSUM_AT.unpack_from(header, 16)[0])
            slab, offset = self.layout.locate(slot)
            items.append(PageWrite(slab, offset, buf, header))
        return list(zip(sums, self._engine.write_batch(items), strict=True))

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Publish written pages (group commit); an index transaction that fails raises
        :class:`~kvtier.errors.TierIOError` (those pages not committed, slots free)."""
        self._enter()
        try:
            ok, error = await self._commit(reservations)
            if error is not None:
                raise commit_failure(self.path, error, ok.count(False)) from error
            return ok
        finally:
            self._exit()

    async def _commit(
        self, reservations: Sequence[Reservation]
    ) -> tuple[list[bool], BaseException | None]:
        """``True`` per committed page, and why the index transaction failed if it did."""
        ok = [False] * len(reservations)
        batch: list[tuple[int, Pending]] = []
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
            return ok, None
        fut: asyncio.Future[dict[int, bool]] = asyncio.get_running_loop().create_future()
        self._commit_queue.append((batch, fut))
        if self._commit_task is None:
            self._commit_task = asyncio.create_task(self._commit_runner())
        try:
            done = await fut
        finally:
            errors = [self._commit_errors.pop(slot, None) for slot, _ in batch]
        for i, slot in where:
            ok[i] = done.get(slot, False)
        return ok, next((e for e in errors if e is not None), None)

    async def _commit_runner(self) -> None:
        """Group commit: drain every queued commit into one fsync pass + one transaction."""
        queued: list[tuple[list[tuple[int, Pending]], asyncio.Future[dict[int, bool]]]] = []
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
                            f"commit:{cause(exc)}",
                            "nvme.commit_failed",
                            pages=len(rows),
                            error=str(exc),
                        )
                for row in rows:
                    del self._committing[row.slot]
                    if error is None:
                        self._entries[row.key] = row
                        self._commit_errors.pop(row.slot, None)  # a cancelled waiter's
                    else:
                        self._free_slot(row.slot)
                        self._commit_errors[row.slot] = error
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
        self._slabs.check_still_there(r.slab for r in rows)
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

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [check_key(k, i) in self._entries for i, k in enumerate(keys)]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        self._enter()
        try:
            return await self._delete(keys)
        finally:
            self._exit()

    async def _delete(self, keys: Sequence[PageKey]) -> list[bool]:
        gone: list[tuple[int, PageRow]] = []
        ok = []
        for i, key in enumerate(keys):
            row = self._entries.pop(check_key(key, i), None)
            ok.append(row is not None)
            if row is not None:
                gone.append((i, row))
                self._accessed.pop(row.key, None)
        if gone:
            assert self._index is not None
            try:
                await self.run_blocking(self._index.delete, [r.key for _, r in gone])
            except Exception as exc:
                # The rows stay on disk (and come back on reopen): the pages are still
                # held, and still read. Answer False, so that the caller keeps them
                # indexed and deletes them again later (True made the cache forget pages
                # this store still counts and brings back).
                self._log_once(f"delete:{cause(exc)}", "nvme.delete_failed", error=str(exc))
                for i, row in gone:
                    if self._entries.setdefault(row.key, row) is row:
                        ok[i] = False
                    else:  # committed again meanwhile, in another slot
                        self._counters["slots_leaked_until_reopen"] += 1
                        self._undeleted.add(row.slot)
                return ok
            for _, row in gone:
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
                "slabs": len(self._slab_slots),
            }
        )
        out.update(dict(self._counters))
        return out
