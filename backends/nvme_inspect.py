"""Read-only inspection of an NVMe store directory: what it holds, and whether it is intact.

:func:`inspect_store` never modifies the store (it opens the index read-only and the slab
files ``O_RDONLY``) and never prints; ``kvtier inspect store`` renders its report. With
``verify`` every committed page is read back and checked exactly as the store's ``get``
checks it (header, key, namespace, length, payload checksum, index checksum); the bad ones
are listed with their key, slab and offset. Verification takes a shared lock, so it
refuses a store that a writer has open (a writer may reuse slots under it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    STORE_FORMAT_VERSION,
    NotAStoreError,
    PageRow,
    StoreIndex,
    StoreLock,
    StoreVersionError,
    check_store_dir,
)
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_slabs import slab_path

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
    ``capacity_pages``, ``pages``, ``bytes``, ``slabs``, ``slab_bytes_on_disk``, ``fill``
    (pages / capacity), ``namespaces`` (label -> pages, bytes), ``quarantined``; with
    ``verify`` also ``verified`` (pages checked) and ``bad`` (list of key, slab, offset,
    reason). ``progress`` is called with the number of pages verified since its last call.

    Raises :class:`NotAStoreError` / :class:`KVTierUsageError` for a path that is not a
    store, :class:`StoreVersionError` for a newer format, and
    :class:`~kvtier.backends.nvme_index.StoreLockedError` when verifying a store that is
    open for writing elsewhere.
    """
    root = Path(path)
    check_store_dir(root, create=False)
    lock = StoreLock(root, exclusive=False) if verify else None
    try:
        index = StoreIndex(root / INDEX_FILE, readonly=True)
        try:
            meta = index.meta()
            if "format_version" not in meta:
                raise NotAStoreError(f"{root} is not an NVMe store: its index has no format record")
            version = int(meta["format_version"])
            if version > STORE_FORMAT_VERSION:
                raise StoreVersionError(
                    f"NVMe store {root} has format version {version}, newer than the "
                    f"{STORE_FORMAT_VERSION} this kvtier reads; upgrade kvtier"
                )
            layout = SlotLayout(int(meta["page_bytes"]), int(meta["slots_per_slab"]))
            summary = index.summary()
            rows = index.load()[0] if verify else []
        finally:
            index.close()
        slab_files = sorted((root / "slabs").glob("slab-*.dat"))
        capacity = int(meta.get("capacity_pages", "0"))
        pages = int(summary["pages"])  # type: ignore[call-overload]
        report: dict[str, Any] = {
            "path": str(root),
            "format_version": version,
            "page_bytes": layout.page_bytes,
            "slot_bytes": layout.slot_bytes,
            "slots_per_slab": layout.slots_per_slab,
            "capacity_pages": capacity,
            "pages": pages,
            "bytes": summary["bytes"],
            "slabs": len(slab_files),
            "slab_bytes_on_disk": sum(p.stat().st_size for p in slab_files),
            "fill": pages / capacity if capacity else None,
            "namespaces": summary["namespaces"],
            "quarantined": summary["quarantined"],
        }
        if verify:
            report["verified"] = len(rows)
            report["bad"] = _verify_rows(root, layout, rows, progress)
        return report
    finally:
        if lock is not None:
            lock.release()


def _verify_rows(
    root: Path,
    layout: SlotLayout,
    rows: list[PageRow],
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
                    fd = fds[row.slab] = os.open(slab_path(root, row.slab), os.O_RDONLY)
                except OSError as exc:
                    fd = None
                    reason = f"slab file unreadable: {exc.strerror}"
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
