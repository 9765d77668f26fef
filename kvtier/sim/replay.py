"""Trace replay through kvtier's real policy objects.

:func:`replay` drives a stack of simulated tiers (top first) with a :class:`Trace`. Each
tier holds a set of resident page keys and the very :class:`~kvtier.policy.base.
EvictionPolicy` (and optional :class:`~kvtier.policy.base.AdmissionPolicy`) object a live
tier would use, receiving the same calls in the same order as the live pipeline makes
them: a lookup, then a load that touches hits and pulls lower-tier hits up, then a store
of the computed pages that first asks for victims to make room. Only bytes are missing.

Semantics of one request (its pages are pinned while it runs, as attention pins them):

1. *Lookup*: the request's blocks are looked up in order; each block found in some tier is
   a hit of the highest tier holding it, and the run stops at the first block held
   nowhere (the *prefix hit*; later blocks are recomputed even if resident somewhere).
2. *Load*: top-tier hits are accessed; lower-tier hits are accessed in their tier and
   inserted into the top tier (a fetch over the link ``lower->top``).
3. *Store*: missed blocks are computed on the top tier and inserted there.
4. Inserting into a full tier first evicts the policy's victims (never pinned pages).
   What happens to a victim depends on the write policy:

   * ``write-back``: a victim goes down to the next tier (if not there already);
   * ``write-through``: every page inserted into a tier is also written to the next one,
     so victims are dropped (their copy below exists unless the tier below evicted it);
   * ``selective``: like write-through, but only pages the *next* tier's admission policy
     admits go down at insert time; a victim not below is written down if admitted now.

An admission policy on a tier sees every reference (``on_access``; predictors that
define ``note_parent(key, parent)`` also learn each page's parent) and may refuse a page:
it is then not retained there (for the top tier: used by the running request, then
dropped). A tier that cannot find enough
evictable victims keeps the pages it can and drops the rest (deepest first).

Capacities are in pages; all blocks are the same size. Results count hits per tier, the
prefix hit rate, pages moved per link, and per-request arrays the cost model needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.hints import HintAware, hint_target
from kvtier.sim.trace import Trace

WritePolicy = Literal["write-through", "write-back", "selective"]
WRITE_POLICIES: tuple[str, ...] = ("write-through", "write-back", "selective")

#: Hook called after every request with the number of requests done (progress bars).
ProgressHook = Callable[[int], None]


@dataclass
class SimTier:
    """One simulated tier: a capacity in pages, an eviction policy and an optional
    admission policy. ``resident`` is maintained by the replay; the policy objects are
    the live ones."""

    name: str
    capacity: int
    policy: EvictionPolicy
    admission: AdmissionPolicy | None = None
    resident: set[PageKey] = field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise KVTierUsageError(f"tier {self.name!r}: capacity must be an int of pages")
        if self.capacity < 0:
            raise KVTierUsageError(
                f"tier {self.name!r}: capacity must be >= 0, got {self.capacity}"
            )


@dataclass
class ReplayResult:
    """What a replay measured.

    Attributes:
        tiers: tier names, top first.
        capacities: pages per tier.
        refs: block references replayed.
        requests: requests replayed.
        prefix_hits: prefix hits per tier (a hit belongs to the highest tier holding it).
        pages_moved: pages per link, ``"src->dst"`` (``"compute->top"`` for computed
            pages; ``"top->below"`` writes; ``"below->top"`` fetches).
        req_hits: per request and tier, the prefix hits served by that tier
            (``int32[requests, tiers]``).
        req_blocks: per request, its block count.
        req_input_tokens / req_output_tokens / req_arrival_s: per request, from the trace.
        prefetch: counters of the prefetcher when one ran (issued, useful, wasted pages).
    """

    tiers: list[str]
    capacities: list[int]
    refs: int
    requests: int
    prefix_hits: dict[str, int]
    pages_moved: dict[str, int]
    req_hits: np.ndarray
    req_blocks: np.ndarray
    req_input_tokens: np.ndarray
    req_output_tokens: np.ndarray
    req_arrival_s: np.ndarray
    block_tokens: int
    prefetch: dict[str, int] = field(default_factory=dict)

    @property
    def total_prefix_hits(self) -> int:
        """Prefix hits over all tiers."""
        return sum(self.prefix_hits.values())

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix hits over references."""
        return self.total_prefix_hits / self.refs if self.refs else 0.0

    def tier_hit_rates(self) -> dict[str, float]:
        """Prefix hit rate per tier."""
        return {t: (h / self.refs if self.refs else 0.0) for t, h in self.prefix_hits.items()}


class PagePredictor(Protocol):
    """What the replay needs of a prefetch predictor (see :mod:`kvtier.policy.prefetch`)."""

    def observe(self, blocks: Sequence[PageKey]) -> None:
        """A request used ``blocks`` (in order)."""

    def predict(self, blocks: Sequence[PageKey]) -> list[PageKey]:
        """Pages worth pulling up now, after a request used ``blocks``; best first."""


