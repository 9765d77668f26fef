"""The NVMe store's index: an SQLite database (WAL mode) beside the slab files.

Tables::

    meta(k, v)            store format version, page size, slot geometry, capacity
    pages(key, slot, slab, offset, length, checksum, namespace, created, accessed)
    quarantine(slot, key, reason, at)     slots that failed verification; never reused

A ``pages`` row exists only for a page whose bytes were made durable (``fdatasync``)
before the row's transaction committed, so after any crash every row points at a whole
page. ``synchronous=FULL``: a committed transaction survives power loss as well.

The index also owns the store directory's identity checks and the single-writer lock
(``fcntl.flock`` on ``<store>/lock``).

Thread-safety: every method takes the index lock; call from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.backends.store_files import (
    Modes,
    StorePathError,
    UnsafeStoreError,
    check_no_symlink,
    check_path_text,
    create_private_file,
    describe_os_error,
    make_store_root,
    open_private,
    set_mode,
)

from kvtier.errors import KVTierError, KVTierUsageError

#: Version of the store layout (slabs + index). Stores of a newer version are refused.
STORE_FORMAT_VERSION = 1
INDEX_FILE = "index.sqlite"
LOCK_FILE = "lock"
#: Files that may sit in a store directory; anything else there means it is not a store.
_STORE_FILES = {INDEX_FILE, f"{INDEX_FILE}-wal", f"{INDEX_FILE}-shm", LOCK_FILE, "slabs"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pages (
    key BLOB PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE,
    slab INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    namespace TEXT NOT NULL,
    created REAL NOT NULL,
    accessed REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS quarantine (
    slot INTEGER PRIMARY KEY,
    key BLOB,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
"""


class NotAStoreError(KVTierUsageError):
    """The path exists but is not an NVMe store (and is not an empty directory)."""


class StoreVersionError(KVTierUsageError):
    """The store was written by a newer kvtier (format version too new)."""


class StoreLockedError(KVTierError):
    """Another process (or another open store object) holds the store."""


class StoreReadOnlyError(KVTierError):
    """The store directory cannot be written."""


class DamagedStoreError(KVTierError):
    """The store's index or metadata is damaged beyond what opening repairs by itself
    (the message says how to rebuild it from the slabs)."""


#: The raw columns of a ``pages`` row as SQLite returns them (validated before use).
RawRow = tuple[object, ...]


def _signed(u: int) -> int:
    """A uint64 as SQLite's int64."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


@dataclass(frozen=True)
class PageRow:
    """One committed page as the index records it."""

    key: bytes
    slot: int
    slab: int
    offset: int
    length: int
    checksum: int
    namespace: str
    created: float


def check_store_dir(root: Path, create: bool, modes: Modes | None = None) -> bool:
    """Check that ``root`` is a store directory; return whether it holds a store already.

    With ``create``, a missing directory (and missing parents) is created private
    (``modes.dir``, ``0700`` by default). Raises :class:`NotAStoreError` for a file, or a
    directory with foreign content and no index; :class:`KVTierUsageError` for a missing
    directory when not creating; :class:`~kvtier.backends.store_files.UnsafeStoreError`
    when one of the store's own entries (index, its WAL/SHM, lock, slabs) is a symlink or
    of the wrong type; :class:`~kvtier.backends.store_files.StorePathError` for a path the
    OS refuses (NUL byte, name too long...).
    """
    root = check_path_text(root, "NVMe store")
    modes = modes or Modes()
    try:
        exists = root.exists()
        if exists and not root.is_dir():
            raise NotAStoreError(f"{root} is not a directory, so not an NVMe store")
    except OSError as exc:
        raise StorePathError(f"NVMe store {root}: {describe_os_error(exc)}") from exc
    if not exists:
        if not create:
            raise KVTierUsageError(f"no NVMe store at {root}: the directory does not exist")
        try:
            make_store_root(root, modes, "NVMe store")
        except StorePathError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in (
                errno.EROFS,
                errno.EACCES,
                errno.EPERM,
            ):
                raise StoreReadOnlyError(
                    f"cannot create store directory {root}: {exc.__cause__.strerror}"
                ) from exc
            raise
        return False
    check_store_entries(root)
    if create:
        set_mode(root, modes.dir)
    if (root / INDEX_FILE).exists():
        return True
    try:
        names = [p.name for p in root.iterdir()]
    except OSError as exc:
        raise StorePathError(f"NVMe store {root}: {describe_os_error(exc)}") from exc
    foreign = sorted(n for n in names if n not in _STORE_FILES)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise NotAStoreError(
            f"{root} is not an NVMe store: it has no {INDEX_FILE} but holds other files "
            f"({shown}); pick an empty or new directory"
        )
    if not create and not (root / "slabs").is_dir():
        raise NotAStoreError(f"{root} is not an NVMe store: it has no {INDEX_FILE}")
    return False


def check_store_entries(root: Path) -> None:
    """Refuse a store whose own files or directories are symlinks or of the wrong type:
    :class:`~kvtier.backends.store_files.UnsafeStoreError` names the entry."""
    for name in (INDEX_FILE, f"{INDEX_FILE}-wal", f"{INDEX_FILE}-shm", LOCK_FILE):
        check_no_symlink(root / name, root)
    if check_no_symlink(root / "slabs", root, want="dir"):
        try:
            entries = list(os.scandir(root / "slabs"))
        except OSError as exc:
            raise StorePathError(f"NVMe store {root}: slabs: {describe_os_error(exc)}") from exc
        for entry in entries:
            if entry.name.startswith("slab-"):
                check_no_symlink(Path(entry.path), root)


class StoreLock:
    """Exclusive (writer) or shared (inspection) ``flock`` on ``<store>/lock``."""

    def __init__(self, root: Path, exclusive: bool = True, modes: Modes | None = None) -> None:
        path = root / LOCK_FILE
        modes = modes or Modes()
        self._fd = -1
        if not exclusive:
            # Readers only need to see a writer's lock; they may sit on read-only media.
            try:
                self._fd = open_private(path, os.O_RDONLY, modes, root, fix_mode=False)
            except FileNotFoundError:
                return  # never opened for writing: nobody to exclude
        try:
            if self._fd < 0:
                self._fd = open_private(path, os.O_RDWR | os.O_CREAT, modes, root)
        except UnsafeStoreError:
            raise
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise StoreReadOnlyError(
                    f"NVMe store directory {root} is read-only ({exc.strerror}); "
                    "the store needs write access"
                ) from exc
            raise
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        try:
            fcntl.flock(self._fd, op)
        except BlockingIOError:
            if exclusive and _only_readers(self._fd):
                os.close(self._fd)
                raise StoreLockedError(
                    f"NVMe store {root} is being verified (kvtier inspect store --verify); "
                    "open it once that is done"
                ) from None
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StoreLockedError(
                f"NVMe store {root} is already open in another process or object "
                f"(holder pid {holder}); "
                + (
                    "a store has one writer at a time"
                    if exclusive
                    else "--verify needs it closed (plain inspect works on a live store)"
                )
            ) from None
        if exclusive:
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                self.release()
                raise StoreReadOnlyError(
                    f"NVMe store directory {root} is not writable ({exc.strerror})"
                ) from exc

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _only_readers(fd: int) -> bool:
    """Whether the lock on ``fd``'s file is held shared (by inspections), not by a writer:
    then a shared lock can still be taken (and is dropped again at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """Open the index read-only; on read-only media (no ``-shm`` file can be made) fall
    back to ``immutable=1``, which is exact there because nothing can change the file."""
    if not path.is_file():
        raise NotAStoreError(f"{path} is missing: not a kvtier store")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        if os.access(path.parent, os.W_OK) and not _read_only_fs(path.parent):
            raise
    return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)


