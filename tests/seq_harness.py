"""A small real two-tier cache for the sequence tests: DRAM arena over a file store.

Built from the real backends and the real Directory (with a PrefixTree attached), it
offers the part of the KVCache facade the SequenceManager uses (``tiers``, ``directory``,
``spec``, ``namespace``, ``store_pages``, ``lookup``, ``load``, ``release``) plus ``evict`` (push
unpinned pages down) and ``lose`` (drop pages from every tier: a failed tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.backends.dram import DramArena
from kvtier.backends.filestore import FileStore

from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.directory import Directory, PageState
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.spec import KVSpec


@dataclass
class _Tier:
    name: str
    backend: Any


@dataclass
class _Lookup:
    keys: list[PageKey]


@dataclass
class _Load:
    slots: list[int | None]
    missing: list[PageKey]


class TwoTierCache:
    def __init__(self, spec: KVSpec, dram_pages: int, disk_pages: int, path: Path) -> None:
        self.spec = spec
        self.namespace = Namespace.for_spec(spec)
        self.dram = DramArena(page_bytes=spec.page_bytes, capacity_pages=dram_pages)
        self.disk = FileStore(page_bytes=spec.page_bytes, capacity_pages=disk_pages, path=path)
        self.tiers = [_Tier("dram", self.dram), _Tier("disk", self.disk)]
        self.directory = Directory(["dram", "disk"])
        self.tree = PrefixTree(["dram", "disk"])
        self.tree.attach(self.directory)
        self.order: dict[PageKey, None] = {}  # LRU of committed dram pages
        self.moved_down = 0
        self.is_open = False

    async def open(self) -> None:
        await self.dram.open()
        await self.disk.open()
        self.is_open = True

    async def close(self) -> None:
        self.is_open = False
        await self.dram.close()
        await self.disk.close()

    def check_usable(self) -> None:
        if not self.is_open:
            raise KVTierUsageError("TwoTierCache is closed")

    async def _put(self, tier: str, keys: list[PageKey], bufs: list[Any], parents: list[Any]):
        backend = self.dram if tier == "dram" else self.disk
        for k, p in zip(keys, parents, strict=True):
            self.directory.reserve(k, tier, self.namespace.label, p)
        res = await backend.reserve(keys, self.namespace.label)
        ok = []
        for k, r, b in zip(keys, res, bufs, strict=True):
            if r is None:
                self.directory.abort(k, tier)
                ok.append(False)
                continue
            await backend.write([r], [b])
            await backend.commit([r])
            self.directory.commit(k, tier)
            if tier == "dram":
                self.order[k] = None
            ok.append(True)
        return ok

    async def evict(self, n: int | None = None) -> int:
        """Move up to ``n`` (all) unpinned DRAM pages to disk, leaves first."""
        moved = 0
        while n is None or moved < n:
            step = await self._evict_pass(None if n is None else n - moved)
            if not step:
                break
            moved += step
        self.moved_down += moved
        return moved

    async def _evict_pass(self, n: int | None) -> int:
        moved = 0
        for k in list(self.order):
            if n is not None and moved >= n:
                break
            if not self.directory.evictable(k, "dram") or not self.tree.is_leaf(k, "dram"):
                continue
            slot = self.dram.slot_of(k)
            assert slot is not None
            if not self.directory.is_committed(k, "disk"):
                entry = self.directory.get(k)
                parent = None if entry is None else entry.parent
                if self.directory.state(k, "disk") is None:
                    ok = await self._put("disk", [k], [self.dram.view(slot).copy()], [parent])
                    if not ok[0]:
                        continue
            self.directory.begin_evict(k, "dram")
            await self.dram.delete([k])
            self.directory.remove(k, "dram")
            del self.order[k]
            moved += 1
        return moved

    async def lose(self, keys: list[PageKey]) -> None:
        """Pages vanish from every tier (a failing tier)."""
        for k in keys:
            for tier, backend in (("dram", self.dram), ("disk", self.disk)):
                if self.directory.state(k, tier) is PageState.COMMITTED:
                    if self.directory.is_pinned(k):
                        continue
                    self.directory.begin_evict(k, tier)
                    await backend.delete([k])
                    self.directory.remove(k, tier)
                    self.order.pop(k, None)

    async def _room(self, n: int) -> None:
        free = self.dram.capacity_pages - self.directory.used("dram")
        if free < n:
            await self.evict(n - free)
        if self.dram.capacity_pages - self.directory.used("dram") < n:
            raise CapacityError(f"dram: no room for {n} pages: everything else is pinned")

    async def store_pages(
        self, keys: list[PageKey], pages: list[Any], parents: list[Any] | None = None
    ) -> list[bool]:
        parents = parents or [None] * len(keys)
        todo = [i for i, k in enumerate(keys) if self.directory.locate(k) is None]
        ok = [True] * len(keys)
        if todo:
            await self._room(len(todo))
            got = await self._put(
                "dram",
                [keys[i] for i in todo],
                [np.asarray(pages[i]).copy() for i in todo],
                [parents[i] for i in todo],
            )
            for i, g in zip(todo, got, strict=True):
                ok[i] = g
        return ok

    async def reserve_private(self, keys: list[PageKey], namespace: str = "") -> list[Any]:
        await self._room(len(keys))
        for k in keys:
            self.directory.reserve(k, "dram", namespace)
        try:
            res = await self.dram.reserve(keys, namespace)
        except BaseException:  # a closed or failing arena: the directory gives them back
            for k in keys:
                self.directory.abort(k, "dram")
            raise
        got = [r for r in res if r is not None]
        if len(got) < len(keys):
            await self.dram.abort(got)
            for k in keys:
                self.directory.abort(k, "dram")
            raise CapacityError(f"dram could give only {len(got)} of {len(keys)} slots")
        return got

    async def release_private(self, reservations: list[Any]) -> None:
        await self.dram.abort(reservations)
        for r in reservations:
            self.directory.abort(r.key, "dram")

    async def lookup(self, tokens: Any) -> _Lookup:
        keys = self.tree.match(page_keys(tokens, self.namespace)).keys
        return _Lookup(keys)

    async def load(self, keys: list[PageKey], pin: bool = True) -> _Load:
        for k in keys:  # pin first so making room never evicts what we load
            self.directory.pin(k)
        fetch = [k for k in keys if not self.directory.is_committed(k, "dram")]
        missing = [k for k in fetch if not self.directory.is_committed(k, "disk")]
        fetch = [k for k in fetch if k not in missing]
        try:
            await self._room(len(fetch))
        except CapacityError:
            for k in keys:
                self.directory.unpin(k)
            raise
        for k in fetch:
            buf = np.empty(self.spec.page_bytes, dtype=np.uint8)
            (got,) = await self.disk.get([k], [buf])
            if not got:
                missing.append(k)
                continue
            entry = self.directory.get(k)
            await self._put("dram", [k], [buf], [None if entry is None else entry.parent])
        slots: list[int | None] = []
        for k in keys:
            slots.append(None if k in missing else self.dram.slot_of(k))
            if not pin:  # like KVCache.load: with pin, every key asked for is pinned
                self.directory.unpin(k)
        return _Load(slots, missing)

    async def release(self, keys: list[PageKey]) -> None:
        for k in keys:
            self.directory.unpin(k)
