"""Checks of an NVMe store's metadata and index rows before any of it is trusted.

An index is a file on disk: it may be damaged or edited. Nothing it says is used until it
is checked here:

* :func:`parse_meta`: every meta value the store needs is an integer in range
  (:class:`~kvtier.backends.nvme_index.DamagedStoreError` names the first that is not;
  :class:`~kvtier.backends.nvme_index.StoreVersionError` for a newer format).
* :func:`slab_extents`: the slots each slab file on disk really holds (no symlink
  followed). This bounds everything else: a row must point inside it.
* :func:`check_index`: every ``pages`` row (key of 16 bytes, slot inside a slab file on
  disk, slab and offset that match the slot, length equal to the page size, a 64-bit
  checksum, a text namespace, a numeric time, no slot or key twice) and every
  ``quarantine`` row. Rows that fail are reported with why, to be dropped (and their slot
  quarantined when it lies inside a slab), never used.

Memory stays bounded by the store's real size: rows are streamed, only valid rows are kept
(at most one per slot of the slab files on disk), and the free list built by
:func:`free_slots` covers slots of slab files that exist only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.backends.nvme_index import (
    STORE_FORMAT_VERSION,
    DamagedStoreError,
    PageRow,
    RawRow,
    StoreVersionError,
)
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_slabs import SLAB_DIR, slab_index
from kvtier.backends.store_files import check_no_symlink

from kvtier.keys import KEY_BYTES

#: Largest file size the store accepts for a slab (and meta values derived from it).
MAX_SLAB_BYTES = 1 << 62
#: Problems described one by one; beyond this many only counted.
MAX_LISTED = 20


def _rebuild_hint(root: Path) -> str:
    return f"rebuild the index from the slabs with 'kvtier inspect store {root} --rebuild-index'"


def _meta_int(meta: Mapping[str, str], name: str, root: Path, low: int, high: int) -> int:
    text = meta.get(name)
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        value = None
    if value is None or not low <= value <= high:
        raise DamagedStoreError(
            f"NVMe store {root}: index meta value {name} = {text!r} is not an integer in "
            f"[{low}, {high}]; {_rebuild_hint(root)}"
        )
    return value


@dataclass(frozen=True)
class StoreMeta:
    """The checked meta record of a store."""

    format_version: int
    layout: SlotLayout
    capacity_pages: int | None


def parse_meta(meta: Mapping[str, str], root: Path) -> StoreMeta | None:
    """The store's checked meta record, or ``None`` when it has no format record (a new
    or emptied index). Raises :class:`DamagedStoreError` / :class:`StoreVersionError`."""
    if "format_version" not in meta:
        return None
    version = _meta_int(meta, "format_version", root, 1, 1 << 31)
    if version > STORE_FORMAT_VERSION:
        raise StoreVersionError(
            f"NVMe store {root} has format version {version}, newer than the "
            f"{STORE_FORMAT_VERSION} this kvtier reads; upgrade kvtier"
        )
    page_bytes = _meta_int(meta, "page_bytes", root, 1, MAX_SLAB_BYTES)
    slot_bytes = SlotLayout(page_bytes, 1).slot_bytes
    per_slab = _meta_int(meta, "slots_per_slab", root, 1, max(1, MAX_SLAB_BYTES // slot_bytes))
    layout = SlotLayout(page_bytes, per_slab)
    if "slot_bytes" in meta:
        recorded = _meta_int(meta, "slot_bytes", root, 1, MAX_SLAB_BYTES)
        if recorded != layout.slot_bytes:
            raise DamagedStoreError(
                f"NVMe store {root}: index meta slot_bytes = {recorded} does not match pages "
                f"of {page_bytes} bytes (slots of {layout.slot_bytes}); {_rebuild_hint(root)}"
            )
    capacity = (
        _meta_int(meta, "capacity_pages", root, 0, 1 << 62) if "capacity_pages" in meta else None
    )
    return StoreMeta(version, layout, capacity)


def slab_files(root: Path) -> dict[int, int]:
    """``{slab index: file size}`` of the slab files in ``root/slabs`` (files not named
    ``slab-NNNNN.dat`` are ignored). Raises
    :class:`~kvtier.backends.store_files.UnsafeStoreError` for a symlink."""
    out: dict[int, int] = {}
    directory = root / SLAB_DIR
    if not check_no_symlink(directory, root, want="dir"):
        return out
    for entry in os.scandir(directory):
        index = slab_index(entry.name)
        if index is None:
            continue
        check_no_symlink(Path(entry.path), root)
        out[index] = entry.stat(follow_symlinks=False).st_size
    return out


def slab_extents(root: Path, layout: SlotLayout) -> dict[int, int]:
    """``{slab index: slots its file holds}`` (at most ``slots_per_slab``)."""
    return {
        i: min(layout.slots_per_slab, size // layout.slot_bytes)
        for i, size in slab_files(root).items()
    }


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class CheckedIndex:
    """The outcome of :func:`check_index`.

    Attributes:
        rows: the valid page rows.
        quarantined: valid quarantined slots and their reasons.
        bad_page_rowids / bad_quarantine_rowids: rows to delete.
        new_quarantine: slots of bad page rows that lie inside a slab: quarantined.
        problems: a description of the first ``listed`` bad rows (:data:`MAX_LISTED`
            unless :func:`check_index` was told otherwise; ``None``: all).
        bad_rows: how many rows (of both tables) were bad.
    """

    rows: list[PageRow] = field(default_factory=list)
    quarantined: dict[int, str] = field(default_factory=dict)
    bad_page_rowids: list[int] = field(default_factory=list)
    bad_quarantine_rowids: list[int] = field(default_factory=list)
    new_quarantine: list[tuple[int, bytes | None, str]] = field(default_factory=list)
    problems: list[dict[str, object]] = field(default_factory=list)
    bad_rows: int = 0
    listed: int | None = MAX_LISTED

    def _bad(self, table: str, rowid: object, key: object, slot: object, why: str) -> None:
        self.bad_rows += 1
        if self.listed is None or len(self.problems) < self.listed:
            self.problems.append(
                {
                    "table": table,
                    "rowid": rowid,
                    "key": key.hex() if isinstance(key, bytes) else repr(key)[:40],
                    "slot": slot if _int(slot) is not None else repr(slot)[:40],
                    "reason": why,
                }
            )


def _in_slabs(slot: int, layout: SlotLayout, extents: Mapping[int, int]) -> bool:
    """Whether the slot's bytes lie inside a slab file on disk."""
    slab, index = divmod(slot, layout.slots_per_slab)
    return index < extents.get(slab, 0)


