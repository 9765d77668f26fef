"""The planner: every decision about what goes where, in one synchronous object.

The planner reads where pages are through a :class:`PageView` (the live directory, or the
replay's resident sets) and answers:

* **room** — whether ``n`` pages fit in a tier under its high watermark
  (:meth:`Planner.fits`), and which pages to evict first (:meth:`Planner.room_victims`):
  enough that the tier stays at or below its high watermark once the pages land, down to
  its low watermark when it crosses it; when the policy's preferred victims ran out,
  :meth:`Planner.fallback_victims`; after pages landed above the high watermark,
  :meth:`Planner.trim_victims`;
* **where a victim goes** — :meth:`Planner.evict_plan`: already held below (just free
  it), down to the next tier (the write policy sends it), or dropped (the last tier, or
  a page ``selective`` does not admit); which victims that cannot go down because the
  tier below has no room may be dropped instead (:meth:`Planner.droppable`);
* **what stores in progress extend** — the parents of the pages a store is adding
  (:meth:`Planner.expect`): the last tier never drops one of them, since that would
  leave a hole in the prefix the store is about to extend;
* **what the write policy copies down now** — :meth:`Planner.write_through`, and what a
  flush writes (:meth:`Planner.dirty`);
* **where a fetch reads from** — :meth:`Planner.source`: the highest tier below the top
  holding the page;
* **the policy hooks of each reference** — a lookup (:meth:`Planner.note_lookup`: the
  tier that hits, the admission policy's count), a store (:meth:`Planner.note_store`),
  a page landing or leaving a tier (:meth:`Planner.landed`, :meth:`Planner.left`).

It never awaits and moves nothing: the mover (live) or the replay carries out what it
decides, and reports what really happened through the hooks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.plan.limits import TierLimits
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.write import WritePolicy


class PageView(Protocol):
    """Where pages are, as the planner reads it (tiers by name)."""

    def used(self, tier: str) -> int:
        """Pages taking room in ``tier`` (committed, being written or being evicted)."""

    def is_committed(self, key: PageKey, tier: str) -> bool:
        """Whether ``key`` is readable in ``tier``."""

    def evictable(self, key: PageKey, tier: str) -> bool:
        """Whether ``key`` may be evicted from ``tier`` now (committed, not pinned, not
        being copied)."""

    def below(self, key: PageKey, tier: str) -> bool:
        """Whether ``key`` is committed in a tier under ``tier``."""

    def evicting(self, tier: str) -> int:
        """Pages of ``tier`` whose eviction is under way."""


class Spare:
    """Pages a room-making call must not evict: its ``protect`` set, plus the victims
    that got stuck (their write-down failed) while it made room, plus, once ``skip`` is
    set, every page it names (not counted by ``len`` nor listed by iteration: a
    predicate, e.g. "needs a write-down" once write-downs fail)."""

    def __init__(self, protect: Collection[PageKey], stuck: set[PageKey]) -> None:
        self.protect = protect
        self.stuck = stuck
        self.skip: Callable[[PageKey], bool] | None = None

    def __contains__(self, key: object) -> bool:
        if key in self.stuck or key in self.protect:
            return True
        return self.skip is not None and self.skip(key)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.stuck) + len(self.protect)

    def __iter__(self) -> Iterator[PageKey]:
        yield from self.stuck
        yield from self.protect


@dataclass
class PlanTier:
    """What the planner knows of one tier: its name, limits and eviction policy."""

    name: str
    limits: TierLimits
    policy: EvictionPolicy


@dataclass
class EvictPlan:
    """Where each victim of a tier goes.

    Attributes:
        down: victims to copy to the next tier first (then free).
        drop: victims to free without a copy (the last tier, or not admitted below).
        free: victims a lower tier holds already (free them; nothing is lost).
    """

    down: list[PageKey] = field(default_factory=list)
    drop: list[PageKey] = field(default_factory=list)
    free: list[PageKey] = field(default_factory=list)


class Planner:
    """Decisions for a stack of tiers (top first) over ``view``.

    Args:
        tiers: the tiers, top first.
        view: where pages are.
        write_policy: when pages are written down.
        admission: the admission policy ``selective`` asks; it also counts references.
        batch_pages: the most pages one transfer batch carries.
        held: pages of a tier (by index) that no planned work will free: pinned pages
            and slots reserved outside the pipeline (an engine's working pool). Batches
            are cut to fit beside them. ``None`` (the replay): nothing is held.

    Raises:
        KVTierUsageError: no tiers, duplicate tier names, or ``batch_pages`` < 1.
    """

    def __init__(
        self,
        tiers: Sequence[PlanTier],
        view: PageView,
        write_policy: WritePolicy | str,
        admission: AdmissionPolicy,
        batch_pages: int = 32,
        held: Callable[[int], int] | None = None,
    ) -> None:
        if not tiers:
            raise KVTierUsageError("a planner needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KVTierUsageError(f"tier names must be distinct, got {names}")
        if batch_pages < 1:
            raise KVTierUsageError(f"batch_pages must be >= 1, got {batch_pages}")
        self.tiers = list(tiers)
        self.view = view
        self.write_policy = WritePolicy.parse(write_policy, "write policy")
        self.admission = admission
        self.batch_pages = batch_pages
        self._held = held
        #: Parents of the pages stores in progress are adding (with multiplicity).
        self.expected: Counter[PageKey] = Counter()
        #: Stored pages whose copy in a shared tier below is to be checked (:meth:`hold`),
        #: and how many of them wait for a check already running (not for their store);
        #: tiers above index ``hold_above`` (the first shared one) keep them.
        self.checking: Counter[PageKey] = Counter()
        self.checks_running = 0
        self.hold_above = 0

    # -- room ----------------------------------------------------------------------------

    def batch_size(self, tier: int) -> int:
        """Pages per batch into ``tier``: ``batch_pages``, but never more than the tier
        holds under its high watermark, nor than it has beside its held pages (pinned,
        or reserved outside the pipeline), so a batch can always be made room for; and,
        when its policy keeps parents (leaf-first), fewer than that room: room for a
        batch spares the page the batch extends, so a batch of all of it could never be
        made room for (with ``high_watermark = 1``). A batch of the watermark's size
        beside 10 held pages of 24 raised CapacityError, and the store kept nothing."""
        t = self.tiers[tier]
        n = min(self.batch_pages, t.limits.high)
        free = t.limits.capacity - (self._held(tier) if self._held is not None else 0)
        n = min(n, free)
        if t.policy.keeps_parents and n >= free > 1:
            n = free - 1
        return max(1, n)

    def batches(self, tier: int, keys: Sequence[PageKey]) -> list[list[PageKey]]:
        """``keys`` cut into batches of :meth:`batch_size` for ``tier``."""
        n = self.batch_size(tier)
        return [list(keys[i : i + n]) for i in range(0, len(keys), n)]

    def fits(self, tier: int, n: int, pending: int = 0) -> bool:
        """Whether ``n`` more pages fit under ``tier``'s high watermark (or, for a batch
        larger than the watermark, in ``n`` pages), counting ``pending`` pages promised
        to batches that have not reserved yet."""
        t = self.tiers[tier]
        return self.view.used(t.name) + pending + n <= max(t.limits.high, n)

    def over(self, tier: int, n: int, pending: int = 0) -> int:
        """Pages to evict from ``tier`` before ``n`` more pages land: down to the low
        watermark (or to ``n`` pages), minus evictions already under way."""
        t = self.tiers[tier]
        used = self.view.used(t.name) + pending
        return used + n - max(t.limits.low, n) - self.view.evicting(t.name)

    def room_victims(
        self, tier: int, n: int, pending: int = 0, spare: Collection[PageKey] = ()
    ) -> list[PageKey]:
        """The policy's victims to evict from ``tier`` before ``n`` pages land (none when
        they fit), never a page of ``spare`` (what the calling operation brings up or
        could not move)."""
        if self.fits(tier, n, pending):
            return []
        return self.victims(tier, self.over(tier, n, pending), spare)

    def room_spare(
        self,
        tier: int,
        parents: Iterable[PageKey | None],
        protect: Collection[PageKey] = (),
    ) -> Collection[PageKey]:
        """What room made in ``tier`` for a batch must not evict: ``protect``, plus, when
        the tier's policy keeps parents (leaf-first), the parents of the batch's pages
        (``parents``): evicting one would leave a hole in the prefix the batch extends."""
        if not self.tiers[tier].policy.keeps_parents:
            return protect
        held = {p for p in parents if p is not None}
        return frozenset(protect) | held if held else protect

    def fallback_victims(
        self, tier: int, n: int, pending: int = 0, spare: Collection[PageKey] = ()
    ) -> list[PageKey]:
        """Pages the policy would rather keep but gives up when its preferred victims ran
        out (leaf-first: ancestors, which move down; none in the last tier)."""
        want = self.over(tier, n, pending)
        if want <= 0:
            return []
        t = self.tiers[tier]
        return t.policy.fallback_victims(want, self._evictable(t.name, spare))

    def trim_victims(self, tier: int, spare: Collection[PageKey] = ()) -> list[PageKey]:
        """Victims that bring ``tier`` back to its low watermark after pages landed above
        its high watermark (none while it is at or under it)."""
        t = self.tiers[tier]
        used = self.view.used(t.name)
        if used <= t.limits.high:
            return []
        return self.victims(tier, used - t.limits.low - self.view.evicting(t.name), spare)

    def victims(self, tier: int, n: int, spare: Collection[PageKey] = ()) -> list[PageKey]:
        """Up to ``n`` evictable pages of ``tier`` in the policy's order, sparing ``spare``."""
        if n <= 0:
            return []
        t = self.tiers[tier]
        return t.policy.victims(n, self._evictable(t.name, spare))

    def _evictable(self, name: str, spare: Collection[PageKey]) -> Callable[[PageKey], bool]:
        evictable = self.view.evictable
        expected = self.expected if name == self.tiers[-1].name else ()
        above = any(t.name == name for t in self.tiers[: self.hold_above])
        checking = self.checking if above else ()

        def ok(key: PageKey) -> bool:
            return (
                key not in spare
                and key not in expected
                and key not in checking
                and evictable(key, name)
            )

        return ok

    # -- stores in progress --------------------------------------------------------------

    def expect(self, parents: Iterable[PageKey | None]) -> list[PageKey]:
        """A store is about to add children to ``parents`` (``None`` entries ignored):
        until :meth:`unexpect`, the last tier neither names one of them a victim nor lets
        one already chosen leave (under leaf-first its child is not cached yet, so the
        page looks like a leaf; dropping it would orphan the page about to land). Returns
        what to hand to :meth:`unexpect`."""
        held = [p for p in parents if p is not None]
        self.expected.update(held)
        return held

    def unexpect(self, parents: Iterable[PageKey]) -> None:
        """The store that :meth:`expect` announced ``parents`` for has ended."""
        _uncount(self.expected, parents)

    def hold(self, keys: Iterable[PageKey], pool: int) -> list[PageKey]:
        """Keep ``keys`` in the tiers above tier ``pool`` (a shared tier that counts
        them) until :meth:`unhold`, while the write-through checks that the pool still
        has them: counted there, a page leaving a tier above would be dropped as clean,
        and lost for good if the pool had lost it. Returns what to hand to
        :meth:`unhold`."""
        held = list(keys)
        self.checking.update(held)
        self.hold_above = pool
        return held

    def unhold(self, keys: Sequence[PageKey], running: bool = False) -> None:
        """The check that :meth:`hold` waited for has ended (``running``: it had begun,
        :attr:`checks_running` counted its pages)."""
        if running:
            self.checks_running -= len(keys)
        _uncount(self.checking, keys)

    # -- where pages go ------------------------------------------------------------------

    def keeps(self, tier: int, key: PageKey) -> bool:
        """Whether a victim of ``tier`` should stay after all (asked just before it
        leaves; see :meth:`~kvtier.policy.base.EvictionPolicy.should_keep`); in the last
        tier, also a page a store in progress extends (:meth:`expect`)."""
        if tier == len(self.tiers) - 1 and key in self.expected:
            return True
        if tier < self.hold_above and key in self.checking:
            return True
        return self.tiers[tier].policy.should_keep(key)

    def droppable(self, tier: int, victims: Sequence[PageKey]) -> set[PageKey]:
        """The victims of ``tier`` (children before parents) that may leave the hierarchy
        when the tier below has no room for them, as the last tier would drop them: only
        under a policy that keeps parents (leaf-first, where a lower tier whose every page
        has a descendant up here could otherwise never free itself), only pages no cached
        page depends on once the others go
        (:meth:`~kvtier.policy.base.EvictionPolicy.may_drop`), and never one a store in
        progress extends. The others stay (not as failed: once these are gone, the tier
        below may make room for them)."""
        policy = self.tiers[tier].policy
        if not policy.keeps_parents:
            return set()
        return policy.may_drop([k for k in victims if k not in self.expected])

    def next_tier(self, tier: int) -> int | None:
        """The tier under ``tier``, ``None`` for the last."""
        return tier + 1 if tier + 1 < len(self.tiers) else None

    def sends_down(self, key: PageKey) -> bool:
        """Whether the write policy lets ``key`` go to a lower tier."""
        return self.write_policy.sends_down(key, self.admission)

    def goes_down(self, tier: int, key: PageKey) -> bool:
        """Whether evicting ``key`` from ``tier`` copies it to the tier below first (it
        lands in :attr:`EvictPlan.down`)."""
        return (
            self.next_tier(tier) is not None
            and not self.view.below(key, self.tiers[tier].name)
            and self.sends_down(key)
        )

    def skip_write_downs(self, tier: int, spare: Spare) -> None:
        """From now on ``spare`` also holds every page of ``tier`` whose eviction would
        need a write-down (:meth:`goes_down`): the tier below is refusing them."""
        spare.skip = lambda key: self.goes_down(tier, key)

    def evict_plan(self, tier: int, victims: Iterable[PageKey]) -> EvictPlan:
        """Where each victim of ``tier`` goes (see :class:`EvictPlan`)."""
        plan = EvictPlan()
        name = self.tiers[tier].name
        nxt = self.next_tier(tier)
        for k in victims:
            if self.view.below(k, name):
                plan.free.append(k)
            elif nxt is not None and self.sends_down(k):
                plan.down.append(k)
            else:
                plan.drop.append(k)
        return plan

    def write_through(self, tier: int, keys: Iterable[PageKey]) -> list[PageKey]:
        """Pages just committed in ``tier`` that the write policy copies to the next tier
        now (write-through: all; selective: admitted ones; write-back: none), skipping
        those the next tier holds already."""
        nxt = self.next_tier(tier)
        if nxt is None or not self.write_policy.copies_on_store:
            return []
        below = self.tiers[nxt].name
        return [k for k in keys if self.sends_down(k) and not self.view.is_committed(k, below)]

    def dirty(self, tier: int, keys: Iterable[PageKey]) -> list[PageKey]:
        """Pages of ``tier`` held in no lower tier that the write policy would write down
        (what a flush writes)."""
        if self.next_tier(tier) is None:
            return []
        name = self.tiers[tier].name
        return [k for k in keys if not self.view.below(k, name) and self.sends_down(k)]

    def source(self, key: PageKey, exclude: Collection[str] = ()) -> int | None:
        """The highest tier below the top holding ``key``, skipping the names in
        ``exclude`` (tiers that already failed to give it); ``None`` when none does."""
        for i in range(1, len(self.tiers)):
            name = self.tiers[i].name
            if name not in exclude and self.view.is_committed(key, name):
                return i
        return None

    def holder(self, key: PageKey) -> int | None:
        """The highest tier holding ``key`` (``None``: no tier does)."""
        for i, t in enumerate(self.tiers):
            if self.view.is_committed(key, t.name):
                return i
        return None

    # -- references ------------------------------------------------------------------------

    def note_lookup(self, key: PageKey, holder: int | None = None) -> int | None:
        """A page was asked for (a load or read): the admission policy counts it, and the
        highest tier holding it (``holder`` when the caller knows it, e.g. a page being
        evicted that a load keeps; returned: it hits there, every tier above misses) sees
        an access."""
        self.admission.on_access(key)
        i = self.holder(key) if holder is None else holder
        if i is not None:
            self.tiers[i].policy.on_access(key)
        return i

    def note_store(self, key: PageKey, parent: PageKey | None) -> None:
        """A page was stored (``parent``: the page before it, ``None`` when first or
        unknown): the admission policy counts it and learns its parent."""
        self.admission.on_access(key)
        self.admission.note_parent(key, parent)

    def note_access(self, tier: int, key: PageKey) -> None:
        """A page held by ``tier`` was used again (stored while already there)."""
        self.tiers[tier].policy.on_access(key)

    def landed(self, tier: int, key: PageKey, parent: PageKey | None) -> None:
        """``key`` was committed in ``tier``."""
        self.tiers[tier].policy.on_insert(key, parent)

    def left(self, tier: int, key: PageKey) -> None:
        """``key`` left ``tier`` (evicted, deleted, or found gone)."""
        self.tiers[tier].policy.on_remove(key)


def _uncount(counter: Counter[PageKey], keys: Iterable[PageKey]) -> None:
    """Take one count of each of ``keys`` off ``counter``, dropping those at zero."""
    for k in keys:
        left = counter[k] - 1
        if left > 0:
            counter[k] = left
        else:
            counter.pop(k, None)
