"""Private, symlink-proof files and directories for the persistent stores (NVMe, file).

KV pages are derived from users' prompts (design invariant 9), so every file a store
creates is ``0600`` and every directory ``0700``, whatever the process umask; the option
``group_access`` of a store widens that to ``0660`` / ``0770`` for a group that shares
the cache. Modes are set explicitly (``fchmod`` / ``chmod`` after creation), so the umask
can only be stricter than intended when it runs first, never looser; files of an existing
store are brought to the store's modes when it opens.

A store never follows a symlink planted *inside* it: files are opened with
``O_NOFOLLOW`` and directories are checked with ``lstat`` before use, so a symlinked lock,
slab, index or sub-directory raises :class:`UnsafeStoreError` naming it, and its target is
never touched. The store directory itself may be a symlink (that is the user's choice of
path, not something planted in the store).

Every function raises :class:`UnsafeStoreError` for a symlink or a file of the wrong type,
and :class:`StorePathError` for an ``OSError`` (missing parent, not a directory, name too
long, read-only file system, permission denied, NUL byte in the path) with the path and
the reason in plain words.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KVTierError, KVTierUsageError
from kvtier.units import format_size

FILE_MODE = 0o600
DIR_MODE = 0o700
GROUP_FILE_MODE = 0o660
GROUP_DIR_MODE = 0o770


class UnsafeStoreError(KVTierError, OSError):
    """Something inside a store is a symlink, or not the kind of file it must be.

    Also an ``OSError``, so that code handling I/O failures page by page (a slab
    replaced by a symlink while the store is open) treats it as one: the page fails, the
    symlink's target is never touched."""


class StorePathError(KVTierUsageError, OSError):
    """A store path cannot be used (does not exist, not a directory, not writable...).
    Also an ``OSError``, as the failure it reports."""


@dataclass(frozen=True)
class Modes:
    """Permission bits of a store's files and directories."""

    file: int = FILE_MODE
    dir: int = DIR_MODE

    @classmethod
    def for_option(cls, group_access: object, backend: str) -> Modes:
        """The modes for a store's ``group_access`` option (a bool)."""
        if not isinstance(group_access, bool):
            from kvtier.errors import ConfigError

            raise ConfigError(
                f"{backend}: option 'group_access' must be true or false, got {group_access!r}"
            )
        return cls(GROUP_FILE_MODE, GROUP_DIR_MODE) if group_access else cls()


def describe_os_error(exc: OSError) -> str:
    """The reason of an ``OSError`` in plain words (``strerror``, else the message)."""
    if exc.errno == errno.ENAMETOOLONG:
        return "file name too long"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return f"too many open files (the process's open-file limit, ulimit -n, is {soft})"
    return exc.strerror or str(exc)


def free_space(path: str | os.PathLike[str]) -> str:
    """How much room the file system holding ``path`` has left for this process, in words
    (``"0 B free"``, ``"12.5 MiB free"``: :func:`~kvtier.units.format_size`), or why it
    cannot be told."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return f"unknown free space ({describe_os_error(exc)})"
    return f"{format_size(st.f_bavail * st.f_frsize)} free"


def check_path_text(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a :class:`Path`; :class:`StorePathError` for an empty path or a NUL
    byte (which the OS cannot take)."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise StorePathError(f"{what}: the path is empty")
    if "\x00" in text:
        raise StorePathError(f"{what}: the path {text!r} contains a NUL byte")
    # "~/kv" in a TOML file or a KVTIER_* variable means the home directory (no shell
    # expanded it); taken literally it made a directory named "~" in the working directory
    return Path(text).expanduser()


def _unsafe(path: Path, root: Path | None, why: str) -> UnsafeStoreError:
    where = f" inside store {root}" if root is not None else ""
    return UnsafeStoreError(f"refusing {path}{where}: {why}; the store never follows it")


def _link_text(path: Path) -> str:
    try:
        return f"a symlink to {os.readlink(path)!r}"
    except OSError:
        return "a symlink"


def _missing_parents(path: Path) -> tuple[list[Path], Path]:
    """The missing directories of ``path`` (itself first, then its missing parents) and
    its nearest existing ancestor (or the root, when nothing exists)."""
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    return missing, p


def nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (where a store made there would
    live: its file system)."""
    return _missing_parents(path)[1]


