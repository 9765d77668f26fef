"""Rebuild an NVMe store's index from its slab files.

Every slot of a slab is self-describing: its 64-byte page header (:mod:`kvtier.pageformat`)
holds the page key, the payload length, the payload checksum and the namespace digest.
So when ``index.sqlite`` is deleted, emptied or damaged, the index can be written anew
from the slabs: each slot whose header is intact, whose length is the store's page size
and whose payload matches the checksum becomes a row again (namespace recorded as
``digest:<hex>``, since only the digest is on disk); every other slot is free. Nothing
that does not verify is ever indexed, so a rebuilt store serves no wrong byte.

Pages deleted before the index was lost may come back (their bytes stay in their slots
until overwritten); they are whole pages under their own content keys.

:func:`rebuild_index` is ``kvtier inspect store DIR --rebuild-index``; the store's
``open`` calls :func:`scan_slabs` by itself when the index is missing or has lost its
pages but slab files are present (with a warning).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    STORE_FORMAT_VERSION,
    DamagedStoreError,
    NotAStoreError,
    PageRow,
    StoreIndex,
    StoreLock,
    check_store_dir,
)
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_slabs import slab_path
from kvtier.backends.nvme_validate import MAX_SLAB_BYTES, slab_files
from kvtier.backends.store_files import Modes, open_private

from kvtier.errors import IntegrityError
from kvtier.pageformat import HEADER_SIZE, MAGIC, decode_header, digest_label, payload_checksum

#: Bytes of a slab searched for a page header when the page size must be inferred.
_SEARCH_BYTES = 256 << 20


@dataclass
class RebuildResult:
    """What a scan of the slabs found.

    Attributes:
        layout: the geometry used.
        rows: one row per verified page (the first slot found for a key).
        slots_scanned: slots read.
        damaged_slots: slots with a page header that does not verify (torn or damaged).
        duplicate_slots: verified pages whose key an earlier slot already held.
        seconds: time taken.
    """

    layout: SlotLayout
    rows: list[PageRow] = field(default_factory=list)
    slots_scanned: int = 0
    damaged_slots: int = 0
    duplicate_slots: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_bytes": self.layout.page_bytes,
            "slots_per_slab": self.layout.slots_per_slab,
            "pages": len(self.rows),
            "slots_scanned": self.slots_scanned,
            "damaged_slots": self.damaged_slots,
            "duplicate_slots": self.duplicate_slots,
            "seconds": self.seconds,
        }


def has_slab_data(root: Path) -> bool:
    """Whether ``root/slabs`` holds any non-empty slab file."""
    return any(size > 0 for size in slab_files(root).values())


def _find_page_bytes(root: Path, sizes: dict[int, int]) -> int | None:
    """The payload length of the first intact page header at a consistent position in the
    slabs (its offset minus its length is a multiple of its slot size), or ``None``."""
    for slab in sorted(sizes):
        if sizes[slab] == 0:
            continue
        fd = open_private(slab_path(root, slab), os.O_RDONLY, Modes(), root, fix_mode=False)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
                pos = mm.find(MAGIC, 0, _SEARCH_BYTES)
                while pos >= 0:
                    try:
                        header = decode_header(mm[pos : pos + HEADER_SIZE])
                    except IntegrityError:
                        header = None
                    if header is not None and 0 < header.payload_len <= pos:
                        slot_bytes = SlotLayout(header.payload_len, 1).slot_bytes
                        if (pos - header.payload_len) % slot_bytes == 0:
                            return header.payload_len
                    pos = mm.find(MAGIC, pos + 1, _SEARCH_BYTES)
        finally:
            os.close(fd)
    return None


def infer_layout(root: Path, page_bytes: int | None) -> SlotLayout:
    """The slot geometry of the slabs under ``root``: ``page_bytes`` (inferred from the
    first intact page header when ``None``) and slots per slab from the largest slab file.

    Raises :class:`DamagedStoreError` when there is no slab data, no page header to infer
    the page size from, or the slab sizes do not fit pages of that size.
    """
    sizes = slab_files(root)
    if not any(sizes.values()):
        raise DamagedStoreError(f"NVMe store {root}: no slab data to rebuild the index from")
    found = _find_page_bytes(root, sizes)
    if page_bytes is None:
        if found is None:
            raise DamagedStoreError(
                f"NVMe store {root}: no intact page header in the slabs, so the page size is "
                "unknown; give it (--page-bytes)"
            )
        page_bytes = found
    if found is not None and found != page_bytes:
        raise DamagedStoreError(
            f"NVMe store {root}: its page headers say pages of {found} bytes, not "
            f"{page_bytes}: use another directory for this page size"
        )
    slot_bytes = SlotLayout(page_bytes, 1).slot_bytes
    biggest = max(sizes.values())
    if biggest % slot_bytes or biggest > MAX_SLAB_BYTES:
        raise DamagedStoreError(
            f"NVMe store {root}: slab files of {biggest} bytes do not hold whole slots for "
            f"pages of {page_bytes} bytes (slots of {slot_bytes})"
        )
    return SlotLayout(page_bytes, biggest // slot_bytes)


def scan_slabs(
    root: Path,
    layout: SlotLayout,
    progress: Callable[[int], None] | None = None,
) -> RebuildResult:
    """Read every slot's header (and, when it is intact, its payload) and return the
    verified pages. Never writes. ``progress`` gets the number of slots scanned since its
    last call."""
    start = time.perf_counter()
    result = RebuildResult(layout)
    seen: set[bytes] = set()
    header = bytearray(HEADER_SIZE)
    payload = np.empty(layout.page_bytes, dtype=np.uint8)
    now = time.time()

    def scanned(n: int) -> None:  # count n slots; progress in steps of 1024
        before = result.slots_scanned
        result.slots_scanned += n
        crossed = result.slots_scanned // 1024 - before // 1024
        if progress is not None and crossed:
            progress(1024 * crossed)

    for slab, size in sorted(slab_files(root).items()):
        slots = min(layout.slots_per_slab, size // layout.slot_bytes)
        if not slots:
            continue
        fd = open_private(slab_path(root, slab), os.O_RDONLY, Modes(), root, fix_mode=False)
        try:
            data_until = 0  # bytes before this offset are known to hold data
            index = 0
            while index < slots:
                offset = index * layout.slot_bytes
                if offset >= data_until:
                    # skip the slab's holes (never written: free slots) without reading
                    # them: a sparse slab of 1 TiB took half an hour to scan, slot by slot
                    data_at, data_until = _next_data(fd, offset, size)
                    if data_at >= offset + layout.slot_bytes:
                        skip = min((data_at - offset) // layout.slot_bytes, slots - index)
                        scanned(skip)
                        index += skip
                        continue
                slot = slab * layout.slots_per_slab + index
                index += 1
                scanned(1)
                if os.preadv(fd, [header], offset + layout.page_bytes) < HEADER_SIZE:
                    continue
                if header[:4] != MAGIC:
                    continue  # never written: a free slot
                try:
                    h = decode_header(header)
                    if h.payload_len != layout.page_bytes:
                        raise IntegrityError("length differs from the page size")
                    got = os.preadv(fd, [payload.data], offset)
                    if got != layout.page_bytes or payload_checksum(payload) != h.checksum:
                        raise IntegrityError("payload checksum mismatch")
                except IntegrityError:
                    result.damaged_slots += 1
                    continue
                if h.key in seen:
                    result.duplicate_slots += 1
                    continue
                seen.add(h.key)
                result.rows.append(
                    PageRow(
                        h.key,
                        slot,
                        slab,
                        offset,
                        layout.page_bytes,
                        h.checksum,
                        digest_label(h.namespace_digest),
                        now,
                    )
                )
        finally:
            os.close(fd)
    if progress is not None and result.slots_scanned % 1024:
        progress(result.slots_scanned % 1024)
    result.seconds = time.perf_counter() - start
    return result


def _next_data(fd: int, offset: int, size: int) -> tuple[int, int]:
    """Where the next data at or after ``offset`` starts, and where that data ends
    (``SEEK_DATA`` / ``SEEK_HOLE``; ``size``, ``size`` past the last data; a file system
    without them reports all of the file as data)."""
    try:
        start = os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data after offset
            return size, size
        return offset, size  # not supported here: read it all
    try:
        end = os.lseek(fd, start, os.SEEK_HOLE)
    except OSError:
        end = size
    return start, max(end, start + 1)


def write_index(
    index: StoreIndex, result: RebuildResult, capacity_pages: int | None, engine: str | None
) -> None:
    """Fill an empty index with ``result``'s rows and the store's meta record."""
    meta: dict[str, object] = {
        "format_version": STORE_FORMAT_VERSION,
        "page_bytes": result.layout.page_bytes,
        "slot_bytes": result.layout.slot_bytes,
        "slots_per_slab": result.layout.slots_per_slab,
        "created": time.time(),
        "rebuilt": time.time(),
    }
    if capacity_pages is not None:
        meta["capacity_pages"] = capacity_pages
    if engine is not None:
        meta["engine"] = engine
    index.set_meta(meta)
    index.insert(result.rows)


def remove_index_files(root: Path) -> None:
    """Delete ``index.sqlite`` and its WAL and SHM files (the caller holds the lock)."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / f"{INDEX_FILE}{suffix}")


