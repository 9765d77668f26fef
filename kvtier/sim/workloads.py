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

More live in :mod:`kvtier.sim.scenarios` (``toolagent``, ``rag``, ``tenants``, ``bursty``,
``scan``), :mod:`kvtier.sim.shifts` (``shift``, ``drift``) and :mod:`kvtier.sim.mixes`
(``rotation``, ``longchat``, ``templates``, ``sizes``, ``uniform``); all are in
:data:`WORKLOADS`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence

from kvtier.errors import KVTierUsageError
from kvtier.sim import mixes, scenarios, shifts
from kvtier.sim.gen import HINT_DELAY_S, Ids, TraceBuilder, poisson_times, zipf_weights
from kvtier.sim.trace import Arrival, Trace
from kvtier.sim.workload_params import check_params


def chat(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Multi-turn chat with shared system prompts (see module doc). Hints: the system
    prompts are pinned; after each turn, ``next_turn`` (with the true gap) or ``close``."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("chat", block_tokens)
    starts = poisson_times(n, rate, rng, arrivals)
    systems = [[ids.shared((1, s, i)) for i in range(2)] for s in range(4)]
    for sp in systems:
        tb.hint(0.0, "pin", sp)
    events: list[tuple[float, int, list[int], int]] = []
    for t in starts:
        heapq.heappush(events, (t, 0, ids.chain(rng.choice(systems), rng.randint(1, 6)), 0))
    while events and len(tb) < n:
        t, turn, ctx, _ = heapq.heappop(events)
        tb.request(t, ctx, rng.randint(50, 600))
        if rng.random() < min(0.3 + 0.08 * turn, 0.85):
            nxt = ids.chain(ctx, rng.randint(1, 3))
            gap = rng.expovariate(1 / 90.0)
            heapq.heappush(events, (t + gap, turn + 1, nxt, 0))
            tb.hint(t + HINT_DELAY_S, "next_turn", ctx, gap)
        else:
            tb.hint(t + HINT_DELAY_S, "close", ctx[2:])
    return tb.build()


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
    ids = Ids()
    weights = [1.0 / (i + 1) for i in range(docs)]
    bodies = [[ids.shared((2, d, i)) for i in range(doc_blocks)] for d in range(docs)]
    tb = TraceBuilder("docqa", block_tokens)
    for t in poisson_times(n, rate, rng, arrivals):
        d = rng.choices(range(docs), weights)[0]
        tb.request(t, ids.chain(bodies[d], 1), rng.randint(20, 300))
    return tb.build()


def agent(
    n: int = 5000,
    rate: float = 8.0,
    seed: int = 0,
    block_tokens: int = 512,
    arrivals: Sequence[Arrival] | None = None,
) -> Trace:
    """Agentic tool loops: many quick steps, each appending one tool result. Hints: the
    preamble is pinned; ``next_turn`` after each step, ``close`` after the last."""
    rng = random.Random(seed)
    ids = Ids()
    preamble = [ids.shared((3, i)) for i in range(8)]
    rows: list[tuple[float, list[int], int, float | None]] = []
    for t in poisson_times(max(n // 10, 1), rate / 10, rng, arrivals):
        ctx = ids.chain(preamble, 1)
        steps = rng.randint(3, 20)
        for step in range(steps):
            out = rng.randint(20, 200)
            gap = rng.uniform(1.0, 8.0)
            rows.append((t, ctx, out, gap if step < steps - 1 else None))
            t += gap
            ctx = ids.chain(ctx, 1)
    tb = TraceBuilder("agent", block_tokens)
    tb.hint(0.0, "pin", preamble)
    for at, ctx, out, wait in rows[:n]:
        tb.request(at, ctx, out)
        if wait is None:
            tb.hint(at + HINT_DELAY_S, "close", ctx[len(preamble) :])
        else:
            tb.hint(at + HINT_DELAY_S, "next_turn", ctx, wait)
    return tb.build()


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
    ids = Ids()
    weights = zipf_weights(prefixes, alpha)
    pool = [[ids.shared((4, p, i)) for i in range(1 + p % 8)] for p in range(prefixes)]
    tb = TraceBuilder("zipf", block_tokens)
    for t in poisson_times(n, rate, rng, arrivals):
        p = rng.choices(range(prefixes), weights)[0]
        tb.request(t, ids.chain(pool[p], rng.randint(1, 4)), rng.randint(20, 400))
    return tb.build()


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "chat": chat,
    "docqa": docqa,
    "agent": agent,
    "zipf": zipf,
    **scenarios.SCENARIOS,
    **shifts.SHIFTS,
    **mixes.MIXES,
}


#: The most requests a generated workload holds (about 1-3 KB each while it is built).
MAX_GENERATED_REQUESTS = 1_000_000


def workload(name: str, **params: object) -> Trace:
    """Generate the named workload; :class:`KVTierUsageError` listing names otherwise,
    for a parameter the generator does not take or a value its name's rule refuses
    (:mod:`kvtier.sim.workload_params`), or for ``n`` (requests) that is not an integer
    in 1..``MAX_GENERATED_REQUESTS``."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise KVTierUsageError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    check_params(name, gen, params)
    n = params.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GENERATED_REQUESTS:
        raise KVTierUsageError(
            f"workload {name!r}: requests must be an integer from 1 to "
            f"{MAX_GENERATED_REQUESTS:,}, got {n!r}"
        )
    return gen(**params)
