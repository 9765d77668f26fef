"""Read-only inspection of an NVMe store directory: what it holds, and whether it is intact.

:func:`inspect_store` never modifies the store (it opens the index read-only and the slab
files ``O_RDONLY | O_NOFOLLOW``) and never prints; ``kvtier inspect store`` renders its
report. Every index row is checked as opening the store checks it
(:func:`~kvtier.backends.nvme_validate.check_index`): invalid rows are counted and listed,
and left out of the page, byte and namespace totals (opening the store drops them).
With ``verify`` every committed page is also read back and checked exactly as the store's
``get`` checks it (header, key, namespace, length, payload checksum, index checksum); the
bad ones, and the invalid rows, are listed with their key, slab and offset. Verification
takes a shared lock, so it refuses a store that a writer has open (a writer may reuse
slots under it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    DamagedStoreError,
    NotAStoreError,
    PageRow,
    StoreIndex,
    StoreLock,
    check_store_dir,
)
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_slabs import slab_path
from kvtier.backends.nvme_validate import (
    MAX_LISTED,
    CheckedIndex,
    check_index,
    parse_meta,
    slab_files,
)
from kvtier.backends.store_files import Modes, open_private

from kvtier.errors import IntegrityError
from kvtier.pageformat import HEADER_SIZE, namespace_digest, verify_page


def verify_row(fd: int, row: PageRow, buf: np.ndarray) -> str | None:
    """Re-read one page with ``os.preadv`` into ``buf``; ``None`` if intact, else why not."""
    header = bytearray(HEADER_SIZE)
    want = row.length + HEADER_SIZE
    try:
        got = os.preadv(fd, [buf[: row.length].data, memoryview(header)], row.offset)
    except OSError as exc:
        return f"I/O error: {exc.strerror}"
    if got < want:
        return f"slab ends inside the page: read {got} of {want} bytes"
    try:
        h = verify_page(header, row.key, buf[: row.length])
    except IntegrityError as exc:
        return str(exc)
    if h.checksum != row.checksum:
        return "payload checksum differs from the index"
    if h.namespace_digest != namespace_digest(row.namespace):
        return f"page header namespace differs from {row.namespace!r}"
    return None


def inspect_store(
    path: str | os.PathLike[str],
    verify: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """A report of the store at ``path`` (plain data, JSON-ready).

    Keys: ``path``, ``format_version``, ``page_bytes``, ``slot_bytes``, ``slots_per_slab``,
    ``capacity_pages`` (``None`` when the index records none: rebuilt from slabs without the
    old index, until a cache opens the store), ``pages``, ``bytes``, ``slabs``,
    ``slab_bytes_on_disk``, ``fill`` (pages / capacity), ``namespaces`` (label -> pages,
    bytes), ``quarantined`` (slots opening the store holds unusable),
    ``invalid_index_rows`` (rows opening the store would drop; ``pages``, ``bytes``,
    ``fill`` and ``namespaces`` count the valid rows only) and ``index_problems``
    (the first of them); with ``verify`` also ``verified`` (rows checked) and ``bad``
    (list of key, slab, offset, reason: damaged pages and invalid rows). ``progress`` is
    called with the number of pages verified since its last call.

    Raises :class:`NotAStoreError` / :class:`KVTierUsageError` for a path that is not a
    store, :class:`DamagedStoreError` for an index that cannot be read (or is missing,
    empty or without meta table while slabs are present), :class:`StoreVersionError` for a
    newer format,
    :class:`~kvtier.backends.store_files.UnsafeStoreError` for a symlink inside the store,
    and :class:`~kvtier.backends.nvme_index.StoreLockedError` when verifying a store that
    is open for writing elsewhere.
    """
    root = Path(path)
    check_store_dir(root, create=False)
    if not (root / INDEX_FILE).exists():
        raise DamagedStoreError(
            f"NVMe store {root} has slab files but no {INDEX_FILE}: opening the store "
            f"rebuilds it, or run 'kvtier inspect store {root} --rebuild-index'"
        )
    lock = StoreLock(root, exclusive=False) if verify else None
    try:
        index = StoreIndex(root / INDEX_FILE, readonly=True)
        try:
            if (missing := index.lacking()) is not None:
                raise DamagedStoreError(
                    f"NVMe store {root}: its index {root / INDEX_FILE} is damaged "
                    f"({missing}); opening the store rebuilds it from the slabs, or run "
                    f"'kvtier inspect store {root} --rebuild-index'"
                )
            meta = index.meta()
            parsed = parse_meta(meta, root)
            if parsed is None:
                raise DamagedStoreError(
                    f"NVMe store {root}: its index has no format record (emptied?); opening "
                    f"the store rebuilds it from the slabs, or run 'kvtier inspect store "
                    f"{root} --rebuild-index'"
                )
            if "pages" not in index.tables_at_open:
                raise DamagedStoreError(
                    f"NVMe store {root}: its index has no pages table; opening the store "
                    f"rebuilds it from the slabs, or run 'kvtier inspect store {root} "
                    "--rebuild-index'"
                )
            layout = parsed.layout
            sizes = slab_files(root)
            extents = {
                i: min(layout.slots_per_slab, size // layout.slot_bytes)
                for i, size in sizes.items()
            }
            # --verify lists every bad row (the count of bad pages must be whole);
            # the plain report, the first MAX_LISTED
            checked = check_index(
                index.raw_rows(),
                index.raw_quarantine(),
                layout,
                extents,
                listed=None if verify else MAX_LISTED,
            )
        finally:
            index.close()
        capacity = parsed.capacity_pages  # None: not recorded (an index rebuilt without one)
        pages = len(checked.rows)  # the valid rows only: what opening the store keeps
        report: dict[str, Any] = {
            "path": str(root),
            "format_version": parsed.format_version,
            "page_bytes": layout.page_bytes,
            "slot_bytes": layout.slot_bytes,
            "slots_per_slab": layout.slots_per_slab,
            "capacity_pages": capacity,
            "pages": pages,
            "bytes": sum(r.length for r in checked.rows),
            "slabs": len(sizes),
            "slab_bytes_on_disk": sum(sizes.values()),
            "fill": pages / capacity if capacity else None,
            "namespaces": _namespaces(checked.rows),
            "quarantined": len(checked.quarantined),  # as opening the store would hold them
            "invalid_index_rows": checked.bad_rows,
            "index_problems": checked.problems[:MAX_LISTED],
        }
        if verify:
            report["verified"] = len(checked.rows) + checked.bad_rows
            report["bad"] = _invalid_rows(checked, layout) + _verify_rows(
                root, checked.rows, layout, progress
            )
        return report
    finally:
        if lock is not None:
            lock.release()


def _namespaces(rows: list[PageRow]) -> dict[str, dict[str, int]]:
    """Pages and bytes per namespace label of ``rows``, by label."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        ns = out.setdefault(r.namespace, {"pages": 0, "bytes": 0})
        ns["pages"] += 1
        ns["bytes"] += r.length
    return dict(sorted(out.items()))


