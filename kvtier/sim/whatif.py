"""What-if sizing: the hit rate each tier would give at other capacities, while it runs.

For every tier ``i`` and every capacity factor ``f`` (by default -50, -25, +25, +50 and
+100 %, plus the current size), a *miniature hierarchy* replays the requests the cache
sees: tiers ``0..i`` with tier ``i`` at ``f`` times its capacity, the same eviction and
admission policies (fresh objects of the configured kinds) and the same write policy,
driven by :class:`kvtier.sim.replayer.Replayer` (the live planner's decisions), the engine
of ``kvtier bench sim``. So at sampling rate 1 an estimate *is* a replay at that capacity.

To stay cheap, each tier's miniatures see a spatial sample of the pages (SHARDS,
Waldspurger et al., FAST'15): a page is kept when a hash of its key falls below
``rate``, and every capacity of the miniature is scaled by ``rate``. ``rate`` is the
largest power of 1/2 that keeps the biggest miniature of a tier under ``2 x mini_pages``
pages (1 for small tiers). A request keeps its sampled pages in order, so prefix hits are
counted on them as a replay counts them.

The estimate for tier ``i`` is the share of looked-up pages found in tiers ``0..i``
(cumulative: the top tier alone for the first tier, the top two for the second...), the
same quantity as a replay's hit rate over those tiers, with SHARDS' adjustment for the
difference between the references sampled and the references expected (a few very
popular pages, such as a system prompt every request starts with, would otherwise weigh
on the estimate by the luck of their hash). Counts are cumulative since the estimator
started (:meth:`WhatIf.reset` starts over).

A request is one :meth:`WhatIf.on_request` call with its page keys in order (the live
cache feeds every ``lookup``); :meth:`WhatIf.on_hint` and :meth:`WhatIf.on_time` reach
hint-aware policies of the miniatures as in a replay.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy
from kvtier.policy.hints import Hint, HintAware, hint_target, sub_hint
from kvtier.policy.shadow import key_hash
from kvtier.policy.write import WRITE_POLICIES
from kvtier.sim.replayer import Replayer, SimTier

#: Capacity factors reported besides the current size: -50, -25, +25, +50, +100 %.
FACTORS: tuple[float, ...] = (0.5, 0.75, 1.25, 1.5, 2.0)

_FULL = 1 << 64
#: Hash seed of the what-if sample: not the one policies sample their own miniatures
#: with, so a sampled adaptive tier's own miniatures see an independent sample.
SAMPLE_SEED = 0x5748_4946


#: The largest capacity factor an estimate may be asked for (x1000: beyond it the sample
#: of a tier would be too thin to hold a page).
MAX_FACTOR = 1000.0


def factor_label(f: float) -> str:
    """``0.75`` -> ``"-25%"``, ``2.0`` -> ``"+100%"``, ``1.0`` -> ``"+0%"``."""
    pct = round((f - 1.0) * 100)
    return f"{'+' if pct >= 0 else '-'}{abs(pct)}%"


def check_factors(factors: object) -> list[float]:
    """The capacity factors to estimate, sorted, with the current size (1.0) added.
    Raises :class:`KVTierUsageError` naming the problem for a value that is not a
    sequence of real numbers, a factor that is not finite, not > 0 or above
    :data:`MAX_FACTOR`, or two factors with the same label (``1.004`` is ``"+0%"``, the
    current size: its estimate would replace another's)."""
    if isinstance(factors, str | bytes) or not isinstance(factors, Sequence | set | frozenset):
        raise KVTierUsageError(
            f"what-if: capacity factors must be a list of numbers, got {factors!r}"
        )
    out: dict[str, float] = {"+0%": 1.0}
    for f in factors:
        if isinstance(f, bool | np.bool_) or not isinstance(f, numbers.Real):
            raise KVTierUsageError(f"what-if: capacity factors must be numbers, got {f!r}")
        value = float(f)
        if not (math.isfinite(value) and 0.0 < value <= MAX_FACTOR):
            raise KVTierUsageError(
                f"what-if: capacity factors must be finite, > 0 and <= {MAX_FACTOR:g}, got {f!r}"
            )
        label = factor_label(value)
        if label in out and out[label] != value:
            other = "the current size" if out[label] == 1.0 else repr(out[label])
            raise KVTierUsageError(
                f"what-if: capacity factor {f!r} has the label {label!r} of {other}: "
                "give factors that differ by at least 1 %"
            )
        out[label] = value
    return sorted(out.values())


@dataclass(frozen=True)
class TierModel:
    """What the estimator needs of one tier: its name, capacity in pages, and factories
    of fresh eviction (and, below the top with the selective write policy, admission)
    policy objects of the configured kinds, and its watermarks (fractions of the
    capacity: a live tier that passes the high one evicts down to the low one, so it holds
    less than its capacity on average, which the miniatures model). As in the live
    pipeline, one admission policy decides every write-down of a hierarchy: the first
    lower tier's factory."""

    name: str
    capacity: int
    policy: Callable[[], EvictionPolicy]
    admission: Callable[[], AdmissionPolicy] | None = None
    high_watermark: float = 1.0
    low_watermark: float = 1.0


class _Group:
    """The miniatures of one tier: one hierarchy per factor, sharing a sample."""

    def __init__(
        self,
        tiers: Sequence[TierModel],
        write_policy: str,
        factors: Sequence[float],
        mini_pages: int,
    ) -> None:
        self.name = tiers[-1].name
        biggest = sum(t.capacity for t in tiers[:-1]) + max(factors) * tiers[-1].capacity
        rate = 1.0
        while rate * biggest > 2 * mini_pages:
            rate /= 2
        self.rate = rate
        self.threshold = _FULL if rate >= 1.0 else int(_FULL * rate)
        self.factors = list(factors)
        self.capacity = tiers[-1].capacity
        self.replayers: list[Replayer] = []
        admission = next((t.admission for t in tiers[1:] if t.admission is not None), None)
        for f in self.factors:
            sims = []
            for j, t in enumerate(tiers):
                cap = t.capacity * (f if j == len(tiers) - 1 else 1.0) * rate
                sims.append(
                    SimTier(
                        t.name,
                        max(round(cap), 1),
                        t.policy(),
                        high_watermark=t.high_watermark,
                        low_watermark=t.low_watermark,
                    )
                )
            adm = admission() if admission is not None else None
            self.replayers.append(Replayer(sims, write_policy, admission=adm))
        self.hits = [0] * len(self.factors)
        self.refs = 0
        self.all_refs = 0  # every reference, sampled or not
        self.requests = 0
        self._targets: list[HintAware] | None = None

    def keeps(self, h: int) -> bool:
        return h < self.threshold

    def hit_rate(self, i: int) -> float | None:
        """Factor ``i``'s estimate with SHARDS' adjustment: the sample holds ``refs``
        references where ``rate x all_refs`` were expected; the difference is mostly
        the few very popular pages (a system prompt), which hit at any size, so it is
        counted as hits (or taken away from them) before dividing."""
        expected = self.rate * self.all_refs
        if expected <= 0 or self.refs == 0:
            return None  # nothing sampled yet: no estimate (the adjustment alone gives 1)
        adjusted = self.hits[i] + (expected - self.refs)
        return min(max(adjusted / expected, 0.0), 1.0)

    def request(self, keys: Sequence[PageKey]) -> None:
        self.refs += len(keys)
        self.requests += 1
        depth = len(self.replayers[0].tiers)
        for i, r in enumerate(self.replayers):
            self.hits[i] += sum(r.run_request(keys)[:depth])
        if self.requests % 1024 == 0:
            limit = 4 * sum(t.capacity for t in self.replayers[-1].tiers)
            for r in self.replayers:
                if len(r.parent) > limit:
                    r.prune()

    def policies(self) -> list[EvictionPolicy]:
        return [t.policy for r in self.replayers for t in r.tiers]

    def hint_targets(self) -> list[HintAware]:
        """The hint-aware policies of the miniatures (found once: a tier's policy object
        stays the same for the group's life)."""
        if self._targets is None:
            found = (hint_target(p) for p in self.policies())
            self._targets = [t for t in found if t is not None]
        return self._targets


class WhatIf:
    """Estimates each tier's hit rate at other capacities from the requests it is fed.

    Args:
        tiers: the cache's tiers, top first.
        write_policy: the cache's write policy (``write-back``, ``write-through`` or
            ``selective``).
        factors: capacity factors to estimate (the current size, 1.0, is always added).
        mini_pages: the size a tier's biggest miniature is kept under (x2); smaller is
            cheaper and noisier.

    Raises :class:`KVTierUsageError` for no tiers, a bad factor, capacity or write
    policy.
    """

    def __init__(
        self,
        tiers: Sequence[TierModel],
        write_policy: str = "write-back",
        factors: Sequence[float] = FACTORS,
        mini_pages: int = 4096,
    ) -> None:
        if not tiers:
            raise KVTierUsageError("what-if: no tiers")
        if write_policy not in WRITE_POLICIES:
            raise KVTierUsageError(
                f"what-if: unknown write policy {write_policy!r}; known: {WRITE_POLICIES}"
            )
        checked = check_factors(factors)
        for t in tiers:
            if isinstance(t.capacity, bool) or not isinstance(t.capacity, int) or t.capacity < 1:
                raise KVTierUsageError(
                    f"what-if: tier {t.name!r} needs a capacity >= 1 page, got {t.capacity!r}"
                )
        if (
            isinstance(mini_pages, bool | np.bool_)
            or not isinstance(mini_pages, numbers.Integral)
            or mini_pages < 16
        ):
            raise KVTierUsageError(f"what-if: mini_pages must be an int >= 16, got {mini_pages!r}")
        self.tiers: list[TierModel] = list(tiers)
        self.write_policy: str = write_policy
        self.factors: list[float] = checked
        self.mini_pages: int = int(mini_pages)
        self.reset()

    def reset(self) -> None:
        """Start over: fresh miniatures, zero counts."""
        self.groups = [
            _Group(self.tiers[: i + 1], self.write_policy, self.factors, self.mini_pages)
            for i in range(len(self.tiers))
        ]
        self.requests = 0

    def on_request(self, keys: Sequence[PageKey]) -> None:
        """One request (a lookup) of ``keys`` in order."""
        self.requests += 1
        if not keys:
            return
        hashes = [key_hash(k, SAMPLE_SEED) for k in keys]
        for g in self.groups:
            g.all_refs += len(keys)
            cut = g.threshold  # g.keeps(h), inlined
            sampled = [k for k, h in zip(keys, hashes, strict=True) if h < cut]
            if sampled:
                g.request(sampled)

    def on_time(self, now_s: float) -> None:
        """The clock, for hint-aware policies."""
        for g in self.groups:
            for target in g.hint_targets():
                target.on_time(now_s)

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """An engine hint: given, for the sampled pages, to hint-aware policies."""
        hashes = [key_hash(k, SAMPLE_SEED) for k in hint.keys]
        for g in self.groups:
            cut = g.threshold  # g.keeps(h), inlined
            keys = tuple(k for k, h in zip(hint.keys, hashes, strict=True) if h < cut)
            if hint.keys and not keys:
                continue
            sampled = sub_hint(hint, keys)
            for target in g.hint_targets():
                target.on_hint(sampled, now_s)

    def estimates(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``capacity_pages``, ``sample_rate``, ``sampled_refs`` and
        ``hit_rate`` by factor label (``"-50%"`` ... ``"+100%"``, ``"+0%"`` for the
        current size): the estimated share of looked-up pages found at or above it,
        ``None`` until a page of the tier's sample was looked up."""
        out: dict[str, dict[str, Any]] = {}
        for g in self.groups:
            out[g.name] = {
                "capacity_pages": g.capacity,
                "sample_rate": g.rate,
                "sampled_refs": g.refs,
                "hit_rate": {factor_label(f): g.hit_rate(i) for i, f in enumerate(g.factors)},
            }
        return out