def make_store_root(path: Path, modes: Modes, what: str, fix_mode: bool = True) -> bool:
    """Create the store directory ``path`` (and missing parents, each with ``modes.dir``)
    or check the existing one; with ``fix_mode``, bring an existing one to ``modes.dir``
    (pass ``False`` to do that only after the caller's own checks passed, with
    :func:`set_mode`, so that a directory it refuses keeps its modes). Returns whether it
    was created.

    The root itself may be a symlink to a directory (the user's path). Raises
    :class:`StorePathError` when it exists and is not a directory, or cannot be created.
    """
    missing, p = _missing_parents(path)
    try:
        if missing and not p.is_dir() and os.path.lexists(p):
            raise StorePathError(f"{what}: cannot create {path}: {p} exists and is not a directory")
        for d in reversed(missing):
            try:
                os.mkdir(d, modes.dir)
            except FileExistsError:
                if not d.is_dir():
                    raise
            else:
                os.chmod(d, modes.dir)  # the umask may have removed bits the modes keep
        if not path.is_dir():
            raise StorePathError(f"{what}: {path} exists and is not a directory")
        if not missing and fix_mode:
            set_mode(path, modes.dir)
    except OSError as exc:
        raise StorePathError(f"{what}: cannot use {path}: {describe_os_error(exc)}") from exc
    return bool(missing)


def set_mode(path: Path | int, mode: int) -> None:
    """Give ``path`` (or an open descriptor) exactly the permission bits ``mode``, when it
    has others; a file owned by someone else that cannot be changed is left as it is."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(path)
        if stat.S_IMODE(st.st_mode) != mode:
            if isinstance(path, int):
                os.fchmod(path, mode)
            else:
                os.chmod(path, mode)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
            raise


def private_dir(path: Path, modes: Modes, root: Path | None, create: bool = True) -> bool:
    """Check (or create, with ``modes.dir``) a directory inside a store; return whether it
    exists now. Raises :class:`UnsafeStoreError` when it is a symlink or not a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            os.mkdir(path, modes.dir)
        except FileExistsError:
            return private_dir(path, modes, root, create=False)
        os.chmod(path, modes.dir)
        return True
    if stat.S_ISLNK(st.st_mode):
        raise _unsafe(path, root, f"it is {_link_text(path)}")
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, root, "it should be a directory but is a file")
    if stat.S_IMODE(st.st_mode) != modes.dir:
        set_mode(path, modes.dir)
    return True


def check_no_symlink(path: Path, root: Path | None, want: str = "file") -> bool:
    """Whether ``path`` exists; :class:`UnsafeStoreError` when it is a symlink or not a
    regular file (``want="file"``) / directory (``want="dir"``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _unsafe(path, root, f"it is {_link_text(path)}")
    ok = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not ok:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise _unsafe(
            path, root, f"it should be a {'directory' if want == 'dir' else 'file'} but is {kind}"
        )
    if want != "dir":
        check_single_link(path, root, st)
    return True


def check_single_link(path: Path, root: Path | None, st: os.stat_result) -> None:
    """:class:`UnsafeStoreError` when the regular file ``path`` (its stat ``st``) has
    another name (a hard link, perhaps outside the store): writing or ``chmod``-ing it
    would change that file too. A store never makes hard links."""
    if st.st_nlink > 1:
        raise _unsafe(
            path, root, f"it has {st.st_nlink} hard links (another name shares its bytes)"
        )


def open_private(
    path: Path,
    flags: int,
    modes: Modes,
    root: Path | None,
    *,
    fix_mode: bool = True,
) -> int:
    """``os.open`` with ``O_NOFOLLOW | O_CLOEXEC``; a file this call creates gets exactly
    ``modes.file``, and so does an existing file of ours with ``fix_mode`` (pass
    ``False`` to only read, e.g. for inspection on read-only media). Raises
    :class:`UnsafeStoreError` for a symlink, a directory, another non-regular file or a
    file with another hard link at ``path`` (its target is never opened, and a FIFO
    planted there does not block the open: ``O_NONBLOCK`` until the file is known to be
    regular); ``OSError`` otherwise."""
    full = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    existed = (flags & os.O_CREAT) == 0 or os.path.lexists(path)
    try:
        fd = os.open(path, full, modes.file)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(path)):
            raise _unsafe(path, root, f"it is {_link_text(path)}") from None
        if exc.errno == errno.EISDIR:
            raise _unsafe(path, root, "it should be a file but is a directory") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened to write
            raise _unsafe(path, root, "it should be a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unsafe(path, root, "it should be a regular file")
        check_single_link(path, root, st)
        os.set_blocking(fd, True)
        mine = not existed or (fix_mode and st.st_uid == os.geteuid())
        if stat.S_IMODE(st.st_mode) != modes.file and mine:
            set_mode(fd, modes.file)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private_file(path: Path, modes: Modes, root: Path | None) -> None:
    """Create ``path`` empty with ``modes.file`` if missing (no symlink followed), so that
    a library that opens it later (SQLite) finds the right modes; fix its modes if it
    exists."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT, modes, root)
    os.close(fd)


