"""``MemoryStore``: pages in a dict, the smallest backend that keeps kvtier's contract.

It shows what a plugin needs: subclass :class:`kvtier.backend.StoreBackend`, accept
``page_bytes`` and ``capacity_pages``, declare its own options as a dataclass checked by
:func:`kvtier.options.parse_options` (which rejects unknown ones, naming them), implement
the keyed two-phase methods with per-item results, and run byte copies on the backend's
executor, one hop per call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.backend import Reservation, StoreBackend, check_buffers
from kvtier.keys import PageKey
from kvtier.options import option, parse_options


@dataclass(frozen=True)
class MemoryStoreOptions:
    """The store's own options (``[tiers.options]`` in a config).

    Attributes:
        latency_s: seconds each ``get`` and ``write`` waits before answering, a stand-in
            for a remote store's round trip (0, the default: none).
    """

    latency_s: float = option(0.0, minimum=0.0, maximum=10.0)


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


class MemoryStore(StoreBackend):
    """Keys -> page copies in process memory. Not persistent."""

    def __init__(
        self, *, page_bytes: int, capacity_pages: int, io_threads: int | None = None, **options: Any
    ) -> None:
        self.options = parse_options("example-mem", options, MemoryStoreOptions)
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads
        )
        self._pages: dict[PageKey, np.ndarray] = {}
        self._pending: dict[int, tuple[PageKey, np.ndarray]] = {}
        self._next = 0

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        self._check_open()
        out: list[Reservation | None] = []
        for key in keys:
            if key in self._pages:
                out.append(Reservation(key, -1, present=True))
            elif self.used_pages() < self.capacity_pages:
                self._next += 1
                self._pending[self._next] = (key, np.empty(self.page_bytes, dtype=np.uint8))
                out.append(Reservation(key, self._next))
            else:
                out.append(None)
        return out

    def _live(self, r: Reservation) -> np.ndarray | None:
        entry = self._pending.get(r.handle)
        return entry[1] if entry is not None and entry[0] == r.key else None

    async def _round_trip(self) -> None:
        if self.options.latency_s:
            await asyncio.sleep(self.options.latency_s)

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        self._check_open()
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        await self._round_trip()
        ok: list[bool] = []
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for r, buf in zip(reservations, bufs, strict=True):
            dst = None if r.present else self._live(r)
            if dst is not None:
                pairs.append((dst, buf))
            ok.append(r.present or dst is not None)
        if pairs:
            await self.run_blocking(_copy_all, pairs)
        return ok

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self._check_open()
        ok: list[bool] = []
        for r in reservations:
            if r.present:
                ok.append(r.key in self._pages)
            elif (page := self._live(r)) is not None:
                del self._pending[r.handle]
                self._pages.setdefault(r.key, page)
                ok.append(True)
            else:
                ok.append(False)
        return ok

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self._check_open()
        for r in reservations:
            if not r.present and self._live(r) is not None:
                del self._pending[r.handle]

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        self._check_open()
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        await self._round_trip()
        hits = [k in self._pages for k in keys]
        pairs = [(b, self._pages[k]) for k, b, hit in zip(keys, bufs, hits, strict=True) if hit]
        if pairs:
            await self.run_blocking(_copy_all, pairs)
        return hits

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [k in self._pages for k in keys]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return [self._pages.pop(k, None) is not None for k in keys]

    async def keys(self) -> list[PageKey]:
        self._check_open()
        return list(self._pages)

    def used_pages(self) -> int:
        return len(self._pages) + len(self._pending)

    async def close(self) -> None:
        await super().close()
        self._pages.clear()
        self._pending.clear()
