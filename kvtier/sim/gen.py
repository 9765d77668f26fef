"""Building blocks of the synthetic workload generators.

* :class:`Ids` hands out block ids that follow the prefix rule of real traces (an id
  names a block and everything before it): :meth:`Ids.chain` extends a context with new
  blocks, :meth:`Ids.shared` names a block shared by every request that uses it and
  :meth:`Ids.shared_chain` extends a context with a run of such blocks.
* :func:`poisson_times` draws arrival times (or takes them from an arrival list);
  :func:`zipf_weights` gives skewed popularity.
* :class:`TraceBuilder` collects requests and engine hints in any order and builds a
  time-ordered :class:`~kvtier.sim.trace.Trace`, placing each hint before the first
  request that arrives after it.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence

from kvtier.policy.hints import make_hint
from kvtier.sim.trace import Arrival, Request, Trace, TraceHint, block_key


class Ids:
    """Fresh block ids for new content (one per distinct prefix block)."""

    def __init__(self) -> None:
        self._next = itertools.count()
        self._known: dict[tuple[int, ...], int] = {}

    def chain(self, prefix_ids: Sequence[int], new_blocks: int) -> list[int]:
        """``prefix_ids`` followed by ``new_blocks`` fresh ids."""
        return list(prefix_ids) + [next(self._next) for _ in range(new_blocks)]

    def shared(self, name: tuple[int, ...]) -> int:
        """The id of the shared block ``name`` (the same id every time)."""
        if name not in self._known:
            self._known[name] = next(self._next)
        return self._known[name]

    def shared_chain(
        self, prefix_ids: Sequence[int], name: tuple[int, ...], blocks: int
    ) -> list[int]:
        """``prefix_ids`` followed by ``blocks`` shared blocks named ``(*name, 0)``,
        ``(*name, 1)``...: the same ids every time the same name is asked for."""
        return [*prefix_ids, *(self.shared((*name, j)) for j in range(blocks))]


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Zipf weights of ranks ``1..n`` with exponent ``alpha`` (for ``random.choices``)."""
    return [1.0 / (i + 1) ** alpha for i in range(n)]


def poisson_times(
    n: int, rate: float, rng: random.Random, arrivals: Sequence[Arrival] | None = None
) -> list[float]:
    """``n`` Poisson arrival times at ``rate`` per second, or the first ``n`` of
    ``arrivals``."""
    if arrivals:
        return [a.timestamp_s for a in arrivals[:n]]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


#: Seconds between a request's arrival and the hints given after it.
HINT_DELAY_S = 1e-6


class TraceBuilder:
    """Requests and hints in any order; :meth:`build` sorts them by time."""

    def __init__(self, name: str, block_tokens: int) -> None:
        self.name = name
        self.block_tokens = block_tokens
        self._rows: list[tuple[float, int, list[int], int]] = []
        self._hints: list[tuple[float, int, str, list[int], float | None]] = []
        self._seq = itertools.count()

    def request(self, t: float, ids: Sequence[int], output_tokens: int) -> None:
        """A request arriving at ``t`` whose prompt is the blocks ``ids``."""
        self._rows.append((t, next(self._seq), list(ids), output_tokens))

    def hint(self, t: float, kind: str, ids: Sequence[int], value: float | None = None) -> None:
        """A hint given at ``t`` about the blocks ``ids`` (see
        :mod:`kvtier.policy.hints`)."""
        self._hints.append((t, next(self._seq), kind, list(ids), value))

    def __len__(self) -> int:
        return len(self._rows)

    def build(self, limit: int | None = None) -> Trace:
        """The trace of the first ``limit`` requests by time (all by default) and the
        hints given before the last of them."""
        rows = sorted(self._rows, key=lambda r: (r[0], r[1]))
        if limit is not None:
            rows = rows[:limit]
        bt = self.block_tokens
        keys: dict[int, bytes] = {}

        def key(b: int) -> bytes:
            k = keys.get(b)
            if k is None:
                k = keys[b] = block_key(b)
            return k

        reqs = [
            Request(t, len(ids) * bt, out, tuple(key(b) for b in ids), False)  # type: ignore[misc]
            for t, _, ids, out in rows
        ]
        times = [r.timestamp_s for r in reqs]
        hints: list[TraceHint] = []
        for t, _, kind, ids, value in sorted(self._hints, key=lambda h: (h[0], h[1])):
            before = bisect.bisect_right(times, t)
            if before >= len(reqs):
                continue  # nothing follows it
            hints.append(TraceHint(before, t, make_hint(kind, [key(b) for b in ids], value)))  # type: ignore[misc]
        return Trace(self.name, bt, reqs, hints)