def _in_slab_files(slot: int, layout: SlotLayout, extents: Mapping[int, int]) -> bool:
    """Whether the slot belongs to a slab file on disk (perhaps past its end, when the
    file was cut short): such a slot can be quarantined."""
    return slot // layout.slots_per_slab in extents


def _row_problem(raw: RawRow, layout: SlotLayout, extents: Mapping[int, int]) -> str | None:
    """Why the ``pages`` row is invalid, or ``None``."""
    if len(raw) != 9:
        return f"row has {len(raw)} columns, expected 9"
    _rowid, key, slot, slab, offset, length, checksum, namespace, created = raw
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        size = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        return f"key is {size}, not a {KEY_BYTES}-byte page key"
    s = _int(slot)
    if s is None or s < 0:
        return f"slot {slot!r} is not an integer >= 0"
    if not _in_slabs(s, layout, extents):
        slab_of = s // layout.slots_per_slab
        if slab_of in extents:
            return f"slot {s} lies past the end of slab file {slab_of} (cut short)"
        return f"slot {s} lies outside the slab files on disk"
    want_slab, want_offset = layout.locate(s)
    if _int(slab) != want_slab or _int(offset) != want_offset:
        return (
            f"slab {slab!r} / offset {offset!r} do not match slot {s} "
            f"(slab {want_slab}, offset {want_offset})"
        )
    if _int(length) != layout.page_bytes:
        return f"length {length!r} is not the page size {layout.page_bytes}"
    c = _int(checksum)
    if c is None or not -(1 << 63) <= c < 1 << 63:
        return f"checksum {checksum!r} is not a 64-bit integer"
    if not isinstance(namespace, str):
        return f"namespace {namespace!r} is not text"
    if (
        isinstance(created, bool)
        or not isinstance(created, int | float)
        or not math.isfinite(created)
    ):
        return f"created {created!r} is not a time"
    return None


