"""A simple directory store: one file per page, the stand-in lower tier.

Layout under ``path``::

    <path>/<hex[:2]>/<hex>     a committed page: 64-byte header + payload
    <path>/.tmp/<n>-<hex>      a page written but not yet committed
    <path>/.lock               flock'ed by the one store object that has it open

``hex`` is the 32-digit hex form of the page key. A page is written to ``.tmp`` by
:meth:`FileStore.write` and moved into place with ``os.replace`` by
:meth:`FileStore.commit`, so a page is never visible (to this process or to a reopened
store) before commit, and a crash leaves either the whole page or nothing. Every read
verifies the header and payload checksum (:mod:`kvtier.pageformat`); a page that does not
verify is a miss, counted in :meth:`FileStore.stats`, logged with its key and path, and
its file is removed. Opening a directory indexes the pages already there, so a reopened
store still has them; leftovers in ``.tmp`` are removed.

Variable-length blobs (:attr:`~kvtier.backend.StoreBackend.variable_length`): a blob
written with :meth:`FileStore.write_blobs` is a file of ``64 + n`` bytes whose header
records ``n``; :meth:`FileStore.get_sized` reads it back, plain ``get`` serves only whole
pages (a shorter file is a miss there, removed like a damaged page).

Durability: with ``fsync=False`` (the default) a committed page survives a process crash
but not necessarily a power loss; ``fsync=True`` syncs each page and its directory before
commit returns. One store object (in one process) at a time may open a directory: a
second opener gets :class:`~kvtier.backends.nvme_index.StoreLockedError`.

Privacy and safety (:mod:`~kvtier.backends.store_files`): files are created ``0600`` and
directories ``0700`` whatever the umask (``group_access`` widens them to ``0660`` /
``0770``); no symlink inside the store is followed (a planted ``.lock``, ``.tmp``,
sub-directory or page symlink is refused at open with
:class:`~kvtier.backends.store_files.UnsafeStoreError`, and a page symlink planted later is
a miss); a path the OS refuses (a file, a missing or read-only parent, a name too long, a
NUL byte) raises :class:`~kvtier.backends.store_files.StorePathError` naming it.

The full NVMe tier (slab files, O_DIRECT, an SQLite index) is ``kvtier.backends.nvme``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from kvtier.backends.nvme_engines import preadv_all
from kvtier.backends.store_files import (
    UnsafeStoreError,
    open_private,
    private_dir,
)

from kvtier.backend import Reservation, check_blobs, check_buffers
from kvtier.errors import IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

from .filestore_base import (
    FAN_OUT_MIN_BYTES,
    TMP_SUFFIX,
    FileStoreBase,
    Pending,
    fsync_dir,
    log_file_error,
    unlink_all,
)

_log = logging.getLogger(__name__)

__all__ = ["FAN_OUT_MIN_BYTES", "FileStore"]


class FileStore(FileStoreBase):
    """Pages as files in a directory (see module docstring).

    Options:
        path: the directory (created if missing, private). Required.
        fsync: sync each page to stable storage before commit returns (default False).
        io_threads: worker threads (default 4).
        group_access: files 0660 / directories 0770 instead of 0600 / 0700.

    Persistent: committed pages are there again after close and reopen.
    """

    #: a cancelled ``get`` raises only once its read threads returned (``run_blocking``
    #: and ``run_blocking_chunks`` wait for them)
    get_finishes_before_raising: ClassVar[bool] = True

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """Room for each key while committed + reserved pages < capacity (else ``None``).
        A committed key gets a ``present`` reservation. Raises
        :class:`~kvtier.errors.KVTierUsageError` for a key that is not 16 bytes (it names
        the file)."""
        self._check_open()
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise KVTierUsageError(
                    f"key {i} must be {KEY_BYTES} bytes (a PageKey), got {key!r:.60}"
                )
        out: list[Reservation | None] = []
        for key in keys:
            if key in self._index:
                out.append(Reservation(key, -1, present=True))
                continue
            if self.used_pages() >= self.capacity_pages:
                out.append(None)
                continue
            handle = self._next_handle
            self._next_handle += 1
            tmp = self.path / TMP_SUFFIX / f"{handle}-{bytes(key).hex()}"
            self._pending[handle] = Pending(key, namespace, tmp)
            out.append(Reservation(key, handle))
        return out

    def _live(self, r: Reservation) -> Pending | None:
        p = self._pending.get(r.handle)
        return p if p is not None and p.key == r.key else None

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Write each page with its header to its temp file (one hop for the batch)."""
        self._check_open()
        return await self._write(reservations, check_buffers(data, len(reservations),
                                                             self.page_bytes))  # fmt: skip

    async def write_blobs(
        self, reservations: Sequence[Reservation], blobs: Sequence[Any]
    ) -> list[bool]:
        """:meth:`write` for blobs of 1 to ``page_bytes`` bytes (read back with
        :meth:`get_sized`)."""
        self._check_open()
        return await self._write(reservations, check_blobs(blobs, len(reservations),
                                                           self.page_bytes))  # fmt: skip

    async def _write(
        self, reservations: Sequence[Reservation], bufs: list[np.ndarray]
    ) -> list[bool]:
        ok = [False] * len(reservations)
        jobs: list[tuple[int, Pending, np.ndarray]] = []
        for i, (r, buf) in enumerate(zip(reservations, bufs, strict=True)):
            if r.present:
                ok[i] = True
            elif (p := self._live(r)) is not None:
                jobs.append((i, p, buf))
        if jobs:
            results = await self.run_blocking_chunks(self.write_files, jobs)
            for (i, p, _), res in zip(jobs, results, strict=True):
                ok[i] = res
                p.written = res
                self._counters["write_errors"] += not res
        return ok

    def _open_tmp(self, tmp: Path) -> int:
        """Create ``tmp`` to write a page into. When ``.tmp`` is gone but the store's
        directory is there (removed, then made again by an operator), ``.tmp`` is made
        again first: the store takes pages again instead of failing every write until it
        is reopened. A store directory that is gone stays gone (the write fails)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            return open_private(tmp, flags, self.modes, self.path)
        except FileNotFoundError:
            if not os.path.isdir(self.path) or os.path.islink(self.path):
                raise
            private_dir(tmp.parent, self.modes, self.path)
            return open_private(tmp, flags, self.modes, self.path)

    def write_files(self, jobs: list[tuple[int, Pending, np.ndarray]]) -> list[bool]:
        out: list[bool] = []
        for _, p, buf in jobs:
            try:
                header = encode_header(p.key, p.namespace, buf)
                fd = self._open_tmp(p.tmp)
                try:
                    want = HEADER_SIZE + buf.nbytes
                    done = os.writev(fd, [header, buf.data])
                    if done != want:  # a short write: finish it
                        rest = memoryview(header + buf.tobytes())[done:]
                        while rest:
                            n = os.write(fd, rest)
                            rest = rest[n:]
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                out.append(True)
            except OSError as exc:
                log_file_error(
                    f"{self.path}:write",
                    "file store: write of %s to %s failed: %s",
                    p.key.hex(),
                    p.tmp,
                    exc,
                )
                out.append(False)
        return out

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Move written pages into place (one hop). ``False`` (space released) for a
        reservation that was not written or whose move failed."""
        self._check_open()
        ok = [False] * len(reservations)
        jobs: list[tuple[int, Pending]] = []
        for i, r in enumerate(reservations):
            if r.present:
                ok[i] = r.key in self._index
                continue
            p = self._live(r)
            if p is None:
                continue
            del self._pending[r.handle]
            if r.key in self._index or not p.written:
                # committed meanwhile by another reservation (equal bytes), or never written
                ok[i] = r.key in self._index
                jobs.append((-1, p))
            else:
                jobs.append((i, p))
        if jobs:
            results = await self.run_blocking(self.commit_files, jobs)
            for (i, p), res in zip(jobs, results, strict=True):
                if i >= 0 and res:
                    self._index[p.key] = next(self._stamps)
                    ok[i] = True
                elif i >= 0:
                    self._counters["write_errors"] += 1
        return ok

    def commit_files(self, jobs: list[tuple[int, Pending]]) -> list[bool]:
        """Rename each written page into place (``-1`` jobs: drop the temp file); with
        ``fsync``, then make the names durable. A page whose directory cannot be synced
        is not committed: its file is removed and it answers ``False``."""
        out: list[bool] = []
        placed: dict[Path, list[int]] = {}  # directory -> indexes into out of its pages
        for i, p in jobs:
            if i < 0:
                unlink_all([p.tmp])
                out.append(False)
                continue
            final = self.page_path(p.key)
            try:
                # Never a symlink (UnsafeStoreError is an OSError: the page fails).
                private_dir(final.parent, self.modes, self.path)
                os.replace(p.tmp, final)
                placed.setdefault(final.parent, []).append(len(out))
                out.append(True)
            except OSError as exc:
                log_file_error(
                    f"{self.path}:commit",
                    "file store: commit of %s to %s failed: %s",
                    p.key.hex(),
                    final,
                    exc,
                )
                unlink_all([p.tmp])
                out.append(False)
        if self.fsync:
            for d, at in placed.items():
                try:
                    fsync_dir(d)
                except OSError as exc:
                    _log.warning("file store: fsync of %s failed, %d pages not committed: %s",
                                 d, len(at), exc)  # fmt: skip
                    unlink_all([self.page_path(jobs[j][1].key) for j in at])
                    for j in at:
                        out[j] = False
        return out

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        """Release reservations and remove their temp files (one hop)."""
        self._check_open()
        tmps: list[Path] = []
        for r in reservations:
            if not r.present and (p := self._live(r)) is not None:
                del self._pending[r.handle]
                tmps.append(p.tmp)
        if tmps:
            await self.run_blocking(unlink_all, tmps)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read and verify committed pages into ``out`` (one hop). A page that fails
        verification is a miss: counted, logged and its file removed (a second hop),
        unless the key was committed again while the read was out."""
        got = await self._get(keys, out, sized=False)
        return [n is not None for n in got]

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        """Read committed blobs (whole pages or shorter ones from :meth:`write_blobs`)
        into the start of ``out``; each one's length, or ``None`` for a miss. Verified,
        counted and removed when damaged exactly as in :meth:`get`."""
        return await self._get(keys, out, sized=True)

    async def _get(self, keys: Sequence[PageKey], out: Sequence[Any], sized: bool
                   ) -> list[int | None]:  # fmt: skip
        self._check_open()
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        ok: list[int | None] = [None] * len(keys)
        stamps = {k: self._index[k] for k in keys if k in self._index}
        jobs = [(i, k, bufs[i]) for i, k in enumerate(keys) if k in stamps]
        if not jobs:
            return ok
        results = await self.run_blocking_chunks(
            self._read_blobs if sized else self.read_files, jobs
        )
        damaged: list[Path] = []
        for (i, key, _), (res, length) in zip(jobs, results, strict=True):
            if res == "ok":
                ok[i] = length
                continue
            if res == "bad":
                self._counters["checksum_failures"] += 1
            else:
                self._counters["read_errors"] += 1
            if res in ("bad", "gone") and self._index.get(key) == stamps[key]:
                del self._index[key]  # still the page that failed: drop it
                if res == "bad":
                    damaged.append(self.page_path(key))
        if damaged:
            await self.run_blocking(unlink_all, damaged)
        return ok

    def read_files(self, jobs: list[tuple[int, PageKey, np.ndarray]]) -> list[tuple[str, int]]:
        """:meth:`_read` of whole pages (a shorter blob is ``bad``)."""
        return self._read(jobs, sized=False)

    def _read_blobs(self, jobs: list[tuple[int, PageKey, np.ndarray]]) -> list[tuple[str, int]]:
        """:meth:`_read` of blobs of 1 to ``page_bytes`` bytes."""
        return self._read(jobs, sized=True)

    def _read(
        self, jobs: list[tuple[int, PageKey, np.ndarray]], sized: bool
    ) -> list[tuple[str, int]]:
        """Per job: (``ok``, bytes read), or ``bad`` (failed verification), ``gone`` (file
        missing) or ``error`` (I/O error) with 0. A blob shorter than a page is ``ok``
        only when ``sized``. Removes nothing: :meth:`get` decides that on the loop."""
        out: list[tuple[str, int]] = []
        header = bytearray(HEADER_SIZE)
        safe_dirs: dict[Path, bool] = {}
        for _, key, buf in jobs:
            path = self.page_path(key)
            try:
                if path.parent not in safe_dirs:
                    safe_dirs[path.parent] = not os.path.islink(path.parent)
                if not safe_dirs[path.parent]:
                    raise UnsafeStoreError(f"{path.parent} inside {self.path} is a symlink")
                fd = open_private(path, os.O_RDONLY, self.modes, self.path, fix_mode=False)
            except FileNotFoundError:
                log_file_error(
                    f"{self.path}:vanished", "file store: page %s vanished from %s", key.hex(), path
                )
                out.append(("gone", 0))
                continue
            except UnsafeStoreError as exc:  # a symlink planted in place of a page
                _log.warning("file store: page %s refused: %s", key.hex(), exc)
                out.append(("bad", 0))
                continue
            except OSError as exc:
                log_file_error(
                    f"{self.path}:open",
                    "file store: cannot open %s for %s: %s",
                    path,
                    key.hex(),
                    exc,
                )
                out.append(("error", 0))
                continue
            try:
                size = os.fstat(fd).st_size
                n = size - HEADER_SIZE
                fits = 0 < n <= buf.nbytes if sized else n == buf.nbytes
                got = -1
                if fits:  # every byte: a short read (FUSE, a signal) is not a damaged page
                    preadv_all(fd, [memoryview(header), buf[:n].data], 0)
                    got = size
            except IntegrityError:  # the file ended before fstat said: checked below
                pass
            except OSError as exc:
                log_file_error(
                    f"{self.path}:read",
                    "file store: read of %s from %s failed: %s",
                    key.hex(),
                    path,
                    exc,
                )
                out.append(("error", 0))
                continue
            finally:
                os.close(fd)
            try:
                if not fits or got != size:
                    raise IntegrityError(
                        f"file holds {size} bytes (read {got}), expected "
                        f"{'up to ' if sized else ''}{HEADER_SIZE + buf.nbytes}"
                    )
                verify_page(memoryview(header), key, buf[:n])
            except IntegrityError as exc:
                _log.warning(
                    "file store: page %s at %s failed verification (%s): a miss",
                    key.hex(),
                    path,
                    exc,
                )
                out.append(("bad", 0))
                continue
            out.append(("ok", n))
        return out

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [k in self._index for k in keys]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed pages (one hop)."""
        self._check_open()
        ok = [False] * len(keys)
        present: list[tuple[int, PageKey]] = []
        for i, k in enumerate(keys):
            if self._index.pop(k, None) is not None:
                present.append((i, k))
                ok[i] = True
        if present:
            paths = [self.page_path(k) for _, k in present]
            stuck = set(await self.run_blocking(unlink_all, paths))
            for (i, k), path in zip(present, paths, strict=True):
                if path in stuck:  # still on disk (and back at the next open): still held
                    self._index.setdefault(k, next(self._stamps))
                    ok[i] = False
        return ok

    async def keys(self) -> list[PageKey]:
        self._check_open()
        return list(self._index)

    def used_pages(self) -> int:
        return len(self._index) + len(self._pending)

    def stats(self) -> dict[str, Any]:
        """Base counters plus the directory, pending writes and error counts
        (``checksum_failures``, ``read_errors``, ``write_errors``, ``skipped_files``)."""
        out = super().stats()
        out.update(
            path=str(self.path),
            fsync=self.fsync,
            committed_pages=len(self._index),
            reserved_pages=len(self._pending),
            **self._counters,
        )
        return out
