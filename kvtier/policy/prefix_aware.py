"""Prefix-aware LRU: leaves first, and a cold request's pages leave as a unit.

A page is only useful while every page before it in its sequence is cached (an engine
reuses a *prefix*). Evicting a parent before its children therefore strands the children:
they take space but can never be hit. This policy only ever evicts *leaves* (pages with no
tracked child), coldest leaf first by last access; when it evicts a leaf whose parent then
becomes a leaf, it keeps walking up that chain, so a request that went cold leaves the
tier together, from its end back to the first page it shares with another sequence.

Parents come from :meth:`on_insert`; a page inserted without a parent (or whose parent
the tier lacks) is a root, and so is a page whose parent leaves before it (a delete).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy


class PrefixLRUPolicy(EvictionPolicy):
    """LRU over leaves of the page forest; chains of a cold request go together."""

    name: ClassVar[str] = "prefix-lru"

    def __init__(self) -> None:
        self._parent: dict[PageKey, PageKey | None] = {}
        # children of the pages that have any (a page that leaves hands them no parent)
        self._kids: dict[PageKey, dict[PageKey, None]] = {}
        self._leaves: OrderedDict[PageKey, None] = OrderedDict()

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._parent:
            self.on_access(key)
            return
        if parent is not None and parent not in self._parent:
            parent = None  # the parent is not in this tier: treat the page as a root
        self._parent[key] = parent
        self._leaves[key] = None
        if parent is not None:
            self._kids.setdefault(parent, {})[key] = None
            self._leaves.pop(parent, None)

    def on_access(self, key: PageKey) -> None:
        if key in self._leaves:
            self._leaves.move_to_end(key)
        # Interior pages carry no recency: they leave only after all their children.

    def on_remove(self, key: PageKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        self._leaves.pop(key, None)
        for kid in self._kids.pop(key, {}):
            self._parent[kid] = None  # its prefix left before it (a delete): a root now
        if parent is None:
            return
        kids = self._kids[parent]
        del kids[key]
        if not kids:
            del self._kids[parent]
            # The parent becomes a leaf, as cold as the child that just left.
            self._leaves[parent] = None
            self._leaves.move_to_end(parent, last=False)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        if n <= 0:
            return out
        chosen: set[PageKey] = set()
        pending: dict[PageKey, int] = {}  # children left per parent after the chosen go
        for leaf in self._leaves:
            if len(out) >= n:
                break
            key: PageKey | None = leaf
            while key is not None and len(out) < n:
                if key in chosen or not evictable(key):
                    break
                out.append(key)
                chosen.add(key)
                parent = self._parent.get(key)
                if parent is None:
                    break
                left = pending.get(parent, len(self._kids.get(parent, ()))) - 1
                pending[parent] = left
                key = parent if left == 0 else None
        return out

    def fallback_victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """When :meth:`victims` offers none because the leaves are spared (a batch in
        flight extends them), the pages above them too, up each chain from the coldest
        leaf: a tier above the last moves them down, so their prefix stays cached."""
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        for leaf in self._leaves:
            key: PageKey | None = leaf
            while key is not None and len(out) < n:
                if key not in chosen and evictable(key):
                    out.append(key)
                    chosen.add(key)
                key = self._parent.get(key)
            if len(out) >= n:
                break
        return out

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent
