"""Prefix cuts: evict what a victim would strand first, and strand nothing needlessly.

An engine reuses a *prefix*: a page is only worth keeping while every page before it in
its sequence is kept too. A classic policy ignores this. Two rules fix what it gets
wrong, whatever its order:

* **orphans first**: a page whose parent left the tier cannot give a prefix hit until the
  parent is computed again, and then the page is rebuilt with it at no extra cost; it is
  dead weight, so it goes before anything else;
* **cut from the tail**: when the policy picks a page, its resident descendants would
  become orphans, so they leave first, deepest first, and the page itself last. A chain
  that went cold therefore shrinks from its end and keeps its longest prefix while it
  shrinks (LRU, whose order puts a chain's first page before its last because a request
  touches them in order, would otherwise cut chains at their root).

:class:`PageForest` keeps the parent/children links of the tier's pages and applies the
two rules to any victim order; :class:`PrefixCutPolicy` wraps an eviction policy with it.
A page inserted with a parent the tier does not hold is a root here (in a lower tier the
parent is usually in a tier above). All hooks are O(1); a victim costs the pages it
removes plus the inner policy's own cost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

from kvtier.keys import PageKey
from kvtier.policy.base import (
    EvictionPolicy,
    close_order,
    first_evictable,
    ordered_keys_of,
)


class PageForest:
    """Parent and children of a tier's pages, and its orphans (pages whose parent left)."""

    def __init__(self) -> None:
        self.parent: dict[PageKey, PageKey | None] = {}
        self.kids: dict[PageKey, dict[PageKey, None]] = {}
        self.orphans: OrderedDict[PageKey, None] = OrderedDict()
        # Orphans by the parent they lost, to link them again when it comes back.
        self._lost: dict[PageKey, PageKey] = {}
        self._waiting: dict[PageKey, dict[PageKey, None]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    def add(self, key: PageKey, parent: PageKey | None) -> None:
        """``key`` entered the tier after ``parent`` (a root if the tier lacks it)."""
        if parent is not None and parent not in self.parent:
            parent = None
        self.parent[key] = parent
        kids: dict[PageKey, None] = {}
        self.kids[key] = kids
        if parent is not None:
            self.kids[parent][key] = None
        for kid in self._waiting.pop(key, {}):  # it came back: its orphans are its again
            del self._lost[kid]
            self.parent[kid] = key
            kids[kid] = None
            self.orphans.pop(kid, None)

    def remove(self, key: PageKey) -> None:
        """``key`` left the tier; its children become orphans."""
        parent = self.parent.pop(key, None)
        if parent is not None and parent in self.kids:
            self.kids[parent].pop(key, None)
        kids = self.kids.pop(key, {})
        for kid in kids:
            self.parent[kid] = None
            self.orphans[kid] = None
            self._lost[kid] = key
        if kids:
            self._waiting[key] = dict(kids)
        self.orphans.pop(key, None)
        lost = self._lost.pop(key, None)
        if lost is not None:
            waiting = self._waiting[lost]
            del waiting[key]
            if not waiting:
                del self._waiting[lost]

    def touch(self, key: PageKey) -> None:
        """``key`` was referenced: a page in use is not dead weight."""
        self.orphans.pop(key, None)

    def _post_order(self, top: PageKey, done: set[PageKey]) -> Iterator[PageKey]:
        """``top``'s subtree (pages not in ``done``), descendants deepest first, then
        ``top``; oldest child first."""
        stack: list[tuple[PageKey, Iterator[PageKey]]] = [(top, iter(self.kids[top]))]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in done and nxt in self.kids:
                    stack.append((nxt, iter(self.kids[nxt])))
                continue
            stack.pop()
            yield node

    def order(
        self, inner: Iterable[PageKey], evictable: Callable[[PageKey], bool] | None = None
    ) -> Iterator[PageKey]:
        """The pages of the forest, each once, best victim first, given a policy's
        preference order ``inner``: the orphans, then for each page ``inner`` yields that
        ``evictable`` accepts (every page without it), its subtree not yet yielded,
        deepest first and the page itself last (a page that may not go does not pull its
        descendants forward: they wait for their own turn). Lazy; the forest must not
        change while the iterator is in use. The first ``n`` pages of it that
        ``evictable`` accepts are :meth:`victims` over the same order."""
        done: set[PageKey] = set()
        for key in self.orphans:
            done.add(key)
            yield key
        for top in inner:
            if top in done or top not in self.kids:
                continue
            if evictable is not None and not evictable(top):
                continue
            for key in self._post_order(top, done):
                if key not in done:
                    done.add(key)
                    yield key

    def victims(
        self,
        order: Callable[[int, Callable[[PageKey], bool]], list[PageKey]],
        n: int,
        evictable: Callable[[PageKey], bool],
    ) -> list[PageKey]:
        """Up to ``n`` victims: evictable orphans first, then for each page ``order``
        (a policy's ``victims``) offers, its evictable subtree from the deepest page up.
        For a policy whose whole order is at hand, ``first_evictable(self.order(...))``
        gives the same answer in one pass."""
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        for key in self.orphans:
            if len(out) >= n:
                return out
            if evictable(key):
                out.append(key)
                chosen.add(key)

        def ok(key: PageKey) -> bool:
            return key not in chosen and evictable(key)

        while len(out) < n:
            offered = order(1, ok)
            if not offered:
                break
            for key in self._post_order(offered[0], chosen):
                if len(out) >= n:
                    break
                if key not in chosen and evictable(key):
                    out.append(key)
                    chosen.add(key)
            if offered[0] not in chosen:  # cut short by n: the page itself stays
                break
        return out


class PrefixCutPolicy(EvictionPolicy):
    """Wraps ``inner``: orphans first, and a victim's descendants before it."""

    name: ClassVar[str] = "prefix-cut"

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.forest = PageForest()

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self.forest:
            self.on_access(key)
            return
        self.forest.add(key, parent)
        self.inner.on_insert(key, parent)

    def on_access(self, key: PageKey) -> None:
        if key in self.forest:
            self.forest.touch(key)
            self.inner.on_access(key)

    def on_remove(self, key: PageKey) -> None:
        if key in self.forest:
            self.forest.remove(key)
            self.inner.on_remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        inner = ordered_keys_of(self.inner, evictable)
        if inner is None:
            return self.forest.victims(self.inner.victims, n, evictable)
        try:
            return first_evictable(self.forest.order(inner, evictable), n, evictable)
        finally:
            close_order(inner)

    def ordered_keys(
        self, evictable: Callable[[PageKey], bool] | None = None
    ) -> Iterator[PageKey] | None:
        """The forest's order over the inner policy's, when the inner policy has one
        (see :mod:`kvtier.policy.base`); ``None`` otherwise."""
        inner = ordered_keys_of(self.inner, evictable)
        return None if inner is None else self.forest.order(inner, evictable)

    def __len__(self) -> int:
        return len(self.forest)

    def __contains__(self, key: object) -> bool:
        return key in self.forest
