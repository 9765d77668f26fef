"""The request-by-request replay engine: simulated tiers driven through the planner.

:class:`Replayer` plays one engine request at a time (:meth:`Replayer.run_request`)
through a stack of :class:`SimTier` (top first) with the live pipeline's steps and the
live :class:`~kvtier.plan.planner.Planner` (:class:`~kvtier.sim.engine.SimCache`): lookup,
load of the cached prefix (pinned), store of the computed rest. It is the engine of
:func:`kvtier.sim.replay.replay` (``kvtier bench sim``) and of the what-if estimator's
miniature caches (:mod:`kvtier.sim.whatif`), which drives it with the requests a live
cache sees. It imports no trace and nothing of the live cache, so a live cache's
what-if observer can run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.plan.limits import TierLimits
from kvtier.policy.base import AdmissionPolicy, AdmitAll, EvictionPolicy
from kvtier.policy.hints import Hint, HintAware, hint_target
from kvtier.policy.write import WritePolicy
from kvtier.sim.engine import SimCache


@dataclass
class SimTier:
    """One simulated tier: a capacity in pages, an eviction policy, watermarks (fractions
    of the capacity, default 1.0: fill to capacity) and, on a tier below the top, the
    admission policy ``selective`` asks before writing a page down. ``resident`` is
    maintained by the replay; the policy objects are the live ones."""

    name: str
    capacity: int
    policy: EvictionPolicy
    admission: AdmissionPolicy | None = None
    resident: set[PageKey] = field(default_factory=set)
    high_watermark: float = 1.0
    low_watermark: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise KVTierUsageError(f"tier {self.name!r}: capacity must be an int of pages")
        if self.capacity < 0:
            raise KVTierUsageError(
                f"tier {self.name!r}: capacity must be >= 0, got {self.capacity}"
            )
        if self.low_watermark > self.high_watermark:
            raise KVTierUsageError(
                f"tier {self.name!r}: low_watermark {self.low_watermark} is above "
                f"high_watermark {self.high_watermark}"
            )
        try:
            self.limits = TierLimits.of(self.capacity, self.high_watermark, self.low_watermark)
        except KVTierUsageError as exc:
            raise KVTierUsageError(f"tier {self.name!r}: {exc}") from None


def _admission(tiers: Sequence[SimTier], given: AdmissionPolicy | None) -> AdmissionPolicy:
    """The one admission policy of the replay: ``given``, else the one set on a lower tier."""
    if tiers[0].admission is not None:
        raise KVTierUsageError(
            f"tier {tiers[0].name!r}: the top tier takes every page; an admission policy "
            f"applies to the tiers below (what selective writes down)"
        )
    below = {id(t.admission): t.admission for t in tiers[1:] if t.admission is not None}
    if given is not None:
        return given
    if len(below) > 1:
        raise KVTierUsageError(
            "one admission policy decides every write-down (as in the live pipeline); "
            "pass admission= instead of a different one per tier"
        )
    return next(iter(below.values()), None) or AdmitAll()


def _sim_cache(
    tiers: Sequence[SimTier],
    write_policy: str,
    admission: AdmissionPolicy | None,
    batch_pages: int,
) -> SimCache:
    if not tiers:
        raise KVTierUsageError("replay needs at least one tier")
    try:
        wp = WritePolicy.parse(write_policy, "write policy")
    except ConfigError as exc:
        raise KVTierUsageError(f"unknown {exc}") from None
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise KVTierUsageError(f"tier names must be distinct, got {names}")
    return SimCache(
        names,
        [t.policy for t in tiers],
        [t.resident for t in tiers],
        [t.limits for t in tiers],
        wp,
        _admission(tiers, admission),
        batch_pages,
    )


class Replayer:
    """Plays requests one by one through ``tiers`` (top first; their policy objects and
    resident sets are mutated).

    Args:
        tiers: the simulated tiers.
        write_policy: ``write-back``, ``write-through`` or ``selective``.
        admission: the admission policy ``selective`` asks (default: the one set on a
            lower tier, else admit all).
        batch_pages: the most pages per batch, as in the pipeline's configuration.

    Raises :class:`KVTierUsageError` for no tiers, duplicate names, an unknown write
    policy, an admission policy on the top tier or different ones on lower tiers.
    """

    def __init__(
        self,
        tiers: Sequence[SimTier],
        write_policy: WritePolicy | str = "write-back",
        *,
        admission: AdmissionPolicy | None = None,
        batch_pages: int = 32,
    ) -> None:
        self.cache = _sim_cache(tiers, write_policy, admission, batch_pages)
        self.tiers = list(tiers)
        #: Pages a prefetch brought to the top tier, not yet hit nor evicted.
        self.prefetched: set[PageKey] = set()
        #: Prefetched pages: ``issued`` (arrived), ``useful`` (hit before eviction);
        #: ``wasted`` is filled in by :meth:`prefetch_counts`.
        self.pf_counts = {"issued": 0, "useful": 0, "wasted": 0}
        self.aware: list[HintAware] = [a for t in tiers if (a := hint_target(t.policy)) is not None]

    @property
    def parent(self) -> dict[PageKey, PageKey | None]:
        """The parent of every page seen (the page before it in its first request)."""
        return self.cache.parent

    @property
    def moved(self) -> dict[str, int]:
        """Pages moved per link, ``"src->dst"``."""
        return self.cache.moved

    def _settle(self) -> None:
        """Prefetched pages that left the top tier are no longer tracked."""
        left = self.cache.left_top
        if left:
            self.prefetched.difference_update(left)
            left.clear()

    def hint(self, hint: Hint, now_s: float) -> None:
        """Give an engine hint to the hint-aware policies."""
        for a in self.aware:
            a.on_hint(hint, now_s)

    def tick(self, now_s: float) -> None:
        """The clock, for hint-aware policies."""
        for a in self.aware:
            a.on_time(now_s)

    def run_request(self, blocks: Sequence[PageKey]) -> list[int]:
        """One request: its cached prefix is looked up and loaded (pinned meanwhile), the
        rest computed and stored. Returns the prefix hits per tier, top first."""
        self._settle()
        cache = self.cache
        cache.note_parents(blocks)
        where = cache.lookup(blocks)
        hits = [0] * len(self.tiers)
        prefix = blocks[: len(where)]
        prefetched = self.prefetched
        for k, lvl in zip(prefix, where, strict=False):
            hits[lvl] += 1
            if lvl == 0 and k in prefetched:
                prefetched.discard(k)
                self.pf_counts["useful"] += 1
        cache.view.pinned = set(prefix)  # the engine pins what it loads until it is done
        cache.load(prefix)
        cache.store(blocks[len(where) :])
        cache.view.pinned = set()
        return hits

    def prefetch(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """Pull ``keys`` held below into the top tier; returns those that arrived."""
        arrived = self.cache.prefetch(keys)
        self.pf_counts["issued"] += len(arrived)
        self.prefetched.update(arrived)
        return arrived

    def prefetch_counts(self) -> dict[str, int]:
        """Prefetched pages so far: ``issued``, ``useful`` and ``wasted`` (evicted from
        the top tier before a hit)."""
        self._settle()
        pf = self.pf_counts
        pf["wasted"] = pf["issued"] - pf["useful"] - len(self.prefetched)
        return dict(pf)

    def prune(self) -> int:
        """Forget the parents of pages no tier holds (a long-running replay, such as the
        what-if estimator's, would otherwise remember every page it ever saw); a page
        seen again learns its parent from its request. Returns how many were dropped."""
        held = [t.resident for t in self.tiers]
        parent = self.cache.parent
        gone = [k for k in parent if not any(k in r for r in held)]
        for k in gone:
            del parent[k]
        return len(gone)