def check_index(
    raw_pages: Iterable[RawRow],
    raw_quarantine: Iterable[RawRow],
    layout: SlotLayout,
    extents: Mapping[int, int],
    listed: int | None = MAX_LISTED,
) -> CheckedIndex:
    """Sort an index's rows into valid and invalid ones (see the module docstring);
    ``problems`` describes the first ``listed`` bad rows (``None``: every one)."""
    out = CheckedIndex(listed=listed)
    for raw in raw_quarantine:
        rowid, slot, reason = (*raw, None, None, None)[:3]
        s = _int(slot)
        if s is None or s < 0 or not _in_slab_files(s, layout, extents):
            problem = f"quarantined slot {slot!r} lies outside the slab files on disk"
        elif s in out.quarantined:
            problem = f"slot {s} is quarantined twice"
        else:
            out.quarantined[s] = str(reason)
            continue
        out._bad("quarantine", rowid, None, slot, problem)
        if _int(rowid) is not None:
            out.bad_quarantine_rowids.append(rowid)  # type: ignore[arg-type]
    used: set[int] = set(out.quarantined)
    keys: set[bytes] = set()
    from kvtier.backends.nvme_index import _unsigned

    for raw in raw_pages:
        why = _row_problem(raw, layout, extents)
        rowid = raw[0] if raw else None
        key = raw[1] if len(raw) > 1 else None
        slot = raw[2] if len(raw) > 2 else None
        if why is None:
            s = int(slot)  # type: ignore[call-overload]
            if s in out.quarantined:
                why = f"slot {s} is quarantined"
            elif s in used:
                why = f"slot {s} is already held by another page"
            elif key in keys:
                why = "key is indexed twice"
        if why is None:
            _, k, s_, sl, off, ln, c, ns, cr = raw
            used.add(s_)  # type: ignore[arg-type]
            keys.add(k)  # type: ignore[arg-type]
            out.rows.append(
                PageRow(k, s_, sl, off, ln, _unsigned(c), ns, float(cr))  # type: ignore[arg-type]
            )
            continue
        out._bad("pages", rowid, key, slot, why)
        if _int(rowid) is not None:
            out.bad_page_rowids.append(rowid)  # type: ignore[arg-type]
        s = _int(slot)
        if s is not None and s >= 0 and _in_slab_files(s, layout, extents) and s not in used:
            used.add(s)
            out.quarantined[s] = f"index row was invalid: {why}"
            out.new_quarantine.append(
                (s, key if isinstance(key, bytes) else None, out.quarantined[s])
            )
    return out


def free_slots(
    used: Iterable[int], layout: SlotLayout, extents: Mapping[int, int]
) -> tuple[list[int], int]:
    """``(free slots, high-water mark)``: the free slots are the slots of slab files on
    disk below the high-water mark (one past the highest slot used) that nothing uses.
    Slots of slab files that do not exist are not listed (new slots come from the mark
    upward), so the list is bounded by the slab files' real size."""
    taken = set(used)
    hwm = max(taken) + 1 if taken else 0
    per = layout.slots_per_slab
    free: list[int] = []
    for slab in sorted(extents):
        start = slab * per
        if start >= hwm:
            break
        free.extend(s for s in range(start, min(start + per, hwm)) if s not in taken)
    return free, hwm
