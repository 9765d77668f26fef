"""The NVMe store's directory: what may be in it, its identity checks, the errors that
name what is wrong with it, and the single-writer lock (``fcntl.flock`` on
``<store>/lock``). :mod:`kvtier.backends.nvme_index` re-exports all of it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
from pathlib import Path

from kvtier.backends.store_files import (
    Modes,
    StorePathError,
    UnsafeStoreError,
    check_no_symlink,
    check_path_text,
    describe_os_error,
    free_space,
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
#: The index and the files SQLite keeps beside it (WAL, shared memory, a rollback journal).
INDEX_FILES = tuple(INDEX_FILE + suffix for suffix in ("", "-wal", "-shm", "-journal"))
STORE_FILES = {*INDEX_FILES, LOCK_FILE, "slabs"}


class NotAStoreError(KVTierUsageError):
    """The path exists but is not an NVMe store (and is not an empty directory)."""


class StoreVersionError(KVTierUsageError):
    """The store was written by a newer kvtier (format version too new)."""


class StoreLockedError(KVTierError):
    """Another process (or another open store object) holds the store."""


class StoreReadOnlyError(KVTierError):
    """The store directory cannot be written."""


class StoreUnavailableError(KVTierError):
    """The store's files cannot be opened or written now for a reason outside the store:
    the file system is full, the device reports an I/O error, SQLite cannot open or lock
    its files. The store itself was not judged (it may be intact): free space or fix the
    medium and reopen. Not a usage error (the CLI exits 1)."""


class DamagedStoreError(KVTierError):
    """The store's index or metadata is damaged beyond what opening repairs by itself
    (the message says how to rebuild it from the slabs)."""


def check_store_dir(root: Path, create: bool, modes: Modes | None = None) -> bool:
    """Check that ``root`` is a store directory; return whether it holds a store already.

    With ``create``, a missing directory (and missing parents) is created private
    (``modes.dir``, ``0700`` by default), and an existing one brought to ``modes.dir``
    once it passed every check: a directory refused here is left as it was. Raises
    :class:`NotAStoreError` for a file, or a directory with foreign content and no
    index; :class:`KVTierUsageError` for a missing directory when not creating;
    :class:`~kvtier.backends.store_files.UnsafeStoreError` when one of the store's own
    entries (index, its WAL/SHM, lock, slabs) is a symlink or of the wrong type;
    :class:`~kvtier.backends.store_files.StorePathError` for a path the OS refuses (NUL
    byte, name too long...).
    """
    root = check_path_text(root, "NVMe store")
    modes = modes or Modes()
    try:
        exists = root.exists()
        if exists and not root.is_dir():
            raise NotAStoreError(not_a_directory(root))
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
    has_index = (root / INDEX_FILE).exists()
    if not has_index:
        _check_new_store(root, create)
    if create:  # only once the directory is known to be a store (or an empty one)
        set_mode(root, modes.dir)
    return has_index


def _check_new_store(root: Path, create: bool) -> None:
    """Refuse an existing directory without an index that holds anything but a store's
    own files (or, when not creating, that has no slabs either): :class:`NotAStoreError`.
    Changes nothing, so a refused directory keeps its modes."""
    try:
        names = [p.name for p in root.iterdir()]
    except OSError as exc:
        raise StorePathError(f"NVMe store {root}: {describe_os_error(exc)}") from exc
    check_only_store_files(root, names)
    if not create and not (root / "slabs").is_dir():
        raise NotAStoreError(f"{root} is not an NVMe store: it has no {INDEX_FILE}")


def check_store_entries(root: Path) -> None:
    """Refuse a store whose own files or directories are symlinks, of the wrong type or
    hard-linked: :class:`~kvtier.backends.store_files.UnsafeStoreError` names the entry."""
    for name in (*INDEX_FILES, LOCK_FILE):
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


def check_only_store_files(root: Path, names: list[str]) -> None:
    """:class:`NotAStoreError` when ``names`` (the entries of ``root``, which has no
    index) hold anything but a store's own files: ``root`` is some other directory."""
    foreign = sorted(n for n in names if n not in STORE_FILES)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise NotAStoreError(
            f"{root} is not an NVMe store: it has no {INDEX_FILE} but holds other files "
            f"({shown}); pick an empty or new directory"
        )


def not_a_directory(root: Path) -> str:
    """Why ``root``, an existing file (or device), cannot be an NVMe store."""
    return f"NVMe store: {root} exists and is not a directory, so not an NVMe store"


def page_size_conflict(root: Path, held: int, page_bytes: int) -> str:
    """Why the store at ``root``, holding pages of ``held`` bytes, cannot serve pages of
    ``page_bytes`` bytes (opening raises it; a check without side effects reports it)."""
    return (
        f"NVMe store {root} holds pages of {held} bytes, not {page_bytes}: use another "
        "directory for this page size (a tier with a codec keeps pages of its codec's slot "
        "size: changing the tier's codec, or the model's page geometry, changes it)"
    )


#: SQLite primary result codes that describe the environment (the file system, the
#: device, permissions, memory, locks), not the index file's content: PERM, BUSY, LOCKED,
#: NOMEM, READONLY, IOERR, FULL, CANTOPEN, PROTOCOL.
_ENVIRONMENT_CODES = frozenset({3, 5, 6, 7, 8, 10, 13, 14, 15})
_READONLY = 8  # SQLITE_READONLY
#: The same, by message, for an error that carries no result code.
_ENVIRONMENT_WORDS = (
    "disk i/o error",
    "database or disk is full",
    "unable to open database file",
    "readonly database",
    "database is locked",
    "out of memory",
)


def sqlite_environment_error(path: Path, exc: sqlite3.Error, doing: str) -> KVTierError | None:
    """The store error for ``exc``, raised by SQLite while ``doing`` something with the
    index at ``path``, when its cause is the environment rather than the index's content:
    :class:`StoreReadOnlyError` for a read-only database, :class:`StoreUnavailableError`
    for the rest (disk full, I/O error, cannot open). The message names the path, SQLite's
    error and the file system's free space, and says that the store was not judged.
    ``None`` when ``exc`` says something about the file itself (not a database,
    malformed, a table missing): the caller reports that as damage."""
    code = getattr(exc, "sqlite_errorcode", None)
    text = str(exc) or type(exc).__name__
    if isinstance(code, int):
        environmental = (code & 0xFF) in _ENVIRONMENT_CODES
    else:
        environmental = isinstance(exc, sqlite3.OperationalError) and any(
            w in text.lower() for w in _ENVIRONMENT_WORDS
        )
    if not environmental:
        return None
    room = free_space(path.parent)
    if (code & 0xFF == _READONLY) if isinstance(code, int) else "readonly" in text.lower():
        return StoreReadOnlyError(
            f"cannot {doing} the index {path}: {text} (the store directory or its file "
            f"system is read-only, {room}: the store needs write access; the store itself "
            "was not judged)"
        )
    return StoreUnavailableError(
        f"cannot {doing} the index {path}: {text} (the file system has {room}: free "
        "space or check the device, then reopen; the store itself was not judged)"
    )
