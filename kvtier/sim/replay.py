"""Trace replay through kvtier's real policy objects and the live pipeline's planner.

:func:`replay` drives a stack of simulated tiers (top first) with a :class:`Trace`. Each
tier holds a set of resident page keys and the very
:class:`~kvtier.policy.base.EvictionPolicy` object a live tier would use; every decision
(room, victims, where a victim goes, what the write policy copies down, where a fetch
reads from) comes from the same :class:`~kvtier.plan.planner.Planner` the live pipeline
asks, through :class:`~kvtier.sim.engine.SimCache`. Only bytes are missing: a replay
predicts, request by request, what a live cache does when it runs the requests one after
the other (``tests/test_sim_live.py`` checks it for every policy).

One request is what an inference engine does with the cache:

1. *Lookup*: the request's blocks are looked up in order; each block found in some tier is
   a hit of the highest tier holding it, and the run stops at the first block held
   nowhere (the *prefix hit*; later blocks are recomputed even if resident somewhere).
2. *Load* (the prefix, pinned): lower-tier hits are fetched into the top tier, which
   makes room first: victims go down to the next tier (or are dropped, or just freed when
   a lower tier holds them) as the write policy says.
3. *Store*: the blocks past the prefix are computed and stored in the top tier (those
   still resident there are only accessed), then copied down as the write policy says:

   * ``write-back``: pages go down only when evicted;
   * ``write-through``: every stored page is copied to the next tier, and from there on;
   * ``selective``: like write-through, for the pages the admission policy admits (a
     victim not admitted is dropped instead of written down).

Tiers keep between their watermarks (default 1.0: a tier fills to its capacity): room
for a batch evicts down to the low watermark when the batch would cross the high one.
The admission policy (``admission``, or the one set on a lower tier) sees every
reference. Room that cannot be made (the request's pinned prefix fills the tier) drops
the batch.

Engine hints carried by the trace (:class:`~kvtier.sim.trace.TraceHint`) reach
hint-aware policies with ``hints=True``, each before the request it precedes, and such
policies are told the trace's time before every request. One request at a time is
:class:`~kvtier.sim.replayer.Replayer`, which the what-if estimator drives too.

Capacities are in pages; all blocks are the same size. Results count hits per tier, the
prefix hit rate, pages moved per link, and per-request arrays the cost model needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.write import WRITE_POLICIES, WritePolicy
from kvtier.sim.replayer import Replayer, SimTier
from kvtier.sim.trace import Trace

__all__ = [
    "WRITE_POLICIES",
    "PagePredictor",
    "ReplayResult",
    "Replayer",
    "SimTier",
    "WritePolicy",
    "make_tiers",
    "replay",
]

#: Hook called after every request with the number of requests done (progress bars).
ProgressHook = Callable[[int], None]


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


def replay(
    trace: Trace,
    tiers: Sequence[SimTier],
    write_policy: WritePolicy | str = "write-back",
    predictor: PagePredictor | None = None,
    progress: ProgressHook | None = None,
    progress_every: int = 1000,
    *,
    admission: AdmissionPolicy | None = None,
    batch_pages: int = 32,
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
    ``admission`` is the admission policy ``selective`` asks (default: the one set on a
    lower tier, else admit all); ``batch_pages`` the most pages per batch, as in the
    pipeline's configuration.

    Raises :class:`KVTierUsageError` for no tiers, duplicate names, an unknown write
    policy, an admission policy on the top tier or different ones on lower tiers.
    """
    r = Replayer(tiers, write_policy, admission=admission, batch_pages=batch_pages)
    n_req = len(trace.requests)
    req_hits = np.zeros((n_req, len(tiers)), dtype=np.int32)
    req_blocks = np.zeros(n_req, dtype=np.int32)
    req_in = np.zeros(n_req, dtype=np.int64)
    req_out = np.zeros(n_req, dtype=np.int64)
    req_t = np.zeros(n_req, dtype=np.float64)
    refs = 0
    trace_hints = trace.hints if hints and r.aware else []
    next_hint = 0
    for i, req in enumerate(trace.requests):
        while next_hint < len(trace_hints) and trace_hints[next_hint].before <= i:
            th = trace_hints[next_hint]
            next_hint += 1
            r.hint(th.hint, th.timestamp_s)
        r.tick(req.timestamp_s)
        req_hits[i] = r.run_request(req.blocks)
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
        prefetch=r.prefetch_counts() if predictor is not None else {},
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
