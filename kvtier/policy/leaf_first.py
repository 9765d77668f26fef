"""Leaf-first eviction: a wrapper offering only pages no cached child depends on.

A page is useless without its prefix, so a tier should give up the end of a cached chain
before its beginning. :class:`LeafFirstPolicy` wraps any eviction policy (LRU, LRU-K...)
and filters its victims through a leaf oracle, in practice the cache's
:class:`~kvtier.index.prefix_tree.PrefixTree` (anything with ``is_leaf(key, tier)`` and
``tier_names`` serves). The inner policy still orders the leaves; every hook is passed
through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy


class LeafOracle(Protocol):
    """What leaf-first eviction needs to know of the cached pages."""

    @property
    def tier_names(self) -> Sequence[str]:
        """The tiers known, top first."""

    def is_leaf(self, key: PageKey, tier: str | None = None) -> bool:
        """Whether ``key`` has no child page cached in ``tier`` (any tier when ``None``)."""


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
        tier = None if self.last else self.tier
        is_leaf = self.tree.is_leaf
        return self.inner.victims(n, lambda k: is_leaf(k, tier) and evictable(k))

    def fallback_victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Victims for when :meth:`victims` offers none and the tier would otherwise
        refuse room: in a tier above the last, ancestors too (eviction moves them down,
        so their prefix stays cached); none in the last tier (dropping an ancestor would
        orphan its descendants)."""
        return [] if self.last else self.inner.victims(n, evictable)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner
