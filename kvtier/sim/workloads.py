"""Synthetic named workloads for cases public traces lack.

Each generator returns a :class:`~kvtier.sim.trace.Trace` whose block ids follow the
prefix rule of real traces (a block id names the block and everything before it), built
with a seeded generator so runs repeat. Arrivals are Poisson at ``rate`` requests/s, or
taken from an arrival list (e.g. :func:`~kvtier.sim.trace.read_azure_arrivals`).

* ``chat``: multi-turn conversations sharing a few system prompts; sessions continue with
  probability growing with their turn count, after exponential think times.
* ``docqa``: long-document QA: Zipf-popular documents, each asked several short questions.
* ``agent``: agentic tool loops: a long tool preamble, then a session appending a tool
  result per step, many steps in quick succession.
* ``zipf``: independent requests whose prefixes are drawn from a Zipfian pool.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence

from kvtier.errors import KVTierUsageError
from kvtier.sim.trace import Arrival, Request, Trace, block_key


class _Ids:
    """Fresh block ids for new content (one per distinct prefix block)."""

    def __init__(self) -> None:
        self._next = itertools.count()
        self._known: dict[tuple[int, ...], int] = {}

    def chain(self, prefix_ids: Sequence[int], new_blocks: int) -> list[int]:
        return list(prefix_ids) + [next(self._next) for _ in range(new_blocks)]

    def shared(self, name: tuple[int, ...]) -> int:
        if name not in self._known:
            self._known[name] = next(self._next)
        return self._known[name]


def _times(
    n: int, rate: float, rng: random.Random, arrivals: Sequence[Arrival] | None
) -> list[float]:
    if arrivals:
        return [a.timestamp_s for a in arrivals[:n]]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _trace(name: str, bt: int, rows: list[tuple[float, list[int], int]]) -> Trace:
    rows.sort(key=lambda r: r[0])
    reqs = [
        Request(t, len(ids) * bt, out, tuple(block_key(b) for b in ids), False)
        for t, ids, out in rows
    ]
    return Trace(name, bt, reqs)


def chat(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Multi-turn chat with shared system prompts (see module doc)."""
    rng = random.Random(seed)
    ids = _Ids()
    starts = _times(n, rate, rng, arrivals)
    systems = [[ids.shared((1, s, i)) for i in range(2)] for s in range(4)]
    events: list[tuple[float, int, list[int], int]] = []
    for t in starts:
        heapq.heappush(events, (t, 0, ids.chain(rng.choice(systems), rng.randint(1, 6)), 0))
    rows: list[tuple[float, list[int], int]] = []
    while events and len(rows) < n:
        t, turn, ctx, _ = heapq.heappop(events)
        rows.append((t, ctx, rng.randint(50, 600)))
        if rng.random() < min(0.3 + 0.08 * turn, 0.85):
            nxt = ids.chain(ctx, rng.randint(1, 3))
            heapq.heappush(events, (t + rng.expovariate(1 / 90.0), turn + 1, nxt, 0))
    return _trace("chat", block_tokens, rows)


def docqa(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    docs: int = 500,
    doc_blocks: int = 64,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Long-document QA over Zipf-popular documents."""
    rng = random.Random(seed)
    ids = _Ids()
    weights = [1.0 / (i + 1) for i in range(docs)]
    bodies = [[ids.shared((2, d, i)) for i in range(doc_blocks)] for d in range(docs)]
    rows = []
    for t in _times(n, rate, rng, arrivals):
        d = rng.choices(range(docs), weights)[0]
        rows.append((t, ids.chain(bodies[d], 1), rng.randint(20, 300)))
    return _trace("docqa", block_tokens, rows)


def agent(
    n: int = 5000,
    rate: float = 8.0,
    seed: int = 0,
    block_tokens: int = 512,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Agentic tool loops: many quick steps, each appending one tool result."""
    rng = random.Random(seed)
    ids = _Ids()
    preamble = [ids.shared((3, i)) for i in range(8)]
    rows: list[tuple[float, list[int], int]] = []
    for t in _times(max(n // 10, 1), rate / 10, rng, arrivals):
        ctx = ids.chain(preamble, 1)
        for _step in range(rng.randint(3, 20)):
            rows.append((t, ctx, rng.randint(20, 200)))
            t += rng.uniform(1.0, 8.0)
            ctx = ids.chain(ctx, 1)
    return _trace("agent", block_tokens, rows[:n] if len(rows) > n else rows)


def zipf(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    prefixes: int = 2000,
    alpha: float = 1.0,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Independent requests over a Zipf(``alpha``) pool of prefixes."""
    rng = random.Random(seed)
    ids = _Ids()
    weights = [1.0 / (i + 1) ** alpha for i in range(prefixes)]
    pool = [[ids.shared((4, p, i)) for i in range(1 + p % 8)] for p in range(prefixes)]
    rows = []
    for t in _times(n, rate, rng, arrivals):
        p = rng.choices(range(prefixes), weights)[0]
        rows.append((t, ids.chain(pool[p], rng.randint(1, 4)), rng.randint(20, 400)))
    return _trace("zipf", block_tokens, rows)


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "chat": chat,
    "docqa": docqa,
    "agent": agent,
    "zipf": zipf,
}


def workload(name: str, **params: object) -> Trace:
    """Generate the named workload; :class:`KVTierUsageError` listing names otherwise."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise KVTierUsageError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return gen(**params)
