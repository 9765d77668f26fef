"""Leaf-first eviction: a wrapper offering only pages no cached child depends on.

A page is useless without its prefix, so a tier should give up the end of a cached chain
before its beginning. :class:`LeafFirstPolicy` wraps any eviction policy (LRU, LRU-K...)
and filters its victims through a leaf oracle, in practice the cache's
:class:`~kvtier.index.prefix_tree.PrefixTree` (anything with ``is_leaf(key, tier)`` and
``tier_names`` serves). The inner policy still orders the leaves; every hook is passed
through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, Protocol

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy, close_order, ordered_keys_of


class LeafOracle(Protocol):
    """What leaf-first eviction needs to know of the cached pages."""

    @property
    def tier_names(self) -> Sequence[str]:
        """The tiers known, top first."""

    def is_leaf(self, key: PageKey, tier: str | None = None) -> bool:
        """Whether ``key`` has no child page cached in ``tier`` (any tier when ``None``)."""

    def parent(self, key: PageKey) -> PageKey | None:
        """The parent page of ``key`` (``None`` when first or unknown)."""

    def children_in(self, key: PageKey, tier: str) -> int:
        """How many child pages of ``key`` ``tier`` holds."""

    def links(self, key: PageKey, tier: str) -> tuple[int, int, PageKey | None, bool] | None:
        """(children ``tier`` holds, children anywhere, parent, held by ``tier`` only),
        ``None`` for an unknown page."""


class LeafFirstPolicy(EvictionPolicy):
    """Wraps a tier's eviction policy so that it only offers leaves of the prefix tree.

    A page whose child page is still held by the tier is never a victim there (for the
    last tier, where eviction drops the page from the hierarchy, no child may be held
    anywhere). The inner policy still orders the leaves (LRU, LRU-K...). Every hook is
    passed through; the tree itself is fed by the directory
    (:meth:`~kvtier.index.prefix_tree.PrefixTree.attach`).

    Args:
        inner: the policy choosing among leaves.
        tree: the prefix tree of the cache (a :class:`LeafOracle`).
        tier: the tier this policy serves.
        last: whether ``tier`` is the lowest (eviction drops pages).

    Raises:
        KVTierUsageError: ``tier`` is not one of the tree's tiers.
    """

    keeps_parents: ClassVar[bool] = True

    def __init__(self, inner: EvictionPolicy, tree: LeafOracle, tier: str, last: bool) -> None:
        if tier not in tree.tier_names:
            raise KVTierUsageError(
                f"unknown tier {tier!r}; the prefix tree knows {list(tree.tier_names)}"
            )
        self.inner = inner
        self.tree = tree
        self.tier = tier
        self.last = last
        self.name = f"leaf-first({inner.name})"  # type: ignore[misc]

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        self.inner.on_insert(key, parent)

    def on_access(self, key: PageKey) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: PageKey) -> None:
        self.inner.on_remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Up to ``n`` leaves in the inner policy's order, children before their parents: a
        parent whose every child here is taken becomes a leaf too, so one call walks a
        cold chain up from its tail (as evicting round after round would). A policy that
        exposes ``ordered_keys()`` (see :mod:`kvtier.policy.base`) is walked once."""
        order = ordered_keys_of(self.inner, evictable)
        if order is not None:
            try:
                return self._in_one_pass(order, n, evictable)
            finally:
                close_order(order)
        tree = self.tree
        if self.last:
            return self.inner.victims(n, lambda k: tree.is_leaf(k, None) and evictable(k))
        tier = self.tier
        chosen: list[PageKey] = []
        taken: set[PageKey] = set()
        freed: dict[PageKey, int] = {}  # children of a page chosen so far

        def leaf_now(k: PageKey) -> bool:
            gone = freed.get(k, 0)
            return tree.is_leaf(k, tier) if not gone else tree.children_in(k, tier) <= gone

        while len(chosen) < n:
            got = self.inner.victims(
                n - len(chosen), lambda k: k not in taken and leaf_now(k) and evictable(k)
            )
            if not got:
                break
            for k in got:
                chosen.append(k)
                taken.add(k)
                parent = tree.parent(k)
                if parent is not None:
                    freed[parent] = freed.get(parent, 0) + 1
        return chosen

    def _in_one_pass(
        self, order: Iterable[PageKey], n: int, evictable: Callable[[PageKey], bool]
    ) -> list[PageKey]:
        """Leaf-first victims from the inner policy's preference order, walked once.

        The answer is what ``n`` successive one-victim calls would give, each after the
        previous victim left: the first evictable leaf of the order, and whenever a
        victim was the last child (here) of a page met *earlier* in the order, that page
        next (it is now a leaf, and it precedes every key not yet taken). Victims come
        out children first, so a chain leaves the tier tail-first, as one batch. Cost:
        one step per key walked, instead of a rescan of every chain's ancestors per call.
        """
        out: list[PageKey] = []
        if n <= 0:
            return out
        links = self.tree.links
        tier = self.tier
        last = self.last
        pending: dict[PageKey, int] = {}  # walked non-leaves -> children still here
        taken_below: dict[PageKey, int] = {}  # children taken before their parent's turn
        for key in order:
            node = links(key, tier)
            if node is not None:
                here = node[1] if last else node[0]
                left = here - taken_below.pop(key, 0)
                if left > 0:
                    pending[key] = left
                    continue
            if not evictable(key):
                continue
            out.append(key)
            while node is not None and node[2] is not None and len(out) < n:
                # Leaving this tier frees a parent's child slot here; in the last tier the
                # node must leave the hierarchy (held in no other tier) to free it.
                if last and not node[3]:
                    break
                parent = node[2]
                if parent not in pending:
                    taken_below[parent] = taken_below.get(parent, 0) + 1
                    break
                pending[parent] -= 1
                if pending[parent] or not evictable(parent):
                    break
                del pending[parent]
                out.append(parent)
                node = links(parent, tier)
            if len(out) >= n:
                break
        return out

    def should_keep(self, key: PageKey) -> bool:
        """A victim that is no longer a leaf (a child landed in the tier while it was
        being evicted) stays: a parent never leaves before its child."""
        return not self.tree.is_leaf(key, None if self.last else self.tier)

    def may_drop(self, keys: Sequence[PageKey]) -> set[PageKey]:
        """The pages of ``keys`` (children before parents) with no child cached anywhere
        but among the pages before them that may go: a cold chain goes tail first."""
        out: set[PageKey] = set()
        going: dict[PageKey, int] = {}  # page -> its children among ``out``
        links = self.tree.links
        for key in keys:
            node = links(key, self.tier)
            if node is not None and node[1] > going.get(key, 0):
                continue
            out.add(key)
            if node is not None and node[2] is not None:
                going[node[2]] = going.get(node[2], 0) + 1
        return out

    def fallback_victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Victims for when :meth:`victims` offers none and the tier would otherwise
        refuse room: in a tier above the last, ancestors too (eviction moves them down,
        so their prefix stays cached), in the inner policy's fallback order when it has one
        (prefix-lru's own order reaches no ancestor of a spared leaf), else its order; none
        in the last tier (dropping an ancestor would orphan its descendants)."""
        if self.last:
            return []
        return self.inner.fallback_victims(n, evictable) or self.inner.victims(n, evictable)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner
