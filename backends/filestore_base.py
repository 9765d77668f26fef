"""The file store's foundation: options, the directory (scan at open, lock), page paths
and file work spread over the I/O threads. :class:`FileStoreBase` holds it;
:class:`~kvtier.backends.filestore.FileStore` adds the keyed, two-phase interface (see its
module for the format and guarantees).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtier.backends.nvme_index import StoreLockedError
from kvtier.backends.store_files import (
    Modes,
    StorePathError,
    UnsafeStoreError,
    check_no_symlink,
    check_path_text,
    check_single_link,
    check_writable,
    describe_os_error,
    lock_holder,
    make_store_root,
    missing_store_note,
    open_private,
    private_dir,
    set_mode,
)

from kvtier.backend import CHUNK_MIN_BYTES, Medium, Preflight, StoreBackend
from kvtier.errors import ConfigError
from kvtier.health import ThreadLogEvery
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE

_log = logging.getLogger("kvtier.backends.filestore")

TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
#: Batches of at least this many bytes are spread over the I/O threads.
FAN_OUT_MIN_BYTES = CHUNK_MIN_BYTES
HEX_LEN = KEY_BYTES * 2


@dataclass
class Pending:
    """A reservation's state: where its bytes go before commit."""

    key: PageKey
    namespace: str
    tmp: Path
    written: bool = False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStoreBase(StoreBackend):
    """Options, lifecycle (open: scan and lock; close), page paths and the fan-out of
    file work over the I/O threads of :class:`~kvtier.backends.filestore.FileStore`,
    which adds the keyed interface."""

    medium: ClassVar[Medium] = Medium.FILE

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
        self._pending: dict[int, Pending] = {}
        self._next_handle = 0
        self._lock_fd = -1
        self._counters = {
            "checksum_failures": 0,
            "read_errors": 0,
            "write_errors": 0,
            "skipped_files": 0,
        }

    # -- paths --------------------------------------------------------------------------

    def page_path(self, key: PageKey) -> Path:
        """Where the committed page for ``key`` lives."""
        h = bytes(key).hex()
        return self.path / h[:2] / h

    # -- lifecycle ---------------------------------------------------------------------

    def preflight(self) -> Preflight:
        """What :meth:`open` would find, creating, locking and changing nothing: a
        missing directory will be created (its nearest existing parent is writable); an
        existing one must be a writable directory whose ``.lock`` and ``.tmp`` are no
        symlinks and that no other store object has open. Raises
        :class:`~kvtier.backends.store_files.StorePathError`,
        :class:`~kvtier.backends.store_files.UnsafeStoreError` or
        :class:`~kvtier.backends.nvme_index.StoreLockedError` naming the problem. (Files
        of another page size are not a conflict here: opening skips them.)"""
        root = self.path
        missing = missing_store_note(root, "file store")
        if missing is not None:
            return Preflight(missing)
        if not root.is_dir():
            raise StorePathError(f"file store: {root} exists and is not a directory")
        check_no_symlink(root / LOCK_NAME, root)
        check_no_symlink(root / TMP_SUFFIX, root, want="dir")
        check_writable(root, "file store")
        if lock_holder(root / LOCK_NAME, root) is not None:
            raise StoreLockedError(
                f"file store {root} is already open in another process or store object"
            )
        return Preflight(f"{root} exists (opening indexes the pages in it)")

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
        # the directory's modes change only once it is known to be usable: a directory
        # refused below (a symlinked lock or .tmp, another store object's) keeps its own
        make_store_root(self.path, self.modes, "file store", fix_mode=False)
        tmp = self.path / TMP_SUFFIX
        has_tmp = check_no_symlink(tmp, self.path, want="dir")
        self._lock_dir()
        set_mode(self.path, self.modes.dir)
        if has_tmp:
            shutil.rmtree(tmp)  # never follows symlinks inside it
        private_dir(tmp, self.modes, self.path)
        largest = HEADER_SIZE + self.page_bytes
        keys: set[PageKey] = set()
        skipped = 0
        for sub in os.scandir(self.path):
            if sub.name in (TMP_SUFFIX, LOCK_NAME) or len(sub.name) != 2:
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
                if len(name) != HEX_LEN or not name.startswith(sub.name):
                    skipped += 1
                    continue
                try:
                    key = bytes.fromhex(name)
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    skipped += 1
                    continue
                check_single_link(Path(entry.path), self.path, st)  # raises, as a symlink does
                size = st.st_size
                try:
                    if st.st_mode & 0o777 != self.modes.file:
                        set_mode(Path(entry.path), self.modes.file)
                except OSError:
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
            await self.run_blocking(unlink_all, tmps)
        self._pending.clear()
        await super().close()
        self._unlock()

    def _lock_dir(self) -> None:
        fd = open_private(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, self.modes, self.path)
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


#: "cannot remove" and "write ... failed" lines: at most one a minute per cause (a store
#: whose directory was removed logged one per page: 31,969 lines in 12 s)
FILE_ERRORS_LOGGED = ThreadLogEvery(60.0)


def log_file_error(cause: str, message: str, *args: object) -> None:
    """Log (as ``kvtier.backends.filestore``) a file error of kind ``cause`` unless one
    was logged within the minute; those held back are counted in the next line."""
    held = FILE_ERRORS_LOGGED.due(cause)
    if held is not None:
        more = f" ({held} more such errors since the last line)" if held else ""
        logging.getLogger("kvtier.backends.filestore").warning(message + more, *args)


def unlink_all(paths: Sequence[Path]) -> list[Path]:
    """Remove files, ignoring ones already gone; returns those that could not be removed
    (logged, at most once a minute)."""
    failed: list[Path] = []
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log_file_error("remove", "file store: cannot remove %s: %s", p, exc)
            failed.append(p)
    return failed
