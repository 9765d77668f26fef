"""Checking an NVMe store directory without touching it: :meth:`NvmeStore.preflight`
(behind ``kvtier inspect config --check``).

:func:`preflight_store` creates, locks and changes nothing: a missing directory is
reported as one that will be created once its nearest existing parent is found writable;
an existing one is checked as opening it checks it (a store or an empty directory, no
symlink inside, writable, not open in another process) and its index is read read-only
(:class:`~kvtier.backends.nvme_index.StoreIndex` with ``readonly``, which leaves no
``-wal``/``-shm`` file behind). It says what opening would do (create the store, rebuild
its index from the slabs, re-initialise an empty store for another page size) and raises
what opening would raise, except for a store that holds pages of another size: that is
:attr:`~kvtier.backend.Preflight.page_size_conflict`.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.backends.nvme_dir import (
    NotAStoreError,
    StoreUnavailableError,
    check_only_store_files,
    not_a_directory,
    page_size_conflict,
)
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    LOCK_FILE,
    StoreIndex,
    StoreLockedError,
    StoreReadOnlyError,
    check_store_dir,
    check_store_entries,
)
from kvtier.backends.nvme_rebuild import has_slab_data
from kvtier.backends.nvme_slabs import SLAB_DIR
from kvtier.backends.nvme_validate import parse_meta
from kvtier.backends.store_files import (
    StorePathError,
    check_path_text,
    check_writable,
    describe_os_error,
    lock_holder,
    missing_store_note,
    nearest_existing,
)

from kvtier.backend import Preflight
from kvtier.errors import ConfigError
from kvtier.units import format_size


def preflight_store(path: str | os.PathLike[str], page_bytes: int) -> Preflight:
    """What opening the NVMe store at ``path`` for pages of ``page_bytes`` bytes would
    find, creating and changing nothing (see the module docstring).

    Raises :class:`~kvtier.backends.store_files.StorePathError` (cannot be created or
    written), :class:`NotAStoreError` (a file, foreign content, an index that is not a
    database), :class:`~kvtier.backends.store_files.UnsafeStoreError` (a symlink
    inside), :class:`StoreLockedError` (open in another process), the index's errors
    (damaged meta record, newer format) and :class:`ConfigError` for pages of another
    size when the index lost its pages table (opening cannot tell how many it holds).
    """
    root = check_path_text(path, "NVMe store")
    missing = missing_store_note(root, "NVMe store")
    if missing is not None:
        return Preflight(missing)
    if not _is_dir(root):
        raise NotAStoreError(not_a_directory(root))
    has_index = (root / INDEX_FILE).exists()
    if has_index or (root / SLAB_DIR).is_dir():
        check_store_dir(root, create=False)  # a store: no symlink inside, no foreign file
    else:
        _check_empty(root)
    check_writable(root, "NVMe store directory")
    holder = lock_holder(root / LOCK_FILE, root)
    if holder is not None:
        raise StoreLockedError(
            f"NVMe store {root} is open in another process (holder pid {holder or 'unknown'});"
            " a store has one writer at a time"
        )
    if not has_index:
        if has_slab_data(root):
            return Preflight(f"{root} has slab files but no index: opening rebuilds it")
        return Preflight(f"the store will be created in {root}")
    return _read_index(root, page_bytes)


def _is_dir(root: Path) -> bool:
    """Whether the existing ``root`` is a directory (following a symlink: the store
    directory may be one); :class:`StorePathError` when it cannot be looked at."""
    try:
        return root.is_dir()
    except OSError as exc:
        raise StorePathError(f"NVMe store {root}: {describe_os_error(exc)}") from exc


def _check_empty(root: Path) -> None:
    """An existing directory without an index or slabs: empty, or only store files
    (a lock left by an open that failed); :class:`NotAStoreError` naming other files."""
    check_store_entries(root)
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise StorePathError(f"NVMe store {root}: {describe_os_error(exc)}") from exc
    check_only_store_files(root, names)


def _read_index(root: Path, page_bytes: int) -> Preflight:
    """The store's page size and page count from its index, read read-only."""
    index_file = root / INDEX_FILE
    if not os.access(index_file, os.R_OK | os.W_OK):
        raise StoreReadOnlyError(f"NVMe store index {index_file} cannot be read and written")
    index = StoreIndex(index_file, readonly=True)
    try:
        tables = index.tables_at_open
        meta = parse_meta(index.meta(), root) if "meta" in tables else None
        pages = index.count("pages") if "pages" in tables else None
    finally:
        index.close()
    rebuilt = meta is None or pages is None
    if rebuilt and (has_slab_data(root) or (meta is None and bool(pages))):
        note = "its index lost its records: opening rebuilds it from the slab files"
        if meta is None or meta.layout.page_bytes == page_bytes:
            return Preflight(note)
    if meta is None:
        return Preflight(f"the store will be initialised in {root} (an empty index)")
    held = meta.layout.page_bytes
    if held == page_bytes:
        return Preflight(f"holds {_pages(pages or 0)} of {held} bytes")
    conflict = page_size_conflict(root, held, page_bytes)
    if pages is None:
        raise ConfigError(conflict)
    if pages == 0:
        return Preflight(
            f"holds no pages (made for pages of {held} bytes): opening re-initialises it "
            f"for pages of {page_bytes} bytes"
        )
    return Preflight(f"holds {_pages(pages)} of {held} bytes", page_size_conflict=conflict)


def _pages(n: int) -> str:
    return f"{n} page" if n == 1 else f"{n} pages"


def check_first_slab_room(path: str | os.PathLike[str], slab_bytes: int) -> None:
    """Refuse a store with no slab file yet whose first slab (``slab_bytes``, allocated
    whole at the first write) cannot fit the file system: every write would then fail
    with ENOSPC though the store opens fine. :class:`StoreUnavailableError` names the free
    space and what the slab needs. A store with slab files is left to its own checks."""
    root = Path(path)
    slabs = root / SLAB_DIR
    if slabs.is_dir() and any(p.name.startswith("slab-") for p in slabs.iterdir()):
        return
    st = os.statvfs(nearest_existing(root))
    free = st.f_bavail * st.f_frsize
    if free < slab_bytes:
        raise StoreUnavailableError(
            f"NVMe store {root}: the file system has {format_size(free)} free and the first "
            f"slab file needs {format_size(slab_bytes)}: every write would fail (no space); "
            "free space, or lower the tier's capacity or the slab_bytes option"
        )