class Replayer:
    """The request-by-request engine behind :func:`replay` (also driven directly by the
    what-if estimator, :mod:`kvtier.sim.whatif`): :meth:`run_request` plays one request
    through the tiers and returns its prefix hits per tier."""

    def __init__(self, tiers: Sequence[SimTier], write_policy: str) -> None:
        if not tiers:
            raise KVTierUsageError("replay needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise KVTierUsageError(
                f"unknown write policy {write_policy!r}; known: {', '.join(WRITE_POLICIES)}"
            )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KVTierUsageError(f"tier names must be distinct, got {names}")
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.parent: dict[PageKey, PageKey | None] = {}
        self.pinned: set[PageKey] = set()
        self.moved: dict[str, int] = {}
        self.prefetched: set[PageKey] = set()
        self.pf_counts = {"issued": 0, "useful": 0, "wasted": 0}

    def _evictable(self, key: PageKey) -> bool:
        return key not in self.pinned

    def prune(self) -> int:
        """Forget the parents of pages no tier holds (a long-running replay, such as the
        what-if estimator's, would otherwise remember every page it ever saw); a page
        seen again learns its parent from its request. Returns how many were dropped."""
        held = [t.resident for t in self.tiers]
        gone = [k for k in self.parent if not any(k in r for r in held)]
        for k in gone:
            del self.parent[k]
        return len(gone)

    def _count(self, link: str, n: int) -> None:
        if n:
            self.moved[link] = self.moved.get(link, 0) + n

    def insert(
        self, level: int, keys: list[PageKey], source: str | None, write_new_down: bool = True
    ) -> list[PageKey]:
        """Insert ``keys`` (not resident there) into tier ``level``; returns those kept.

        ``source`` names the link counted (``None``: counted by the caller). With
        ``write_new_down`` false (pages fetched from below), only victims may go down."""
        tier = self.tiers[level]
        adm = tier.admission
        if adm is not None:
            keys = [k for k in keys if adm.admit(k)]
        if not keys:
            return keys
        resident = tier.resident
        need = len(resident) + len(keys) - tier.capacity
        victims: list[PageKey] = []
        if need > 0:
            for v in tier.policy.victims(need, self._evictable):
                if v in resident:
                    resident.discard(v)
                    tier.policy.on_remove(v)
                    victims.append(v)
                    if level == 0:
                        self.prefetched.discard(v)
        room = tier.capacity - len(resident)
        if room < len(keys):
            keys = keys[: max(room, 0)]
        parent = self.parent
        policy = tier.policy
        for k in keys:
            resident.add(k)
            policy.on_insert(k, parent.get(k))
        if source is not None:
            self._count(f"{source}->{tier.name}", len(keys))
        below = level + 1
        if below < len(self.tiers):
            lower = self.tiers[below].resident
            new = [k for k in keys if k not in lower] if write_new_down else []
            if self.write_policy == "write-back":
                down = [v for v in victims if v not in lower]
            elif self.write_policy == "write-through":
                down = new
            else:  # selective: the lower tier's admission filters in insert()
                down = new + [v for v in victims if v not in lower]
            if down:
                self.insert(below, down, tier.name)
        return keys

    def run_request(self, blocks: Sequence[PageKey]) -> list[int]:
        tiers = self.tiers
        n_tiers = len(tiers)
        parent = self.parent
        prev: PageKey | None = None
        for k in blocks:
            if k not in parent:
                parent[k] = prev
            prev = k
        hits = [0] * n_tiers
        where: list[int] = []
        for k in blocks:
            for lvl in range(n_tiers):
                if k in tiers[lvl].resident:
                    hits[lvl] += 1
                    where.append(lvl)
                    break
            else:
                break
        for t in tiers:
            if t.admission is not None:
                note_parent = getattr(t.admission, "note_parent", None)
                for k in blocks:
                    t.admission.on_access(k)
                    if note_parent is not None:  # sequence-aware predictors
                        note_parent(k, parent.get(k))
        self.pinned = set(blocks)
        top = tiers[0]
        fetch: list[PageKey] = []
        fetch_src: list[int] = []
        computed: list[PageKey] = []
        prefix = len(where)
        for i, k in enumerate(blocks):
            if i < prefix:
                lvl = where[i]
                tiers[lvl].policy.on_access(k)
                if lvl:
                    fetch.append(k)
                    fetch_src.append(lvl)
                elif k in self.prefetched:
                    self.prefetched.discard(k)
                    self.pf_counts["useful"] += 1
            elif k in top.resident:
                top.policy.on_access(k)
            else:
                computed.append(k)
        for lvl in range(1, n_tiers):
            n = fetch_src.count(lvl)
            self._count(f"{tiers[lvl].name}->{top.name}", n)
        # Fetched pages enter the top tier without a write-down (their copy is below).
        if fetch:
            self.insert(0, fetch, None, write_new_down=False)
        if computed:
            self.insert(0, computed, "compute")
        self.pinned = set()
        return hits

    def prefetch(self, keys: Sequence[PageKey]) -> None:
        """Pull ``keys`` resident below into the top tier (a prefetch)."""
        top = self.tiers[0]
        want = [k for k in keys if k not in top.resident and k not in self.pinned]
        found = [k for k in want if any(k in t.resident for t in self.tiers[1:])]
        if not found:
            return
        self.pf_counts["issued"] += len(found)
        arrived = self.insert(0, found, None, write_new_down=False)
        self.prefetched.update(arrived)
        self._count(f"prefetch->{top.name}", len(arrived))


