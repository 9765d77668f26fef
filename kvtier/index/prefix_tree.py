"""The prefix tree: which leading pages of a token sequence are cached, and where.

Page keys chain (``key(i) = hash(key(i-1), tokens of page i, namespace)``), so every key
names its whole prefix and has exactly one parent: the set of cached keys *is* a radix
tree over pages, one node per page, and a prefix match is a walk from the root that stops
at the first page cached nowhere. Each node records the tiers holding its page (a bit
mask; the tier order is fixed at construction, top first) and how many of its children
each tier holds, so the questions the eviction side asks are O(1):

* :meth:`PrefixTree.match` — the longest cached prefix of a list of keys and, per page,
  the topmost tier that holds it;
* :meth:`PrefixTree.is_leaf` — whether a page may leave a tier without stranding a
  descendant (leaves are evicted before their ancestors: a page is useless without its
  prefix); :meth:`PrefixTree.evictable` wraps it as the filter an eviction policy's
  ``victims`` takes (:class:`kvtier.policy.leaf_first.LeafFirstPolicy` builds on it).

A node whose page left every tier but which still has cached descendants stays as a
*hollow* node (it ends every match that reaches it) and disappears with its last
descendant. The tree holds committed pages only: it is fed by the directory's commit and
remove listeners (:meth:`PrefixTree.attach`) or by explicit :meth:`add` /
:meth:`discard` calls, never by reservations, so a failed or speculative write is never
visible here. Owned by the event-loop thread; no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KVTierUsageError
from kvtier.keys import KEY_BYTES, ROOT_KEY, PageKey


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix of a key list.

    Attributes:
        keys: the matched keys, in order (the first ``len(keys)`` of the query).
        tiers: for each matched key, the name of the topmost tier holding it.
    """

    keys: list[PageKey]
    tiers: list[str]

    @property
    def pages(self) -> int:
        """Number of leading pages cached somewhere."""
        return len(self.keys)


#: Width of one tier's child counter inside ``_Node.child_tiers`` (one int for all tiers:
#: no list per node, which halves insert cost at 10^6 pages).
_FIELD = 32
_FIELD_MASK = (1 << _FIELD) - 1


class _Node:
    __slots__ = ("child_tiers", "children", "mask", "parent")

    def __init__(self, parent: PageKey | None) -> None:
        # None = parent unknown (the node was created hollow, as someone's parent).
        self.parent = parent
        self.mask = 0  # bit t: the page is held by tier t
        self.children = 0  # child nodes (hollow ones included)
        self.child_tiers = 0  # field t (_FIELD bits): children held by tier t


