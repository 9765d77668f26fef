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
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import ClassVar

from kvtier.keys import PageKey
from kvtier.policy.base import (
    EvictionPolicy,
    close_order,
    ordered_keys_of,
    victims_in_order,
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
        # The first child each page had while held, and the pages that had another since
        # (branch points: prefixes more than one sequence continued).
        self._first_kid: dict[PageKey, PageKey] = {}
        self.branched: set[PageKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    def add(self, key: PageKey, parent: PageKey | None) -> None:
        """``key`` entered the tier after ``parent`` (a root if the tier lacks it, or if
        ``parent`` descends from ``key`` through orphans that ``key`` gets back: parents
        given by a caller that contradict the ones before would otherwise close a cycle,
        which no walk of the forest ends)."""
        par = self.parent
        if parent is not None and (
            parent not in par or (key in self._waiting and self._descends(parent, key))
        ):
            parent = None
        par[key] = parent
        kids: dict[PageKey, None] = {}
        self.kids[key] = kids
        if parent is not None:
            self.kids[parent][key] = None
            if self._first_kid.setdefault(parent, key) != key:
                self.branched.add(parent)
        waiting = self._waiting.pop(key, None)
        if waiting:  # it came back: its orphans are its again
            lost, orphans = self._lost, self.orphans
            for kid in waiting:
                del lost[kid]
                par[kid] = key
                kids[kid] = None
                orphans.pop(kid, None)

    def _descends(self, page: PageKey, key: PageKey) -> bool:
        """Whether ``page`` is in the subtree that ``key``, coming back, gets: its root
        is an orphan that lost ``key``. Walks up only when ``key`` has orphans waiting."""
        if key not in self._waiting:
            return False
        node: PageKey | None = page
        while node is not None:
            if self._lost.get(node) == key:
                return True
            node = self.parent.get(node)
        return False

    def remove(self, key: PageKey, strand: bool = True) -> None:
        """``key`` left the tier; its children become orphans. With ``strand`` false
        they become roots instead: ``key`` left a sampled view of the tier (a miniature
        whose sample shrank), where it will never come back, so its children lost
        nothing."""
        self._first_kid.pop(key, None)
        self.branched.discard(key)
        parent = self.parent.pop(key, None)
        all_kids = self.kids
        if parent is not None:
            siblings = all_kids.get(parent)
            if siblings is not None:
                siblings.pop(key, None)
        kids = all_kids.pop(key, None)
        orphans = self.orphans
        if kids and not strand:
            for kid in kids:
                self.parent[kid] = None
        elif kids:
            par, lost = self.parent, self._lost
            for kid in kids:
                par[kid] = None
                orphans[kid] = None
                lost[kid] = key
            self._waiting[key] = dict(kids)
        if orphans:
            orphans.pop(key, None)
        if self._lost:
            gone = self._lost.pop(key, None)
            if gone is not None:
                waiting = self._waiting[gone]
                del waiting[key]
                if not waiting:
                    del self._waiting[gone]

    def own_pages(self, keys: tuple[PageKey, ...]) -> tuple[PageKey, ...]:
        """``keys`` less the pages another sequence continues: every page with a child in
        the tier outside ``keys`` or that had two children while held (a branch point),
        and its ancestors among ``keys`` (a system prompt other sessions share, named
        with one session's context)."""
        inside = set(keys)
        shared: set[PageKey] = set()
        kids, parent, branched = self.kids, self.parent, self.branched
        for key in keys:
            if key in shared or not (
                key in branched or any(kid not in inside for kid in kids.get(key, ()))
            ):
                continue
            node: PageKey | None = key
            while node is not None and node in inside and node not in shared:
                shared.add(node)
                node = parent.get(node)
        return tuple(k for k in keys if k not in shared) if shared else keys

    def touch(self, key: PageKey) -> None:
        """``key`` was referenced: a page in use is not dead weight."""
        self.orphans.pop(key, None)

    def _post_order(self, top: PageKey, done: set[PageKey]) -> Iterator[PageKey]:
        """``top``'s subtree (pages not in ``done``), descendants deepest first, then
        ``top``; oldest child first."""
        kids = self.kids
        stack: list[tuple[PageKey, Iterator[PageKey]]] = [(top, iter(kids[top]))]
        while stack:
            node, it = stack[-1]
            for nxt in it:  # the next child to walk down to, if any is left
                if nxt not in done and nxt in kids:
                    stack.append((nxt, iter(kids[nxt])))
                    break
            else:
                stack.pop()
                yield node

    def order(
        self, offers: Offers, evictable: Callable[[PageKey], bool] | None = None
    ) -> Generator[PageKey, None, None]:
        """The pages of the forest, each once, best victim first: the orphans, then for
        each page a policy offers (``offers(done)``, given the pages yielded so far) that
        ``evictable`` accepts (every page without it), its subtree not yet yielded,
        deepest first and the page itself last (a page that may not go does not pull its
        descendants forward: they wait for their own turn). Victims are the first ``n``
        pages of it that ``evictable`` accepts. Lazy: reading ``m`` pages costs about
        ``m`` offers; the forest must not change while the iterator is in use."""
        done: set[PageKey] = set()
        for key in self.orphans:
            done.add(key)
            yield key
        inner = iter(offers(done))
        try:
            for top in inner:
                if top in done:
                    continue
                kids = self.kids.get(top)
                if kids is None:
                    done.add(top)  # not a page here: offered once, skipped
                    continue
                if evictable is not None and not evictable(top):
                    continue  # it stays; its subtree goes with an ancestor, or in turn
                if not kids:  # a leaf: no subtree to walk
                    done.add(top)
                    yield top
                    continue
                for key in self._post_order(top, done):
                    if key not in done:
                        done.add(key)
                        yield key
        finally:
            close_order(inner)


#: A policy's preference order for :meth:`PageForest.order`, given the pages it yielded.
Offers = Callable[[set[PageKey]], Iterable[PageKey]]


def policy_offers(policy: EvictionPolicy, evictable: Callable[[PageKey], bool] | None) -> Offers:
    """``policy``'s order: its ``ordered_keys`` when it has one (see
    :mod:`kvtier.policy.base`), otherwise one ``victims(1, ...)`` question per page,
    each excluding the pages yielded so far (a policy such as S3-FIFO that reorders its
    queues while it chooses is asked as it would be page by page)."""

    def offers(done: set[PageKey]) -> Iterator[PageKey]:
        order = ordered_keys_of(policy, evictable)
        return order if order is not None else _one_by_one(policy, done, evictable)

    return offers


def _one_by_one(
    policy: EvictionPolicy, done: set[PageKey], evictable: Callable[[PageKey], bool] | None
) -> Iterator[PageKey]:
    def ok(key: PageKey) -> bool:
        return key not in done and (evictable is None or evictable(key))

    while True:
        got = policy.victims(1, ok)
        if not got:
            return
        yield got[0]


class PrefixCutPolicy(EvictionPolicy):
    """Wraps ``inner``: orphans first, and a victim's descendants before it."""

    name: ClassVar[str] = "prefix-cut"

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.forest = PageForest()

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        forest = self.forest
        if key in forest.parent:
            forest.orphans.pop(key, None)  # forest.touch
            self.inner.on_access(key)
            return
        forest.add(key, parent)
        self.inner.on_insert(key, parent)

    def on_access(self, key: PageKey) -> None:
        forest = self.forest
        if key in forest.parent:
            forest.orphans.pop(key, None)  # forest.touch
            self.inner.on_access(key)

    def on_remove(self, key: PageKey) -> None:
        if key in self.forest.parent:
            self.forest.remove(key)
            self.inner.on_remove(key)

    def forget(self, key: PageKey) -> None:
        """``key`` left the sample of a miniature (:meth:`MiniCache.drop
        <kvtier.policy.shadow.MiniCache.drop>`): as :meth:`on_remove`, but its children
        become roots, not orphans."""
        if key in self.forest.parent:
            self.forest.remove(key, strand=False)
            self.inner.on_remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return victims_in_order(self.ordered_keys(evictable), n, evictable)

    def ordered_keys(
        self, evictable: Callable[[PageKey], bool] | None = None
    ) -> Generator[PageKey, None, None]:
        """The forest's order over the inner policy's (see :mod:`kvtier.policy.base`)."""
        return self.forest.order(policy_offers(self.inner, evictable), evictable)

    def __len__(self) -> int:
        return len(self.forest)

    def __contains__(self, key: object) -> bool:
        return key in self.forest