def replay(
    trace: Trace,
    tiers: Sequence[SimTier],
    write_policy: WritePolicy = "write-back",
    predictor: PagePredictor | None = None,
    progress: ProgressHook | None = None,
    progress_every: int = 1000,
    hints: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through ``tiers`` (top first) and return what was measured.

    Policies that take hints (:class:`~kvtier.policy.hints.HintAware`, possibly inside a
    wrapper) are told the trace's time before each request (``on_time``) and, with
    ``hints``, the trace's hints in order, each before the request it precedes.

    The tiers' policy objects and resident sets are mutated (pass fresh ones per run).
    ``predictor``, if given, is told every request's blocks after it ran and its
    predictions are prefetched from lower tiers into the top tier before the next request
    (pages it predicts that sit nowhere cannot be prefetched and are ignored).
    Raises :class:`KVTierUsageError` for no tiers, duplicate names or an unknown write
    policy.
    """
    r = Replayer(tiers, write_policy)
    n_req = len(trace.requests)
    req_hits = np.zeros((n_req, len(tiers)), dtype=np.int32)
    req_blocks = np.zeros(n_req, dtype=np.int32)
    req_in = np.zeros(n_req, dtype=np.int64)
    req_out = np.zeros(n_req, dtype=np.int64)
    req_t = np.zeros(n_req, dtype=np.float64)
    refs = 0
    aware: list[HintAware] = [a for t in tiers if (a := hint_target(t.policy)) is not None]
    trace_hints = trace.hints if hints and aware else []
    next_hint = 0
    for i, req in enumerate(trace.requests):
        while next_hint < len(trace_hints) and trace_hints[next_hint].before <= i:
            th = trace_hints[next_hint]
            next_hint += 1
            for a in aware:
                a.on_hint(th.hint, th.timestamp_s)
        for a in aware:
            a.on_time(req.timestamp_s)
        hits = r.run_request(req.blocks)
        req_hits[i] = hits
        req_blocks[i] = len(req.blocks)
        req_in[i] = req.input_tokens
        req_out[i] = req.output_tokens
        req_t[i] = req.timestamp_s
        refs += len(req.blocks)
        if predictor is not None:
            predictor.observe(req.blocks)
            r.prefetch(predictor.predict(req.blocks))
        if progress is not None and (i + 1) % progress_every == 0:
            progress(progress_every)
    if progress is not None and n_req % progress_every:
        progress(n_req % progress_every)
    r.pf_counts["wasted"] = r.pf_counts["issued"] - r.pf_counts["useful"] - len(r.prefetched)
    per_tier = req_hits.sum(axis=0)
    return ReplayResult(
        tiers=[t.name for t in tiers],
        capacities=[t.capacity for t in tiers],
        refs=refs,
        requests=n_req,
        prefix_hits={t.name: int(per_tier[j]) for j, t in enumerate(tiers)},
        pages_moved=dict(r.moved),
        req_hits=req_hits,
        req_blocks=req_blocks,
        req_input_tokens=req_in,
        req_output_tokens=req_out,
        req_arrival_s=req_t,
        block_tokens=trace.block_tokens,
        prefetch=dict(r.pf_counts) if predictor is not None else {},
    )


def make_tiers(
    capacities: Sequence[int],
    policy: Callable[[], EvictionPolicy],
    names: Sequence[str] | None = None,
    admission: Mapping[int, AdmissionPolicy] | None = None,
) -> list[SimTier]:
    """Fresh tiers with the given capacities, each with its own ``policy()`` object.
    Default names: ``dram``, ``nvme``, ``remote`` (a CPU-only hierarchy)."""
    default = ["dram", "nvme", "remote", "l4", "l5", "l6"]
    tier_names = list(names) if names is not None else default[: len(capacities)]
    if len(tier_names) != len(capacities):
        raise KVTierUsageError(
            f"{len(capacities)} capacities but {len(tier_names)} tier names: {tier_names}"
        )
    adm = admission or {}
    return [
        SimTier(n, int(c), policy(), adm.get(i))
        for i, (n, c) in enumerate(zip(tier_names, capacities, strict=True))
    ]
