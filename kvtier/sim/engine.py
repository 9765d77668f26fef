"""The replay engine: the live pipeline's steps, without bytes, driven by the planner.

:class:`SimCache` keeps a set of resident pages per tier and asks the very
:class:`~kvtier.plan.planner.Planner` the live pipeline asks, at the same points and in
the same order as the live pipeline does for one engine request (sequentially, as the
live cache behaves when nothing runs concurrently and every call fits in one batch):

* :meth:`SimCache.lookup`: the longest prefix held by some tier, and which tier;
* :meth:`SimCache.load` (the prefix, pinned): every page counted
  (:meth:`~kvtier.plan.planner.Planner.note_lookup`), those below the top fetched from
  their :meth:`~kvtier.plan.planner.Planner.source` in batches, each batch making room
  first (victims go where :meth:`~kvtier.plan.planner.Planner.evict_plan` says), then the
  top tier trimmed under its high watermark;
* :meth:`SimCache.store` (the computed pages): counted
  (:meth:`~kvtier.plan.planner.Planner.note_store`), stored in batches with room made
  first, the top trimmed, then copied down as the write policy says
  (:meth:`~kvtier.plan.planner.Planner.write_through`), tier after tier;
* :meth:`SimCache.prefetch`: like a load, without pins or counting.

Where the live pipeline waits for work of other callers, the replay has none: room that
cannot be made drops the batch (the live cache raises :class:`CapacityError` there).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvtier.keys import PageKey
from kvtier.plan.limits import TierLimits
from kvtier.plan.planner import Planner, PlanTier, Spare
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.write import WritePolicy


class SimView:
    """Resident sets per tier (top first), read as the planner's page view."""

    def __init__(self, names: Sequence[str], resident: Sequence[set[PageKey]]) -> None:
        self.names = list(names)
        self.rank = {n: i for i, n in enumerate(names)}
        self.resident = list(resident)
        self.pinned: set[PageKey] = set()

    def used(self, tier: str) -> int:
        return len(self.resident[self.rank[tier]])

    def is_committed(self, key: PageKey, tier: str) -> bool:
        return key in self.resident[self.rank[tier]]

    def evictable(self, key: PageKey, tier: str) -> bool:
        return key not in self.pinned and key in self.resident[self.rank[tier]]

    def below(self, key: PageKey, tier: str) -> bool:
        return any(key in r for r in self.resident[self.rank[tier] + 1 :])

    def evicting(self, tier: str) -> int:
        return 0


