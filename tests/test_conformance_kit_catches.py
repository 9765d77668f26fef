"""The conformance kit fails backends that break the contract in ways a third-party
author plausibly would (from an audit that wrote a plugin from the backend guide): a
correct reference store passes, and each broken variant fails with a message naming what
is wrong. Before, the kit passed every variant here."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from kvtier.backend import Reservation, StoreBackend, check_blobs, check_buffers
from kvtier.keys import PageKey
from kvtier.testing.conformance import check_backend
from kvtier.testing.kit import ConformanceError

PAGE = 512

#: "disk" of the persistent stores: path -> committed blobs (survives close and reopen)
DISKS: dict[str, dict[PageKey, bytes]] = {}


class DictStore(StoreBackend):
    """A correct variable-length store whose committed pages live in :data:`DISKS`."""

    variable_length: ClassVar[bool] = True

    def __init__(self, *, page_bytes: int, capacity_pages: int, path: str, **kw: Any) -> None:
        super().__init__(page_bytes=page_bytes, capacity_pages=capacity_pages, **kw)
        self.disk = DISKS.setdefault(path, {})
        self.pending: dict[int, tuple[PageKey, bytes | None]] = {}
        self.next = 0

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        self._check_open()
        out: list[Reservation | None] = []
        for k in keys:
            if k in self.disk:
                out.append(Reservation(k, -1, present=True))
            elif self.used_pages() < self.capacity_pages:
                self.next += 1
                self.pending[self.next] = (k, None)
                out.append(Reservation(k, self.next))
            else:
                out.append(None)
        return out

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        await asyncio.sleep(0)  # where a real store's I/O would let the loop run
        return self.keep(reservations, [b.tobytes() for b in bufs])

    async def write_blobs(
        self, reservations: Sequence[Reservation], blobs: Sequence[Any]
    ) -> list[bool]:
        bufs = check_blobs(blobs, len(reservations), self.page_bytes)
        await asyncio.sleep(0)
        return self.keep(reservations, [b.tobytes() for b in bufs])

    def keep(self, reservations: Sequence[Reservation], data: list[bytes]) -> list[bool]:
        self._check_open()
        ok = []
        for r, d in zip(reservations, data, strict=True):
            live = not r.present and r.handle in self.pending
            if live:
                self.pending[r.handle] = (r.key, d)
            ok.append(live or r.present)
        return ok

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self._check_open()
        ok = []
        for r in reservations:
            if r.present:
                ok.append(r.key in self.disk)
                continue
            _key, data = self.pending.get(r.handle, (None, None))
            if data is None:
                ok.append(False)
                continue
            del self.pending[r.handle]
            self.disk.setdefault(r.key, data)
            ok.append(True)
        return ok

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self._check_open()
        for r in reservations:
            if not r.present:
                self.pending.pop(r.handle, None)

    def read(self, key: PageKey) -> bytes | None:
        return self.disk.get(key)

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        self._check_open()
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        await asyncio.sleep(0)
        return self.fill(keys, bufs)

    def fill(self, keys: Sequence[PageKey], bufs: Sequence[np.ndarray]) -> list[int | None]:
        """Copy each key's blob into its buffer; the blobs' lengths (``None``: missing)."""
        sizes: list[int | None] = []
        for k, buf in zip(keys, bufs, strict=True):
            blob = self.read(k)
            if blob is not None:
                buf[: len(blob)] = np.frombuffer(blob, np.uint8)
            sizes.append(None if blob is None else len(blob))
        return sizes

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        return [n == self.page_bytes for n in await self.get_sized(keys, out)]

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [k in self.disk for k in keys]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [self.disk.pop(k, None) is not None for k in keys]

    async def keys(self) -> list[PageKey]:
        self._check_open()
        return list(self.disk)

    def used_pages(self) -> int:
        return len(self.disk) + len(self.pending)


class StaleAfterDelete(DictStore):
    """A read cache that ``delete`` does not clear: a key put again after a delete
    serves the bytes of before."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.cache: dict[PageKey, bytes] = {}

    def read(self, key: PageKey) -> bytes | None:
        if key in self.disk and key in self.cache:
            return self.cache[key]
        blob = super().read(key)
        if blob is not None:
            self.cache[key] = blob
        return blob


class DeleteNotDurable(DictStore):
    """Deletes from its in-memory view only: a deleted key is back after a reopen."""

    async def open(self) -> None:
        await super().open()
        self.durable = self.disk
        self.disk = dict(self.durable)

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        ok = await super().commit(reservations)
        for r, good in zip(reservations, ok, strict=True):
            if good:
                self.durable.setdefault(r.key, self.disk[r.key])
        return ok


class FirstCopyOnly(DictStore):
    """Fills only the first buffer of a key asked for twice in one batch (two requests
    sharing a prefix), yet answers a hit for both."""

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        seen: dict[PageKey, int | None] = {}
        sizes: list[int | None] = []
        for k, buf in zip(keys, bufs, strict=True):
            if k in seen:
                sizes.append(seen[k])
            else:
                seen[k] = (await super().get_sized([k], [buf]))[0]
                sizes.append(seen[k])
        return sizes


class WritesIntoAborted(DictStore):
    """Answers ``True`` to a write into a reservation it already aborted."""

    def keep(self, reservations: Sequence[Reservation], data: list[bytes]) -> list[bool]:
        ok = super().keep(reservations, data)
        return [True for _ in ok]


class HalfOfShortBlobs(DictStore):
    """Keeps only the first half of a blob shorter than a page (answers its full length)."""

    async def write_blobs(
        self, reservations: Sequence[Reservation], blobs: Sequence[Any]
    ) -> list[bool]:
        bufs = check_blobs(blobs, len(reservations), self.page_bytes)
        cut = [b.tobytes()[: max(1, len(b) // 2)] + bytes(len(b) - max(1, len(b) // 2))
               for b in bufs]  # fmt: skip
        return self.keep(reservations, cut)


class ClaimsToFinishBeforeRaising(DictStore):
    """Sets ``get_finishes_before_raising`` but copies on a thread it leaves running when
    its ``get`` is cancelled."""

    get_finishes_before_raising: ClassVar[bool] = True

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)

        def copy() -> list[int | None]:
            time.sleep(0.01)
            return self.fill(keys, bufs)

        return await asyncio.get_running_loop().run_in_executor(None, copy)


def _factory(cls: type[DictStore], path: str) -> Any:
    return lambda: cls(page_bytes=PAGE, capacity_pages=8, path=path)


async def test_the_reference_store_passes(tmp_path: Any) -> None:
    report = await check_backend(_factory(DictStore, str(tmp_path)), persistent=True)
    assert set(report.skipped) == {"arena_zero_copy", "cancelled_get_stops_writing"}, report


@pytest.mark.parametrize(
    ("variant", "needle"),
    [
        (StaleAfterDelete, "serves the bytes of before the delete"),
        (DeleteNotDurable, "a page deleted before close() came back"),
        (FirstCopyOnly, "get of a key twice in a batch did not fill both buffers"),
        (WritesIntoAborted, "write into an aborted reservation answered True"),
        (HalfOfShortBlobs, "reads back wrong"),
        (ClaimsToFinishBeforeRaising, "of the caller's buffers after it had returned"),
    ],
)
async def test_a_broken_store_fails_with_a_message_naming_the_fault(
    tmp_path: Any, variant: type[DictStore], needle: str
) -> None:
    with pytest.raises(ConformanceError, match=re.escape(needle)):
        await check_backend(_factory(variant, str(tmp_path)), persistent=True)