# -- checking without side effects (``kvtier inspect config --check``) --------------------


def missing_store_note(path: Path, what: str) -> str | None:
    """For a check without side effects: ``None`` when ``path`` exists, else what opening
    would do, after checking that it could (``"X will be created (Y is writable)"``).
    Raises :class:`StorePathError` for a symlink to nothing, or a path that cannot be
    created (:func:`check_creatable`)."""
    if os.path.exists(path):
        return None
    if os.path.lexists(path):
        raise StorePathError(f"{what} {path} is a symlink to nothing")
    return f"{path} will be created ({check_creatable(path, what)} is writable)"


def check_creatable(path: Path, what: str) -> Path:
    """Check, leaving nothing behind, that the missing directory ``path`` (and its
    missing parents) could be made as :func:`make_store_root` makes them: the nearest
    existing ancestor is a directory in which a directory can really be made (one with a
    unique hidden name is made and removed at once, :func:`try_mkdir`: ``access()``
    answers yes for root even where the file system refuses, as under ``/sys`` or
    ``/proc``), and no missing name is too long. Returns that ancestor; raises
    :class:`StorePathError` naming it and why."""
    missing, p = _missing_parents(path)
    try:
        if not p.is_dir():
            raise StorePathError(f"{what}: cannot create {path}: {p} exists and is not a directory")
        why = try_mkdir(p)
        if why is not None:
            raise StorePathError(f"{what}: cannot create {path}: {p} is not writable ({why})")
        longest = os.pathconf(p, "PC_NAME_MAX")
    except StorePathError:
        raise
    except OSError as exc:
        raise StorePathError(f"{what}: cannot use {path}: {describe_os_error(exc)}") from exc
    for d in missing:
        if len(os.fsencode(d.name)) > longest:
            raise StorePathError(f"{what}: cannot create {path}: file name too long ({d.name!r})")
    return p


def try_mkdir(parent: Path) -> str | None:
    """Whether a directory can be made in ``parent``: ``None`` when one with a unique
    hidden name (``.kvtier-check-*``) was made and removed again, else why not, in words.
    Only the parent's modification time changes."""
    try:
        probe = tempfile.mkdtemp(prefix=".kvtier-check-", dir=parent)
    except OSError as exc:
        if exc.errno == errno.EROFS or _read_only_fs(parent):
            return "read-only file system"
        if exc.errno == errno.EACCES:
            return "permission denied"
        return f"making a directory there fails: {describe_os_error(exc)}"
    os.rmdir(probe)
    return None


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_writable(path: Path, what: str) -> None:
    """:class:`StorePathError` when the existing directory ``path`` cannot be written
    (files created or removed in it), naming why; checks without writing anything."""
    if not os.access(path, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only_fs(path) else "permission denied"
        raise StorePathError(f"{what} {path} is not writable ({why}); the store needs write access")


def lock_holder(path: Path, root: Path) -> str | None:
    """Whether a store object holds the ``flock`` on the lock file ``path``, creating and
    changing nothing: the file (when it exists) is opened read-only and a shared lock
    tried, then dropped. ``None`` when it is free (or missing), else what the file says
    of its holder (a pid, or ``""``). :class:`UnsafeStoreError` for a symlink."""
    try:
        fd = open_private(path, os.O_RDONLY, Modes(), root, fix_mode=False)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip()
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