def _invalid_rows(checked: CheckedIndex, layout: SlotLayout) -> list[dict[str, Any]]:
    """The invalid page rows listed by :func:`check_index`, as ``bad`` entries."""
    out: list[dict[str, Any]] = []
    for p in checked.problems:
        if p["table"] != "pages":
            continue
        slot = p["slot"]
        slab, offset = layout.locate(slot) if isinstance(slot, int) and slot >= 0 else (None, None)
        out.append({"key": p["key"], "slab": slab, "offset": offset, "reason": p["reason"]})
    return out


def _verify_rows(
    root: Path,
    rows: list[PageRow],
    layout: SlotLayout,
    progress: Callable[[int], None] | None,
) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    buf = np.empty(layout.page_bytes, dtype=np.uint8)
    fds: dict[int, int] = {}
    try:
        for n, row in enumerate(sorted(rows, key=lambda r: (r.slab, r.offset)), 1):
            reason: str | None
            fd = fds.get(row.slab)
            if fd is None:
                try:
                    fd = fds[row.slab] = open_private(
                        slab_path(root, row.slab), os.O_RDONLY, Modes(), root, fix_mode=False
                    )
                except OSError as exc:
                    fd = None
                    reason = f"slab file unreadable: {exc.strerror or exc}"
            if fd is not None:
                reason = verify_row(fd, row, buf)
            if reason is not None:
                bad.append(
                    {"key": row.key.hex(), "slab": row.slab, "offset": row.offset, "reason": reason}
                )
            if progress is not None and (n % 256 == 0 or n == len(rows)):
                progress(256 if n % 256 == 0 else n % 256)
    finally:
        for fd in fds.values():
            os.close(fd)
    return bad


__all__ = ["NotAStoreError", "inspect_store", "verify_row"]