def rebuild_index(
    path: str | os.PathLike[str],
    page_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    group_access: bool = False,
) -> dict[str, Any]:
    """Replace the index of the (closed) store at ``path`` with one rebuilt from its slabs.

    The page size comes from ``page_bytes``, else from the old index's meta record when it
    can be read, else from the first intact page header. Takes the store's exclusive lock
    (:class:`~kvtier.backends.nvme_index.StoreLockedError` when it is open elsewhere).
    Returns :meth:`RebuildResult.to_dict` plus ``path`` and ``old_index`` (what became of
    the old one: ``missing``, ``readable`` (its meta record parsed), or what was wrong
    with it: empty, no meta table, no format record, or why it could not be read).
    """
    root = Path(path)
    modes = Modes.for_option(group_access, "nvme")
    check_store_dir(root, create=False, modes=modes)
    lock = StoreLock(root, exclusive=True, modes=modes)
    try:
        old = "missing"
        capacity: int | None = None
        engine: str | None = None
        if (root / INDEX_FILE).exists():
            try:
                from kvtier.backends.nvme_validate import parse_meta

                previous = StoreIndex(root / INDEX_FILE, readonly=True)
                try:
                    lacks = previous.lacking()
                    meta = previous.meta() if lacks is None else {}
                finally:
                    previous.close()
                parsed = parse_meta(meta, root)
                old = lacks or ("readable" if parsed is not None else "has no format record")
                if parsed is not None:
                    page_bytes = page_bytes or parsed.layout.page_bytes
                    capacity = parsed.capacity_pages
                engine = meta.get("engine")
            except (NotAStoreError, DamagedStoreError) as exc:
                old = str(exc)
        layout = infer_layout(root, page_bytes)
        result = scan_slabs(root, layout, progress)
        remove_index_files(root)
        index = StoreIndex(root / INDEX_FILE, modes=modes)
        try:
            write_index(index, result, capacity, engine)
        finally:
            index.close()
    finally:
        lock.release()
    return {"path": str(root), "old_index": old, **result.to_dict()}