def _read_only_fs(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


class StoreIndex:
    """The SQLite index of one store.

    Args:
        path: the database file.
        readonly: open for inspection only (``mode=ro``).
    """

    def __init__(self, path: Path, readonly: bool = False, modes: Modes | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        #: Tables the file held when it was opened (before the schema was completed).
        self.tables_at_open: frozenset[str] = frozenset()
        try:
            if readonly:
                self._db = _connect_readonly(path)
            else:
                # SQLite gives its -wal and -shm files the database file's modes, so the
                # file is created private first; none of the three may be a symlink.
                for suffix in ("", "-wal", "-shm"):
                    check_no_symlink(path.with_name(path.name + suffix), path.parent)
                create_private_file(path, modes or Modes(), path.parent)
                for suffix in ("-wal", "-shm"):
                    if (extra := path.with_name(path.name + suffix)).exists():
                        set_mode(extra, (modes or Modes()).file)
                self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.tables_at_open = frozenset(
                str(r[0])
                for r in self._db.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                ).fetchall()
            )
            if not readonly:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise NotAStoreError(f"{path} is not a kvtier store index: {exc}") from exc

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise

    # -- meta --------------------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        """Every meta entry (empty for a new index)."""
        with self._lock:
            try:
                rows = self._db.execute("SELECT k, v FROM meta").fetchall()
            except sqlite3.DatabaseError as exc:
                raise NotAStoreError(f"{self.path} is not a kvtier store index: {exc}") from exc
        return {str(k): str(v) for k, v in rows}

    def set_meta(self, values: dict[str, object]) -> None:
        """Insert or replace meta entries in one transaction."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)",
                [(k, str(v)) for k, v in values.items()],
            )

    # -- pages -------------------------------------------------------------------------

    def load(self) -> tuple[list[PageRow], dict[int, str]]:
        """Every ``pages`` row whose columns have the right types, and every quarantined
        slot (with its reason), as stored: for tools and tests. Opening a store checks
        far more (:func:`~kvtier.backends.nvme_validate.check_index`)."""
        pages: list[PageRow] = []
        for _, k, s, sl, off, ln, c, ns, cr in self.raw_rows():
            ints = (s, sl, off, ln, c)
            if (
                isinstance(k, bytes)
                and all(isinstance(v, int) for v in ints)
                and isinstance(ns, str)
                and isinstance(cr, int | float)
            ):
                si, sli, offi, lni, ci = (int(v) for v in ints)  # type: ignore[call-overload]
                pages.append(PageRow(k, si, sli, offi, lni, _unsigned(ci), ns, float(cr)))
        quarantined = {int(s): str(r) for _, s, r in self.raw_quarantine() if isinstance(s, int)}
        return pages, quarantined

    def raw_rows(self) -> Iterator[RawRow]:
        """Every ``pages`` row as stored: ``(rowid, key, slot, slab, offset, length,
        checksum, namespace, created)``, unchecked (see :mod:`~kvtier.backends.nvme_validate`).
        Streams from a cursor, so memory does not grow with the table."""
        yield from self._stream(
            "SELECT rowid, key, slot, slab, offset, length, checksum, namespace, created "
            "FROM pages"
        )

    def raw_quarantine(self) -> Iterator[RawRow]:
        """Every ``quarantine`` row as stored: ``(rowid, slot, reason)``, unchecked."""
        yield from self._stream("SELECT rowid, slot, reason FROM quarantine")

    def _stream(self, sql: str) -> Iterator[RawRow]:
        with self._lock:
            try:
                cursor = self._db.execute(sql)
                while batch := cursor.fetchmany(4096):
                    yield from batch
            except sqlite3.DatabaseError as exc:
                raise DamagedStoreError(
                    f"{self.path}: the index cannot be read ({exc}); rebuild it from the "
                    f"slabs with 'kvtier inspect store {self.path.parent} --rebuild-index'"
                ) from exc

    def count(self, table: str) -> int:
        """Rows of ``pages`` or ``quarantine``."""
        assert table in ("pages", "quarantine")
        with self._lock:
            return int(self._db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def drop_rows(self, page_rowids: Sequence[int], quarantine_rowids: Sequence[int],
                  quarantine: Iterable[tuple[int, bytes | None, str]]) -> None:
        """Remove invalid ``pages`` and ``quarantine`` rows (by rowid) and quarantine the
        slots given, in one transaction."""
        now = time.time()
        with self._tx() as db:
            db.executemany("DELETE FROM pages WHERE rowid = ?", [(r,) for r in page_rowids])
            db.executemany(
                "DELETE FROM quarantine WHERE rowid = ?", [(r,) for r in quarantine_rowids]
            )
            db.executemany(
                "INSERT OR REPLACE INTO quarantine (slot, key, reason, at) VALUES (?, ?, ?, ?)",
                [(slot, key, reason, now) for slot, key, reason in quarantine],
            )

    def insert(self, rows: Iterable[PageRow]) -> None:
        """Commit rows in one transaction (the group commit)."""
        now = time.time()
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO pages "
                "(key, slot, slab, offset, length, checksum, namespace, created, accessed) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        r.key,
                        r.slot,
                        r.slab,
                        r.offset,
                        r.length,
                        _signed(r.checksum),
                        r.namespace,
                        r.created,
                        now,
                    )
                    for r in rows
                ],
            )

    def delete(self, keys: Iterable[bytes]) -> None:
        """Remove rows in one transaction."""
        with self._tx() as db:
            db.executemany("DELETE FROM pages WHERE key = ?", [(k,) for k in keys])

    def touch(self, accessed: dict[bytes, float]) -> None:
        """Record last-access times (best effort, batched)."""
        if not accessed:
            return
        with self._tx() as db:
            db.executemany(
                "UPDATE pages SET accessed = ? WHERE key = ?",
                [(t, k) for k, t in accessed.items()],
            )

    def quarantine(self, entries: Iterable[tuple[int, bytes | None, str]]) -> None:
        """Drop the rows of damaged pages and mark their slots unusable, atomically."""
        now = time.time()
        items = list(entries)
        with self._tx() as db:
            db.executemany("DELETE FROM pages WHERE slot = ?", [(slot,) for slot, _, _ in items])
            db.executemany(
                "INSERT OR REPLACE INTO quarantine (slot, key, reason, at) VALUES (?, ?, ?, ?)",
                [(slot, key, reason, now) for slot, key, reason in items],
            )

    def summary(self) -> dict[str, object]:
        """Counts for inspection: pages, payload bytes, pages per namespace, quarantined."""
        with self._lock:
            try:
                n, total = self._db.execute(
                    "SELECT count(*), coalesce(total(length), 0) FROM pages"
                ).fetchone()
                per_ns = self._db.execute(
                    "SELECT namespace, count(*), total(length) FROM pages GROUP BY namespace "
                    "ORDER BY namespace"
                ).fetchall()
                q = self._db.execute("SELECT count(*) FROM quarantine").fetchone()[0]
            except sqlite3.DatabaseError as exc:
                raise DamagedStoreError(
                    f"{self.path}: the index cannot be read ({exc}); rebuild it from the "
                    f"slabs with 'kvtier inspect store {self.path.parent} --rebuild-index'"
                ) from exc
        return {
            "pages": int(n),
            "bytes": int(total),
            "namespaces": {
                str(ns): {"pages": int(c), "bytes": int(b)} for ns, c, b in per_ns
            },
            "quarantined": int(q),
        }

    def close(self) -> None:
        """Close the database (checkpointing the WAL when writable)."""
        with self._lock:
            self._db.close()
