"""The read side of the NVMe store: ``get`` (one batch of page reads on the worker pool,
each page verified) and the quarantine of pages that fail verification."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from kvtier.backends.nvme_engines import (
    PageRead,
)
from kvtier.backends.nvme_index import PageRow

from kvtier.backend import check_buffers
from kvtier.errors import IntegrityError
from kvtier.keys import PageKey
from kvtier.pageformat import namespace_digest, verify_page

from .nvme_base import (
    NvmeStoreBase,
    cause,
    check_key,
    log,
    split,
)


class NvmeReads(NvmeStoreBase):
    """``get`` and quarantine, on top of :class:`~kvtier.backends.nvme_base.NvmeStoreBase`."""

    #: a cancelled ``get`` raises only once its read threads returned (``_slot_io``)
    get_finishes_before_raising: ClassVar[bool] = True

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        self._enter()
        try:
            return await self._get(keys, out)
        finally:
            self._exit()

    async def _get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        ok = [False] * len(keys)
        jobs: list[tuple[int, PageRow, np.ndarray]] = []
        for i, key in enumerate(keys):
            row = self._entries.get(check_key(key, i))
            if row is None:
                self._counters["misses"] += 1
                continue
            jobs.append((i, row, bufs[i]))
        if not jobs:
            return ok
        assert self._engine is not None
        groups = split(jobs, self.io_threads) if self._engine.splits_batches else [jobs]
        slots = [row.slot for _, row, _ in jobs]
        results = await self._slot_io(self._read_blocking, groups, slots, finish_if_cancelled=True)
        bad: list[tuple[PageRow, BaseException]] = []
        now = time.time()
        for group, res in zip(groups, results, strict=True):
            for (i, row, _), err in zip(group, res, strict=True):
                if err is None:
                    ok[i] = True
                    self._accessed[row.key] = now
                    self._counters["hits"] += 1
                    self._counters["bytes_read"] += self.page_bytes
                else:
                    self._counters["misses"] += 1
                    bad.append((row, err))
        if bad:
            await self._quarantine(bad)
        return ok

    def _read_blocking(
        self, jobs: list[tuple[int, PageRow, np.ndarray]]
    ) -> list[BaseException | None]:
        assert self._engine is not None
        items = [PageRead(row.slab, row.offset, buf) for _, row, buf in jobs]
        out: list[BaseException | None] = []
        for (_, row, buf), res in zip(jobs, self._engine.read_batch(items), strict=True):
            if isinstance(res, FileNotFoundError):
                # Unlike an I/O error this never heals: the page is gone (quarantined),
                # not kept as present forever, which would refuse every put of it again.
                out.append(IntegrityError(f"slab file {row.slab} is missing"))
                continue
            if isinstance(res, BaseException):
                out.append(res)
                continue
            try:
                header = verify_page(res, row.key, buf)
                if header.checksum != row.checksum:
                    raise IntegrityError("payload checksum differs from the index")
                if header.namespace_digest != namespace_digest(row.namespace):
                    raise IntegrityError(f"page header namespace differs from {row.namespace!r}")
                out.append(None)
            except IntegrityError as exc:
                out.append(exc)
        return out

    async def _quarantine(self, bad: list[tuple[PageRow, BaseException]]) -> None:
        """Drop pages that failed verification from the index and take their slots out of
        service; pages that met an I/O error are only counted and logged."""
        entries: list[tuple[int, bytes | None, str]] = []
        for row, err in bad:
            if not isinstance(err, IntegrityError):
                # An I/O error says nothing about the bytes on disk: a miss this time, the
                # page stays (a later read may succeed), the cause is logged once.
                self._log_once(
                    f"read:{cause(err)}",
                    "nvme.read_failed",
                    key=row.key.hex(),
                    slab=row.slab,
                    offset=row.offset,
                    error=str(err),
                )
                self._counters["io_errors"] += 1
                continue
            kind = "integrity"
            self._counters["integrity_errors"] += 1
            log().error(
                "nvme.page_unreadable",
                path=str(self.path),
                key=row.key.hex(),
                slab=row.slab,
                offset=row.offset,
                error=str(err),
                kind=kind,
            )
            if self._entries.get(row.key) is row:
                del self._entries[row.key]
                self._quarantined[row.slot] = str(err)
                entries.append((row.slot, row.key, str(err)))
        if entries:
            assert self._index is not None
            try:
                await self.run_blocking(self._index.quarantine, entries)
            except Exception as exc:
                self._log_once(f"quarantine:{cause(exc)}", "nvme.quarantine_failed", error=str(exc))