class PrefixTree:
    """Radix tree over page keys with the tiers of each page. See the module docstring.

    Args:
        tiers: tier names, top first. ``match`` reports the topmost holder of each page.
    """

    def __init__(self, tiers: Sequence[str]) -> None:
        names = list(tiers)
        if not names:
            raise KVTierUsageError("PrefixTree needs at least one tier name")
        if len(set(names)) != len(names):
            raise KVTierUsageError(f"PrefixTree: duplicate tier names in {names}")
        self.tier_names: tuple[str, ...] = tuple(names)
        self._bit = {name: i for i, name in enumerate(names)}
        self._nodes: dict[PageKey, _Node] = {}
        self._pages_per_tier = [0] * len(names)

    # -- tier names ----------------------------------------------------------------------

    def _tier_index(self, tier: str) -> int:
        try:
            return self._bit[tier]
        except KeyError:
            raise KVTierUsageError(
                f"unknown tier {tier!r}; the prefix tree knows {list(self.tier_names)}"
            ) from None

    def _top(self, mask: int) -> str:
        return self.tier_names[(mask & -mask).bit_length() - 1]

    # -- updates -------------------------------------------------------------------------

    def add(self, key: PageKey, parent: PageKey | None, tier: str) -> None:
        """Record that ``key`` (child of ``parent``; ``ROOT_KEY`` or ``None`` for a first
        page) is committed in ``tier``. Adding a page already recorded there is a no-op.
        A parent that contradicts the chain recorded before (``key`` itself, or a page
        below ``key``: parents given by a caller, as ``KVCache.store_pages`` takes them)
        is not recorded: it would close a cycle in which no page is ever a leaf."""
        t = self._tier_index(tier)
        if len(key) != KEY_BYTES:
            raise KVTierUsageError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
        if parent in (ROOT_KEY, key):
            parent = None
        nodes = self._nodes
        node = nodes.get(key)
        if node is None:
            node = _Node(parent)
            nodes[key] = node
            if parent is not None:
                self._link(parent)
        elif node.parent is None and parent is not None and not self._below(parent, key):
            node.parent = parent  # a hollow node learns its parent
            self._link(parent)
            if node.mask:
                self._count_child_tiers(parent, node.mask, +1)
        bit = 1 << t
        if node.mask & bit:
            return
        node.mask |= bit
        self._pages_per_tier[t] += 1
        if node.parent is not None:
            nodes[node.parent].child_tiers += 1 << (_FIELD * t)

    def _below(self, page: PageKey, key: PageKey) -> bool:
        """Whether ``page`` descends from ``key`` (walks up from ``page``; the tree has no
        cycle, so the walk ends). Asked only when a hollow node learns its parent."""
        nodes = self._nodes
        at: PageKey | None = page
        while at is not None:
            if at == key:
                return True
            node = nodes.get(at)
            at = None if node is None else node.parent
        return False

    def _link(self, parent: PageKey) -> None:
        """Count one more child under ``parent``, creating it hollow if unknown."""
        pnode = self._nodes.get(parent)
        if pnode is None:
            pnode = _Node(None)
            self._nodes[parent] = pnode
        pnode.children += 1

    def _count_child_tiers(self, parent: PageKey, mask: int, delta: int) -> None:
        pnode = self._nodes[parent]
        t = 0
        while mask:
            if mask & 1:
                pnode.child_tiers += delta << (_FIELD * t)
            mask >>= 1
            t += 1

    def insert(self, keys: Sequence[PageKey], tier: str, parent: PageKey = ROOT_KEY) -> None:
        """Record a chain of pages (``keys[0]``'s parent is ``parent``) as held by ``tier``.

        A key of the wrong length raises :class:`KVTierUsageError`; the pages before it
        stay recorded."""
        t = self._tier_index(tier)
        bit = 1 << t
        inc = 1 << (_FIELD * t)
        nodes = self._nodes
        prev: PageKey | None = None if parent == ROOT_KEY else parent
        added = 0
        try:
            for key in keys:
                node = nodes.get(key)
                if node is not None or len(key) != KEY_BYTES or key == prev:
                    # the general path: existing node, bad key, a page after itself
                    self.add(key, prev, tier)
                    prev = key
                    continue
                # fast path: a new page whose parent is known (or the root)
                node = _Node(prev)
                node.mask = bit
                nodes[key] = node
                added += 1
                if prev is not None:
                    pnode = nodes.get(prev)
                    if pnode is None:
                        pnode = _Node(None)
                        nodes[prev] = pnode
                    pnode.children += 1
                    pnode.child_tiers += inc
                prev = key
        finally:  # a bad key raises mid-chain: the pages before it stay, counted
            self._pages_per_tier[t] += added

    def discard(self, key: PageKey, tier: str) -> bool:
        """Record that ``key`` left ``tier``; ``True`` if it was recorded there.

        A node left with no page and no children is removed, and so are its hollow
        ancestors that thereby lose their last child.
        """
        t = self._tier_index(tier)
        node = self._nodes.get(key)
        bit = 1 << t
        if node is None or not node.mask & bit:
            return False
        node.mask &= ~bit
        self._pages_per_tier[t] -= 1
        if node.parent is not None:
            self._nodes[node.parent].child_tiers -= 1 << (_FIELD * t)
        self._prune(key, node)
        return True

    def discard_all(self, key: PageKey) -> list[str]:
        """Record that ``key`` left every tier; returns the tiers it was in."""
        node = self._nodes.get(key)
        if node is None:
            return []
        held = [name for i, name in enumerate(self.tier_names) if node.mask >> i & 1]
        for name in held:
            self.discard(key, name)
        return held

    def _prune(self, key: PageKey, node: _Node) -> None:
        while node.mask == 0 and node.children == 0:
            del self._nodes[key]
            parent = node.parent
            if parent is None:
                return
            pnode = self._nodes[parent]
            pnode.children -= 1
            key, node = parent, pnode

    def clear(self) -> None:
        """Forget every page."""
        self._nodes.clear()
        self._pages_per_tier = [0] * len(self.tier_names)

    # -- queries -------------------------------------------------------------------------

    def match(self, keys: Iterable[PageKey]) -> PrefixMatch:
        """The longest prefix of ``keys`` cached in some tier, with each page's top tier."""
        nodes = self._nodes
        names = self.tier_names
        matched: list[PageKey] = []
        tiers: list[str] = []
        for key in keys:
            node = nodes.get(key)
            if node is None or not node.mask:
                break
            mask = node.mask
            matched.append(key)
            tiers.append(names[(mask & -mask).bit_length() - 1])
        return PrefixMatch(matched, tiers)

    def match_length(self, keys: Iterable[PageKey]) -> int:
        """How many leading keys are cached somewhere (``match`` without the lists)."""
        nodes = self._nodes
        n = 0
        for key in keys:
            node = nodes.get(key)
            if node is None or not node.mask:
                break
            n += 1
        return n

    def tiers_of(self, key: PageKey) -> list[str]:
        """Tiers holding ``key``, top first (empty when it is cached nowhere)."""
        node = self._nodes.get(key)
        if node is None:
            return []
        return [name for i, name in enumerate(self.tier_names) if node.mask >> i & 1]

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The parent recorded for ``key`` (``None`` for a first page or unknown key)."""
        node = self._nodes.get(key)
        return None if node is None else node.parent

    def parent(self, key: PageKey) -> PageKey | None:
        """The parent page of ``key`` (``None``: a first page, unknown, or not cached)."""
        node = self._nodes.get(key)
        return None if node is None else node.parent

    def links(self, key: PageKey, tier: str) -> tuple[int, int, PageKey | None, bool] | None:
        """What leaf-first eviction needs of ``key`` in one call: (children ``tier`` holds,
        children cached anywhere, its parent, whether ``tier`` is the only tier holding
        it); ``None`` for a page the tree does not know."""
        node = self._nodes.get(key)
        if node is None:
            return None
        t = self._tier_index(tier)
        here = (node.child_tiers >> (_FIELD * t)) & _FIELD_MASK
        return here, node.children, node.parent, node.mask == 1 << t

    def children_in(self, key: PageKey, tier: str) -> int:
        """How many child pages of ``key`` ``tier`` holds."""
        node = self._nodes.get(key)
        if node is None:
            return 0
        return (node.child_tiers >> (_FIELD * self._tier_index(tier))) & _FIELD_MASK

    def is_leaf(self, key: PageKey, tier: str | None = None) -> bool:
        """Whether ``key`` has no child page cached in ``tier`` (any tier when ``None``).

        Use ``tier`` for a move down (the page stays cached below, so only children in
        the same tier matter) and ``None`` before dropping a page from the hierarchy.
        An unknown key is a leaf.
        """
        node = self._nodes.get(key)
        if node is None:
            return True
        if tier is None:
            return node.children == 0
        return (node.child_tiers >> (_FIELD * self._tier_index(tier))) & _FIELD_MASK == 0

    def evictable(
        self, tier: str | None = None, also: Callable[[PageKey], bool] | None = None
    ) -> Callable[[PageKey], bool]:
        """A filter for an eviction policy's ``victims``: leaves of ``tier`` (see
        :meth:`is_leaf`), further restricted by ``also`` (e.g. "not pinned")."""
        if tier is not None:
            self._tier_index(tier)

        def accept(key: PageKey) -> bool:
            return self.is_leaf(key, tier) and (also is None or also(key))

        return accept

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached in some tier (hollow nodes are not)."""
        node = self._nodes.get(key)  # type: ignore[call-overload]
        return node is not None and node.mask != 0

    def __len__(self) -> int:
        """Pages cached in at least one tier."""
        return sum(1 for node in self._nodes.values() if node.mask)

    def pages_in(self, tier: str) -> int:
        """Pages recorded in ``tier``."""
        return self._pages_per_tier[self._tier_index(tier)]

    def items(self) -> Iterator[tuple[PageKey, frozenset[str]]]:
        """``(key, tiers)`` for every cached page (for consistency checks and inspection)."""
        for key, node in self._nodes.items():
            if node.mask:
                yield (
                    key,
                    frozenset(name for i, name in enumerate(self.tier_names) if node.mask >> i & 1),
                )

    def node_count(self) -> int:
        """Nodes held, hollow ones included."""
        return len(self._nodes)

    # -- staying consistent with the directory -------------------------------------------

    def attach(self, directory: Any) -> Callable[[], None]:
        """Follow ``directory``'s commits and removals (a
        :class:`~kvtier.index.directory.Directory`); returns the unsubscribe function.

        Pages already committed there are added first; tiers the tree does not know are
        ignored. The parent of each page is taken from the directory's entry.
        """
        tree = self

        class _Listener:
            def on_commit(self, key: PageKey, tier: str) -> None:
                if tier in tree._bit:
                    entry = directory.get(key)
                    tree.add(key, None if entry is None else entry.parent, tier)

            def on_remove(self, key: PageKey, tier: str) -> None:
                if tier in tree._bit:
                    tree.discard(key, tier)

        listener = _Listener()
        for tier in directory.tiers:
            for key in directory.keys_in(tier):
                listener.on_commit(key, tier)
        unsubscribe: Callable[[], None] = directory.subscribe(listener)
        return unsubscribe