class SimCache:
    """Tiers of resident sets driven through a planner.

    Args:
        names, capacities, policies: per tier, top first.
        resident: the resident set of each tier (mutated).
        limits: capacity and watermarks of each tier.
        write_policy: when pages go down.
        admission: the admission policy ``selective`` asks.
        batch_pages: the most pages per batch.
    """

    def __init__(
        self,
        names: Sequence[str],
        policies: Sequence[EvictionPolicy],
        resident: Sequence[set[PageKey]],
        limits: Sequence[TierLimits],
        write_policy: WritePolicy | str,
        admission: AdmissionPolicy,
        batch_pages: int,
    ) -> None:
        self.view = SimView(names, resident)
        self.names = list(names)
        self.limits = list(limits)
        self.planner = Planner(
            [PlanTier(n, lim, p) for n, lim, p in zip(names, limits, policies, strict=True)],
            self.view,
            write_policy,
            admission,
            batch_pages,
        )
        #: The parent of every page seen (the page before it in its first sequence).
        self.parent: dict[PageKey, PageKey | None] = {}
        #: Pages moved per link, ``"src->dst"``.
        self.moved: dict[str, int] = {}
        #: Pages that left the top tier (for prefetch bookkeeping), cleared by the caller.
        self.left_top: list[PageKey] = []

    def _count(self, link: str, n: int) -> None:
        if n:
            self.moved[link] = self.moved.get(link, 0) + n

    # -- the operations ------------------------------------------------------------------------

    def lookup(self, blocks: Sequence[PageKey]) -> list[int]:
        """The tier holding each page of the longest cached prefix of ``blocks``."""
        where: list[int] = []
        for k in blocks:
            i = self.planner.holder(k)
            if i is None:
                break
            where.append(i)
        return where

    def load(self, keys: Sequence[PageKey]) -> None:
        """Bring ``keys`` to the top tier (a demand fetch; pin them first)."""
        planner = self.planner
        uniq = list(dict.fromkeys(keys))
        for k in uniq:
            planner.note_lookup(k)
        self._bring_up(uniq, frozenset(uniq))

    def prefetch(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """Bring ``keys`` held below to the top tier; returns those that arrived."""
        uniq = list(dict.fromkeys(keys))
        top = self.view.resident[0]
        before = {k for k in uniq if k in top}
        self._bring_up(uniq, frozenset(uniq), "prefetch")
        return [k for k in uniq if k in top and k not in before]

    def store(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """Store ``keys`` (computed pages) in the top tier, then copy them down as the
        write policy says; returns those that landed in the top tier."""
        planner = self.planner
        top = self.view.resident[0]
        todo: list[PageKey] = []
        for k in dict.fromkeys(keys):
            planner.note_store(k, self.parent.get(k))
            if k in top:
                planner.note_access(0, k)
            else:
                todo.append(k)
        landed: list[PageKey] = []
        for batch in self.planner.batches(0, todo):
            landed.extend(self._move(None, 0, batch, ()))
        self._trim(0, ())
        if planner.write_policy.copies_on_store:
            self._write_through(0, [k for k in landed if k in top])
        return landed

    # -- steps -----------------------------------------------------------------------------------

    def _bring_up(
        self, keys: list[PageKey], wanted: frozenset[PageKey], label: str | None = None
    ) -> None:
        planner = self.planner
        top = self.view.resident[0]
        groups: dict[int, list[PageKey]] = {}
        for k in keys:
            if k not in top:
                src = planner.source(k)
                if src is not None:
                    groups.setdefault(src, []).append(k)
        for src, group in groups.items():
            for batch in self.planner.batches(0, group):
                self._move(src, 0, batch, wanted, label)
        self._trim(0, wanted)

    def _write_through(self, tier: int, keys: list[PageKey]) -> None:
        nxt = self.planner.next_tier(tier)
        if nxt is None:
            return
        keys = [k for k in self.planner.write_through(tier, keys) if k in self.view.resident[tier]]
        landed = self._copy(tier, nxt, keys)
        if landed:
            self._write_through(nxt, landed)

    def _copy(self, src: int, dst: int, keys: list[PageKey]) -> list[PageKey]:
        landed: list[PageKey] = []
        for batch in self.planner.batches(dst, keys):
            landed.extend(self._move(src, dst, batch, ()))
        return landed

    def _move(
        self,
        src: int | None,
        dst: int,
        keys: list[PageKey],
        protect: Collection[PageKey],
        label: str | None = None,
    ) -> list[PageKey]:
        """One batch into ``dst`` (from tier ``src``, or computed): room, land, trim."""
        planner = self.planner
        parents = [self.parent.get(k) for k in keys]
        spare = planner.room_spare(dst, parents, protect)
        resident = self.view.resident[dst]
        todo = [k for k in keys if k not in resident]
        landed: list[PageKey] = []
        if self._room(dst, len(todo), spare):  # room for the pages not there yet
            for k in todo:
                resident.add(k)
                planner.landed(dst, k, self.parent.get(k))
                landed.append(k)
            source = label or ("compute" if src is None else self.names[src])
            self._count(f"{source}->{self.names[dst]}", len(landed))
        if len(resident) > self.limits[dst].high:
            self._trim(dst, protect)
        return landed

    def _room(self, tier: int, n: int, spare: Collection[PageKey]) -> bool:
        """Make room for ``n`` pages in ``tier`` as the head of the live room queue does."""
        planner = self.planner
        limits = self.limits[tier]
        if n > limits.capacity:
            return False
        stuck: set[PageKey] = set()
        spare_all = Spare(spare, stuck)
        while True:
            if planner.fits(tier, n):
                return True
            victims = planner.room_victims(tier, n, 0, spare_all)
            if victims:
                stuck.update(self._evict(tier, victims))
                continue
            if len(self.view.resident[tier]) + n <= limits.capacity:
                return True
            victims = planner.fallback_victims(tier, n, 0, spare_all)
            if victims:
                stuck.update(self._evict(tier, victims))
                continue
            return False

    def _trim(self, tier: int, spare: Collection[PageKey]) -> None:
        while True:
            victims = self.planner.trim_victims(tier, spare)
            if not victims:
                return
            if len(self._evict(tier, victims)) == len(victims):
                return

    def _evict(self, tier: int, victims: list[PageKey]) -> set[PageKey]:
        """Evict ``victims`` from ``tier``: write down, drop or free each as planned;
        returns those that stay (their write-down found no room)."""
        planner = self.planner
        plan = planner.evict_plan(tier, victims)
        stuck: set[PageKey] = set()
        nxt = planner.next_tier(tier)
        if plan.down and nxt is not None:
            landed = set(self._copy(tier, nxt, plan.down))
            stuck = {k for k in plan.down if k not in landed and k not in self.view.resident[nxt]}
        resident = self.view.resident[tier]
        for k in victims:
            if k in stuck or planner.keeps(tier, k):
                continue
            resident.discard(k)
            planner.left(tier, k)
            if tier == 0:
                self.left_top.append(k)
        return stuck

    def note_parents(self, blocks: Iterable[PageKey]) -> None:
        """Record each block's parent (the block before it) the first time it is seen."""
        prev: PageKey | None = None
        parent = self.parent
        for k in blocks:
            if k not in parent:
                parent[k] = prev
            prev = k
