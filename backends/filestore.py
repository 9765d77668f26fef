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

import asyncio
import contextlib
import fcntl
import functools
import itertools
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
from kvtier.backends.nvme_index import StoreLockedError
from kvtier.backends.store_files import (
    Modes,
    StorePathError,
    UnsafeStoreError,
    check_no_symlink,
    check_path_text,
    describe_os_error,
    make_store_root,
    open_private,
    private_dir,
    set_mode,
)

from kvtier.backend import Reservation, StoreBackend, check_blobs, check_buffers
from kvtier.errors import ConfigError, IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

_log = logging.getLogger(__name__)

_TMP = ".tmp"
_LOCK = ".lock"
#: Batches of at least this many bytes are spread over the I/O threads.
FAN_OUT_MIN_BYTES = 1 << 20

J = TypeVar("J")
R = TypeVar("R")
_HEX_LEN = KEY_BYTES * 2


@dataclass
class _Pending:
    """A reservation's state: where its bytes go before commit."""

    key: PageKey
    namespace: str
    tmp: Path
    written: bool = False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStore(StoreBackend):
    """Pages as files in a directory (see module docstring).

    Options:
        path: the directory (created if missing, private). Required.
        fsync: sync each page to stable storage before commit returns (default False).
        io_threads: worker threads (default 4).
        group_access: files 0660 / directories 0770 instead of 0600 / 0700.

    Persistent: committed pages are there again after close and reopen.
    """

    default_io_threads: ClassVar[int] = 4
    variable_length: ClassVar[bool] = True

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        path: str | os.PathLike[str] | None = None,
        fsync: bool = False,
        group_access: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            page_bytes=page_bytes,
            capacity_pages=capacity_pages,
            io_threads=io_threads,
            **options,
        )
        if path is None or str(path) == "":
            raise ConfigError("FileStore: option 'path' (the store directory) is required")
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"FileStore: option 'path' must be a path, got {path!r}")
        if not isinstance(fsync, bool):
            raise ConfigError(f"FileStore: option 'fsync' must be a bool, got {fsync!r}")
        self.path = check_path_text(path, "FileStore: option 'path'")
        self.modes = Modes.for_option(group_access, "FileStore")
        self.fsync = fsync
        # committed key -> stamp of its commit (0 for pages found at open), so a read that
        # fails can tell whether the page it read is still the one committed
        self._index: dict[PageKey, int] = {}
        self._stamps = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._next_handle = 0
        self._lock_fd = -1
        self._counters = {
            "checksum_failures": 0,
            "read_errors": 0,
            "write_errors": 0,
            "skipped_files": 0,
        }

    async def _fan_out(self, fn: Callable[[list[J]], list[R]], jobs: list[J]) -> list[R]:
        """Run ``fn`` over ``jobs`` off the loop: one hop for a small batch; a large one is
        cut into contiguous chunks run at once on the I/O threads. Results keep job order."""
        parts = min(self.io_threads, os.cpu_count() or 1, len(jobs))
        if parts <= 1 or len(jobs) * self.page_bytes < FAN_OUT_MIN_BYTES:
            return await self.run_blocking(fn, jobs)
        self._check_open()
        loop = asyncio.get_running_loop()
        size = -(-len(jobs) // parts)
        chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        done = await asyncio.gather(
            *(loop.run_in_executor(self._executor, functools.partial(fn, c)) for c in chunks)
        )
        return [r for chunk in done for r in chunk]

    # -- paths --------------------------------------------------------------------------

    def page_path(self, key: PageKey) -> Path:
        """Where the committed page for ``key`` lives."""
        h = bytes(key).hex()
        return self.path / h[:2] / h

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Create the directory if needed, clear ``.tmp`` and index committed pages.

        Idempotent. Raises :class:`~kvtier.backends.store_files.StorePathError` when the
        directory cannot be created or read (naming it and why),
        :class:`~kvtier.backends.store_files.UnsafeStoreError` for a symlink inside it,
        :class:`~kvtier.backends.nvme_index.StoreLockedError` when another store object
        (here or in another process) has it open.
        """
        if self._opened:
            return
        await super().open()
        try:
            keys, skipped = await self.run_blocking(self._scan)
        except BaseException:
            await super().close()
            self._unlock()
            raise
        self._index = dict.fromkeys(keys, 0)
        self._counters["skipped_files"] = skipped

    def _scan(self) -> tuple[set[PageKey], int]:
        """Lock the directory, then index ``<path>/<xx>/<hex>`` files of the right size;
        count what is skipped."""
        try:
            return self._scan_files()
        except (StorePathError, UnsafeStoreError, StoreLockedError):
            self._unlock()
            raise
        except OSError as exc:
            self._unlock()
            where = exc.filename or self.path
            raise StorePathError(
                f"file store {self.path}: cannot use {where}: {describe_os_error(exc)}"
            ) from exc

    def _scan_files(self) -> tuple[set[PageKey], int]:
        make_store_root(self.path, self.modes, "file store")
        self._lock_dir()
        tmp = self.path / _TMP
        if check_no_symlink(tmp, self.path, want="dir"):
            shutil.rmtree(tmp)  # never follows symlinks inside it
        private_dir(tmp, self.modes, self.path)
        largest = HEADER_SIZE + self.page_bytes
        keys: set[PageKey] = set()
        skipped = 0
        for sub in os.scandir(self.path):
            if sub.name in (_TMP, _LOCK) or len(sub.name) != 2:
                continue
            if sub.is_symlink():
                check_no_symlink(Path(sub.path), self.path, want="dir")  # raises
            if not sub.is_dir(follow_symlinks=False):
                continue
            private_dir(Path(sub.path), self.modes, self.path, create=False)
            for entry in os.scandir(sub.path):
                name = entry.name
                if entry.is_symlink():
                    check_no_symlink(Path(entry.path), self.path)  # raises
                if len(name) != _HEX_LEN or not name.startswith(sub.name):
                    skipped += 1
                    continue
                try:
                    key = bytes.fromhex(name)
                    st = entry.stat(follow_symlinks=False)
                    size = st.st_size
                    if st.st_mode & 0o777 != self.modes.file:
                        set_mode(Path(entry.path), self.modes.file)
                except (ValueError, OSError):
                    skipped += 1
                    continue
                if not HEADER_SIZE < size <= largest:  # shorter: a variable-length blob
                    _log.warning(
                        "file store %s: skipping %s (%d bytes, expected %d to %d)",
                        self.path,
                        entry.path,
                        size,
                        HEADER_SIZE + 1,
                        largest,
                    )
                    skipped += 1
                    continue
                keys.add(PageKey(key))
        return keys, skipped

    async def close(self) -> None:
        """Drop uncommitted writes and release threads and the directory; committed pages
        stay. Idempotent."""
        if self._opened and self._pending:
            tmps = [p.tmp for p in self._pending.values()]
            await self.run_blocking(_unlink_all, tmps)
        self._pending.clear()
        await super().close()
        self._unlock()

    def _lock_dir(self) -> None:
        fd = open_private(self.path / _LOCK, os.O_RDWR | os.O_CREAT, self.modes, self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"file store {self.path} is already open in another process or store object"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the keyed, two-phase interface ------------------------------------------------

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
            tmp = self.path / _TMP / f"{handle}-{bytes(key).hex()}"
            self._pending[handle] = _Pending(key, namespace, tmp)
            out.append(Reservation(key, handle))
        return out

    def _live(self, r: Reservation) -> _Pending | None:
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
        jobs: list[tuple[int, _Pending, np.ndarray]] = []
        for i, (r, buf) in enumerate(zip(reservations, bufs, strict=True)):
            if r.present:
                ok[i] = True
            elif (p := self._live(r)) is not None:
                jobs.append((i, p, buf))
        if jobs:
            results = await self._fan_out(self._write_files, jobs)
            for (i, p, _), res in zip(jobs, results, strict=True):
                ok[i] = res
                p.written = res
                self._counters["write_errors"] += not res
        return ok

    def _write_files(self, jobs: list[tuple[int, _Pending, np.ndarray]]) -> list[bool]:
        out: list[bool] = []
        for _, p, buf in jobs:
            try:
                header = encode_header(p.key, p.namespace, buf)
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                fd = open_private(p.tmp, flags, self.modes, self.path)
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
                _log.warning("file store: write of %s to %s failed: %s", p.key.hex(), p.tmp, exc)
                out.append(False)
        return out

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Move written pages into place (one hop). ``False`` (space released) for a
        reservation that was not written or whose move failed."""
        self._check_open()
        ok = [False] * len(reservations)
        jobs: list[tuple[int, _Pending]] = []
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
            results = await self.run_blocking(self._commit_files, jobs)
            for (i, p), res in zip(jobs, results, strict=True):
                if i >= 0 and res:
                    self._index[p.key] = next(self._stamps)
                    ok[i] = True
                elif i >= 0:
                    self._counters["write_errors"] += 1
        return ok

    def _commit_files(self, jobs: list[tuple[int, _Pending]]) -> list[bool]:
        out: list[bool] = []
        dirs: set[Path] = set()
        for i, p in jobs:
            if i < 0:
                _unlink_all([p.tmp])
                out.append(False)
                continue
            final = self.page_path(p.key)
            try:
                # Never a symlink (UnsafeStoreError is an OSError: the page fails).
                private_dir(final.parent, self.modes, self.path)
                os.replace(p.tmp, final)
                dirs.add(final.parent)
                out.append(True)
            except OSError as exc:
                _log.warning("file store: commit of %s to %s failed: %s", p.key.hex(), final, exc)
                _unlink_all([p.tmp])
                out.append(False)
        if self.fsync:
            for d in dirs:
                _fsync_dir(d)
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
            await self.run_blocking(_unlink_all, tmps)

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
        results = await self._fan_out(self._read_blobs if sized else self._read_files, jobs)
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
            await self.run_blocking(_unlink_all, damaged)
        return ok

    def _read_files(self, jobs: list[tuple[int, PageKey, np.ndarray]]) -> list[tuple[str, int]]:
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
                _log.warning("file store: page %s vanished from %s", key.hex(), path)
                out.append(("gone", 0))
                continue
            except UnsafeStoreError as exc:  # a symlink planted in place of a page
                _log.warning("file store: page %s refused: %s", key.hex(), exc)
                out.append(("bad", 0))
                continue
            except OSError as exc:
                _log.warning("file store: cannot open %s for %s: %s", path, key.hex(), exc)
                out.append(("error", 0))
                continue
            try:
                size = os.fstat(fd).st_size
                n = size - HEADER_SIZE
                fits = 0 < n <= buf.nbytes if sized else n == buf.nbytes
                got = os.preadv(fd, [header, buf[:n].data], 0) if fits else -1
            except OSError as exc:
                _log.warning("file store: read of %s from %s failed: %s", key.hex(), path, exc)
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
            await self.run_blocking(_unlink_all, [self.page_path(k) for _, k in present])
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


def _unlink_all(paths: Sequence[Path]) -> None:
    """Remove files, ignoring ones already gone."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("file store: cannot remove %s: %s", p, exc)
