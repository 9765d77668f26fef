"""The NVMe store's index: an SQLite database (WAL mode) beside the slab files.

Tables::

    meta(k, v)            store format version, page size, slot geometry, capacity
    pages(key, slot, slab, offset, length, checksum, namespace, created, accessed)
    quarantine(slot, key, reason, at)     slots that failed verification; never reused

A ``pages`` row exists only for a page whose bytes were made durable (``fdatasync``)
before the row's transaction committed, so after any crash every row points at a whole
page. ``synchronous=FULL``: a committed transaction survives power loss as well.

The store directory's identity checks and the single-writer lock are in
:mod:`kvtier.backends.nvme_dir` (re-exported here).

Thread-safety: every method takes the index lock; call from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.backends.nvme_dir import (
    INDEX_FILE,
    LOCK_FILE,
    STORE_FILES,
    STORE_FORMAT_VERSION,
    DamagedStoreError,
    NotAStoreError,
    StoreLock,
    StoreLockedError,
    StoreReadOnlyError,
    StoreUnavailableError,
    StoreVersionError,
    check_store_dir,
    check_store_entries,
    sqlite_environment_error,
)
from kvtier.backends.store_files import (
    Modes,
    check_no_symlink,
    create_private_file,
    set_mode,
)

__all__ = [
    "INDEX_FILE",
    "LOCK_FILE",
    "STORE_FILES",
    "STORE_FORMAT_VERSION",
    "DamagedStoreError",
    "NotAStoreError",
    "PageRow",
    "RawRow",
    "StoreIndex",
    "StoreLock",
    "StoreLockedError",
    "StoreReadOnlyError",
    "StoreUnavailableError",
    "StoreVersionError",
    "check_store_dir",
    "check_store_entries",
]

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


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """Open the index read-only, creating nothing beside it.

    An index whose WAL is missing or empty holds everything in its main file (a writer
    removes both WAL and ``-shm`` when it closes; an empty WAL is what a reader leaves):
    it is read with ``immutable=1``, since ``mode=ro`` would create or touch ``-wal``
    and ``-shm`` files beside it. Otherwise (a live store, or one whose writer crashed)
    ``mode=ro`` reads the WAL too; on read-only media (no ``-shm`` file can be made)
    that falls back to ``immutable=1``, exact there because nothing can change the file."""
    if not path.is_file():
        raise NotAStoreError(f"{path} is missing: not a kvtier store")
    wal = Path(f"{path}-wal")
    if not wal.exists() or wal.stat().st_size == 0:
        db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except BaseException:
            db.close()
            raise
        return db
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        if os.access(path.parent, os.W_OK) and not _read_only_fs(path.parent):
            raise
    return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)


def _identity(path: Path) -> tuple[int, int] | None:
    """``path``'s (device, inode), or ``None`` when it is not there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


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
                for suffix in ("", "-wal", "-shm", "-journal"):
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
            #: The file opened, as (device, inode): see :meth:`_check_still_there`.
            self._identity = _identity(path)
            if not readonly:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            if hasattr(self, "_db"):
                self._db.close()
            raise self._not_an_index(exc, "open") from exc

    def _not_an_index(self, exc: sqlite3.Error, doing: str) -> Exception:
        """What ``exc`` from SQLite means: the environment failed (disk full, I/O error:
        :func:`~kvtier.backends.nvme_dir.sqlite_environment_error`, the store not
        judged), or the file is not a kvtier index (:class:`NotAStoreError`)."""
        env = sqlite_environment_error(self.path, exc, doing)
        if env is not None:
            return env
        return NotAStoreError(f"{self.path} is not a kvtier store index: {exc}")

    def lacking(self) -> str | None:
        """What this index lacked when opened that a store's index has: ``"empty: no
        tables (a 0-byte or emptied file)"``, ``"no meta table"``, or ``None``. Opening
        the store treats such an index beside slab files as lost and rebuilds it."""
        if not self.tables_at_open:
            return "empty: no tables (a 0-byte or emptied file)"
        if "meta" not in self.tables_at_open:
            return "no meta table"
        return None

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
                raise self._not_an_index(exc, "read the meta record of") from exc
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
            "SELECT rowid, key, slot, slab, offset, length, checksum, namespace, created FROM pages"
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
                env = sqlite_environment_error(self.path, exc, "read")
                if env is not None:
                    raise env from exc
                raise DamagedStoreError(
                    f"{self.path}: the index cannot be read ({exc}); rebuild it from the "
                    f"slabs with 'kvtier inspect store {self.path.parent} --rebuild-index'"
                ) from exc

    def count(self, table: str) -> int:
        """Rows of ``pages`` or ``quarantine``."""
        assert table in ("pages", "quarantine")
        with self._lock:
            return int(self._db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def drop_rows(
        self,
        page_rowids: Sequence[int],
        quarantine_rowids: Sequence[int],
        quarantine: Iterable[tuple[int, bytes | None, str]],
    ) -> None:
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

    def _check_still_there(self) -> None:
        """Raise :class:`OSError` when the index file was removed, moved or replaced
        since it was opened (the store's directory deleted while it was open, say):
        SQLite would go on writing to the file it holds open, and every page committed
        from then on would be gone once the store closes."""
        if _identity(self.path) != self._identity:
            raise OSError(
                errno.ENOENT,
                f"the store's index {str(self.path)!r} was removed, moved or replaced while "
                "the store was open; pages committed now would be lost",
            )

    def insert(self, rows: Iterable[PageRow]) -> None:
        """Commit rows in one transaction (the group commit); first checks that the
        index file is still the one opened (:meth:`_check_still_there`)."""
        self._check_still_there()
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

    def close(self) -> None:
        """Close the database (checkpointing the WAL when writable)."""
        with self._lock:
            self._db.close()
