"""Opening an NVMe store's files: the sequence behind :meth:`NvmeStore.open`.

:func:`open_store` (blocking; run on a worker thread) checks the directory (private
modes, no symlinks: :mod:`~kvtier.backends.store_files`), takes the writer's lock, opens
the index, checks its meta record and every row (:mod:`~kvtier.backends.nvme_validate`),
and returns what the store needs to run. It repairs what it can, loudly:

* an index that is missing, empty or has lost its ``pages`` table while slab files are
  present is **rebuilt from the slabs** (:mod:`~kvtier.backends.nvme_rebuild`), with a
  warning, instead of silently starting an empty store over the old slabs;
* invalid index rows are dropped and their slots quarantined, each logged as an error
  (the first :data:`~kvtier.backends.nvme_validate.MAX_LISTED`, then a count);
* a store that holds no page but was made for another page size is re-initialised for
  this one, with a warning (``nvme.page_size_reset``): nothing can be lost, and a store
  that a check or an earlier run created for another model does not make the tier
  unusable. A store that holds pages of another size is refused (:class:`ConfigError`).

What it cannot repair it refuses with an error that names it: an index file that is not a
database (:class:`~kvtier.backends.nvme_index.NotAStoreError`), a meta record that does
not parse (:class:`~kvtier.backends.nvme_index.DamagedStoreError`), a symlink
(:class:`~kvtier.backends.store_files.UnsafeStoreError`). An index SQLite cannot open or
update because of the environment (a full file system, an I/O error) is not called
damaged: :class:`~kvtier.backends.nvme_index.StoreUnavailableError` (or
``StoreReadOnlyError``) names the path, SQLite's error and the free space, and the store
is left as it was. Everything taken is released when it raises.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.backends.fd_limit import make_fd_room
from kvtier.backends.nvme_dir import page_size_conflict, sqlite_environment_error
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    STORE_FORMAT_VERSION,
    DamagedStoreError,
    PageRow,
    StoreIndex,
    StoreLock,
    check_store_dir,
)
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_rebuild import (
    RebuildResult,
    has_slab_data,
    infer_layout,
    remove_index_files,
    scan_slabs,
    write_index,
)
from kvtier.backends.nvme_slabs import SlabFiles, probe_direct_io, slab_path
from kvtier.backends.nvme_validate import (
    MAX_LISTED,
    check_index,
    free_slots,
    parse_meta,
    slab_extents,
    slab_files,
)
from kvtier.backends.store_files import Modes

from kvtier.errors import ConfigError
from kvtier.log import get_logger


def _log() -> Any:
    return get_logger("kvtier.backends.nvme")


@dataclass
class OpenedStore:
    """Everything :func:`open_store` took and found."""

    lock: StoreLock
    index: StoreIndex
    layout: SlotLayout
    slabs: SlabFiles
    direct: bool
    direct_reason: str | None
    rows: list[PageRow]
    quarantined: dict[int, str]
    free: list[int]
    hwm: int
    slab_slots: dict[int, int]
    rebuilt: RebuildResult | None
    dropped_rows: int

    def close(self) -> None:
        """Release what was taken (when the caller fails after :func:`open_store`)."""
        self.slabs.close()
        self.index.close()
        self.lock.release()


def open_store(
    root: Path,
    *,
    page_bytes: int,
    slab_bytes: int,
    capacity_pages: int,
    engine: str,
    direct_io: bool | str,
    modes: Modes,
) -> OpenedStore:
    """Open (creating, repairing or rebuilding) the store at ``root``; see the module
    docstring. Raises the store errors named there and :class:`ConfigError` (the store
    holds pages of another size, O_DIRECT required but refused)."""
    check_store_dir(root, create=True, modes=modes)
    lock = StoreLock(root, exclusive=True, modes=modes)
    index: StoreIndex | None = None
    slabs: SlabFiles | None = None
    try:
        index = StoreIndex(root / INDEX_FILE, modes=modes)
        index, layout, rebuilt = _meta_or_rebuild(
            root, index, page_bytes, slab_bytes, capacity_pages, modes
        )
        index.set_meta({"capacity_pages": capacity_pages, "engine": engine})
        reason: str | None = "disabled by option"
        direct, dsync = False, False
        if direct_io is not False:
            reason, dsync = probe_direct_io(root, modes)
            if reason is not None and direct_io is True:
                raise ConfigError(f"nvme: direct_io=true but {root} refuses it: {reason}")
            direct = reason is None
        # before the slab files are opened (all of them, at once)
        slab_count = max(-(-capacity_pages // layout.slots_per_slab), len(slab_files(root)))
        make_fd_room(slab_count, f"NVMe store {root} ({slab_count} slab files)", _log())
        slabs = SlabFiles(root, layout, direct, dsync=direct and dsync, modes=modes)
        extents = slab_extents(root, layout)
        checked = check_index(index.raw_rows(), index.raw_quarantine(), layout, extents)
        if checked.bad_rows:
            _report_bad_rows(root, index, checked)
        used = [r.slot for r in checked.rows] + list(checked.quarantined)
        free, hwm = free_slots(used, layout, extents)
    except BaseException as exc:
        if slabs is not None:
            slabs.close()
        if index is not None:
            index.close()
        lock.release()
        if isinstance(exc, sqlite3.DatabaseError):
            raise _index_error(root, exc) from exc
        raise
    return OpenedStore(
        lock,
        index,
        layout,
        slabs,
        direct,
        reason,
        checked.rows,
        checked.quarantined,
        free,
        hwm,
        extents,
        rebuilt,
        checked.bad_rows,
    )


def _index_error(root: Path, exc: sqlite3.DatabaseError) -> Exception:
    """What an SQLite error met while opening means: the environment failed (disk full,
    I/O error: the store not judged, nothing changed) or the index is damaged."""
    env = sqlite_environment_error(root / INDEX_FILE, exc, "update")
    if env is not None:
        return env
    return DamagedStoreError(
        f"NVMe store {root}: its index cannot be updated ({exc}); rebuild it from the "
        f"slabs with 'kvtier inspect store {root} --rebuild-index'"
    )


def _meta_or_rebuild(
    root: Path,
    index: StoreIndex,
    page_bytes: int,
    slab_bytes: int,
    capacity_pages: int,
    modes: Modes,
) -> tuple[StoreIndex, SlotLayout, RebuildResult | None]:
    """The store's layout from its meta record; a new meta record for a new store; or a
    rebuilt index when the old one lost its record or its pages but slabs hold data."""
    meta = parse_meta(index.meta(), root)
    lost_pages = meta is not None and "pages" not in index.tables_at_open
    lost_record = meta is None and index.count("pages") > 0
    if meta is not None and meta.layout.page_bytes != page_bytes:
        held = index.count("pages") if not lost_pages else None
        if held != 0:
            raise ConfigError(page_size_conflict(root, meta.layout.page_bytes, page_bytes))
        return index, _reset_page_size(root, index, meta.layout.page_bytes, page_bytes,
                                       slab_bytes, capacity_pages), None  # fmt: skip
    if meta is not None and not lost_pages:
        return index, meta.layout, None
    if not has_slab_data(root) and not lost_record:
        if meta is None:  # a new store
            return index, _new_layout(index, page_bytes, slab_bytes, capacity_pages), None
        return index, meta.layout, None  # lost an empty pages table: nothing was lost
    why = (
        "has lost its pages table"
        if lost_pages
        else "has pages but no format record"
        if lost_record
        else "is missing or empty"
    )
    layout = meta.layout if meta is not None else infer_layout(root, page_bytes)
    _log().warning(
        "nvme.index_rebuilding",
        path=str(root),
        reason=f"the index {why} but slab files are present: rebuilding it from the slabs",
    )
    result = scan_slabs(root, layout)
    index.close()
    remove_index_files(root)
    index = StoreIndex(root / INDEX_FILE, modes=modes)
    write_index(index, result, capacity_pages, None)
    _log().warning(
        "nvme.index_rebuilt",
        path=str(root),
        pages=len(result.rows),
        damaged_slots=result.damaged_slots,
        duplicate_slots=result.duplicate_slots,
        seconds=round(result.seconds, 3),
    )
    return index, layout, result


def _new_layout(
    index: StoreIndex, page_bytes: int, slab_bytes: int, capacity_pages: int
) -> SlotLayout:
    """The layout of a new store, recorded in its meta record."""
    layout = SlotLayout.for_page(page_bytes, slab_bytes, capacity_pages)
    index.set_meta(
        {
            "format_version": STORE_FORMAT_VERSION,
            "page_bytes": page_bytes,
            "slot_bytes": layout.slot_bytes,
            "slots_per_slab": layout.slots_per_slab,
            "created": time.time(),
        }
    )
    return layout


def _reset_page_size(
    root: Path,
    index: StoreIndex,
    old_page_bytes: int,
    page_bytes: int,
    slab_bytes: int,
    capacity_pages: int,
) -> SlotLayout:
    """Re-initialise a store that holds no page for another page size (no data can be
    lost: its slabs hold no committed page), with a warning: its slab files (cut for the
    old slot size) and quarantine rows are removed, then the meta record is rewritten.
    A crash half-way leaves a store that holds no page, which the next open resets again."""
    _log().warning(
        "nvme.page_size_reset",
        path=str(root),
        old_page_bytes=old_page_bytes,
        page_bytes=page_bytes,
        reason="the store holds no pages: re-initialised for the new page size",
    )
    for number in slab_files(root):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slab_path(root, number))
    quarantined = [rowid for rowid, *_ in index.raw_quarantine() if isinstance(rowid, int)]
    if quarantined:
        index.drop_rows([], quarantined, [])
    return _new_layout(index, page_bytes, slab_bytes, capacity_pages)


def _report_bad_rows(root: Path, index: StoreIndex, checked: Any) -> None:
    """Log each bad row (the first few) and drop them from the index; a failure to drop
    them is logged (they are ignored either way)."""
    for problem in checked.problems:
        _log().error("nvme.index_row_quarantined", path=str(root), **problem)
    if checked.bad_rows > MAX_LISTED:
        _log().error(
            "nvme.index_rows_quarantined",
            path=str(root),
            rows=checked.bad_rows,
            listed=MAX_LISTED,
        )
    try:
        index.drop_rows(
            checked.bad_page_rowids, checked.bad_quarantine_rowids, checked.new_quarantine
        )
    except Exception as exc:
        _log().error("nvme.index_repair_failed", path=str(root), error=str(exc))
