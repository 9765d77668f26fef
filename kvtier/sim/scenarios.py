"""More synthetic workloads: mixes the first four generators lack.

Each generator is seeded and returns a :class:`~kvtier.sim.trace.Trace` whose block ids
follow the prefix rule of real traces, with the engine hints an inference server could
give (see :mod:`kvtier.policy.hints`): pinned shared prompts, ``next_turn`` with the true
gap when a session will continue, ``close`` with the session's own pages when it ends.

* ``toolagent``: tool-agent loops over a few *long* shared tool prompts (16-48 blocks,
  Zipf-popular); each task appends a tool result per step after a tool latency of seconds
  to a minute.
* ``rag``: retrieval-augmented generation over a shared document set: a system prompt,
  then the retrieved chunks in rank order (the top chunk depends mostly on the query's
  topic, Zipf-popular), then the question; some users ask a follow-up.
* ``tenants``: many tenants with Zipf-skewed traffic, each with its own system prompt
  (1-24 blocks) and multi-turn conversations whose think times differ per tenant
  (automated tenants come back in seconds, people in minutes).
* ``bursty``: chat sessions arriving in bursts (on/off arrivals): a burst floods the cache
  with new sessions while older sessions are about to return.
* ``scan``: a reused working set (popular prefixes, multi-turn sessions) mixed with batch
  jobs of long one-hit prompts (summarisation scans) that are never reused.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

from kvtier.sim.gen import HINT_DELAY_S, Ids, TraceBuilder, poisson_times, zipf_weights
from kvtier.sim.trace import Trace

#: A session start: arrival, context, shared prefix length, next gap by turn (or None).
Start = tuple[float, list[int], int, Callable[[int], float | None]]


def run_sessions(
    tb: TraceBuilder,
    rng: random.Random,
    ids: Ids,
    starts: list[Start],
    n: int,
    new_blocks: tuple[int, int],
) -> None:
    """Run multi-turn sessions: each start is ``(time, context, shared_len, next_gap)``
    where ``next_gap(turn)`` is the think time before the next turn, or ``None`` when the
    session ends. Emits the requests and their hints (``next_turn`` / ``close``)."""
    events: list[tuple[float, int, int, list[int], int, Callable[[int], float | None]]] = []
    for i, (t, ctx, shared, gap_fn) in enumerate(starts):
        heapq.heappush(events, (t, i, 0, ctx, shared, gap_fn))
    seq = len(starts)
    while events and len(tb) < n:
        t, _, turn, ctx, shared, gap_fn = heapq.heappop(events)
        tb.request(t, ctx, rng.randint(30, 600))
        gap = gap_fn(turn)
        if gap is None:
            tb.hint(t + HINT_DELAY_S, "close", ctx[shared:])
            continue
        tb.hint(t + HINT_DELAY_S, "next_turn", ctx, gap)
        nxt = ids.chain(ctx, rng.randint(*new_blocks))
        heapq.heappush(events, (t + gap, seq, turn + 1, nxt, shared, gap_fn))
        seq += 1


def toolagent(
    n: int = 5000,
    rate: float = 1.0,
    seed: int = 0,
    block_tokens: int = 512,
    tools: int = 12,
    alpha: float = 1.1,
) -> Trace:
    """Tool-agent loops over long shared tool prompts (see module doc). ``rate`` is new
    tasks per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("toolagent", block_tokens)
    prompts = [[ids.shared((10, p, i)) for i in range(rng.randint(16, 48))] for p in range(tools)]
    for sp in prompts:
        tb.hint(0.0, "pin", sp)
    weights = zipf_weights(tools, alpha)
    starts: list[Start] = []
    for t in poisson_times(max(n // 8, 1), rate, rng):
        prompt = rng.choices(prompts, weights)[0]
        steps = rng.randint(2, 20)
        latency = rng.lognormvariate(math.log(6.0), 1.0)  # this task's tool, seconds

        def gap(turn: int, steps: int = steps, latency: float = latency) -> float | None:
            return None if turn >= steps - 1 else latency * rng.uniform(0.5, 1.5)

        starts.append((t, ids.chain(prompt, rng.randint(1, 3)), len(prompt), gap))
    run_sessions(tb, rng, ids, starts, n, (1, 4))
    return tb.build(n)


def rag(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    docs: int = 3000,
    topics: int = 400,
    alpha: float = 1.0,
    k: int = 3,
) -> Trace:
    """RAG over a shared document set (see module doc)."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("rag", block_tokens)
    system = [ids.shared((20, i)) for i in range(2)]
    tb.hint(0.0, "pin", system)
    chunk_len = [rng.randint(2, 6) for _ in range(docs)]
    # A topic's usual ranking of documents (its relevant set).
    ranked = [rng.sample(range(docs), 2 * k) for _ in range(topics)]
    weights = zipf_weights(topics, alpha)
    starts: list[Start] = []
    for t in poisson_times(n, rate, rng):
        topic = rng.choices(range(topics), weights)[0]
        order = list(ranked[topic])
        if rng.random() < 0.3:  # a differently worded query: the ranking shifts
            rng.shuffle(order)
        picked = order[:k] if rng.random() < 0.8 else rng.sample(range(docs), k)
        ctx = list(system)
        for d in picked:  # a chunk's block ids name everything before them too
            after = ctx[-1]
            ctx = ids.shared_chain(ctx, (21, after, d), chunk_len[d])
        follow = rng.random() < 0.25

        def gap(turn: int, follow: bool = follow) -> float | None:
            return rng.uniform(10.0, 120.0) if follow and turn == 0 else None

        starts.append((t, ids.chain(ctx, 1), len(system), gap))
    run_sessions(tb, rng, ids, starts, n, (1, 2))
    return tb.build(n)


def tenants(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    count: int = 300,
    alpha: float = 1.2,
) -> Trace:
    """Many tenants with skewed popularity, each with its own system prompt and think
    times (see module doc)."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("tenants", block_tokens)
    prompts = [[ids.shared((30, c, i)) for i in range(rng.randint(1, 24))] for c in range(count)]
    think = [
        rng.uniform(2.0, 15.0) if rng.random() < 0.3 else rng.uniform(30.0, 240.0)
        for _ in range(count)
    ]
    cont = [rng.uniform(0.3, 0.85) for _ in range(count)]
    weights = zipf_weights(count, alpha)
    starts: list[Start] = []
    for t in poisson_times(n, rate, rng):
        c = rng.choices(range(count), weights)[0]

        def gap(turn: int, c: int = c) -> float | None:
            return rng.expovariate(1 / think[c]) if rng.random() < cont[c] else None

        starts.append((t, ids.chain(prompts[c], rng.randint(1, 6)), len(prompts[c]), gap))
    run_sessions(tb, rng, ids, starts, n, (1, 3))
    return tb.build(n)


def bursty(
    n: int = 5000,
    seed: int = 0,
    block_tokens: int = 512,
    burst_rate: float = 25.0,
    calm_rate: float = 1.0,
) -> Trace:
    """Chat sessions with on/off (burst / calm) arrivals (see module doc)."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("bursty", block_tokens)
    systems = [[ids.shared((40, s, i)) for i in range(3)] for s in range(3)]
    for sp in systems:
        tb.hint(0.0, "pin", sp)
    t = 0.0
    times: list[float] = []
    while len(times) < n:
        burst = rng.random() < 0.3
        end = t + (rng.uniform(5.0, 30.0) if burst else rng.uniform(30.0, 120.0))
        r = burst_rate if burst else calm_rate
        while len(times) < n:
            t += rng.expovariate(r)
            if t > end:
                t = end
                break
            times.append(t)
    starts: list[Start] = []
    for t0 in times:
        p_cont = rng.uniform(0.4, 0.9)

        def gap(turn: int, p_cont: float = p_cont) -> float | None:
            return rng.lognormvariate(math.log(60.0), 0.8) if rng.random() < p_cont else None

        starts.append((t0, ids.chain(rng.choice(systems), rng.randint(1, 8)), 3, gap))
    run_sessions(tb, rng, ids, starts, n, (1, 4))
    return tb.build(n)


def scan(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    scan_share: float = 0.3,
    prefixes: int = 400,
) -> Trace:
    """A reused working set mixed with one-hit scans in batches (see module doc)."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("scan", block_tokens)
    pool = [[ids.shared((50, p, i)) for i in range(rng.randint(2, 12))] for p in range(prefixes)]
    weights = zipf_weights(prefixes, 0.9)
    starts: list[Start] = []
    t = 0.0
    made = 0
    # A batch holds 40 prompts on average: start one with the probability that makes
    # ``scan_share`` of the requests (before sessions continue) one-hit scans.
    p_batch = scan_share / (40 * (1 - scan_share) + scan_share)
    while made < n:
        if rng.random() < p_batch:  # a batch job: a run of one-hit prompts
            for _ in range(rng.randint(20, 60)):
                t += rng.expovariate(4 * rate)
                tb.request(t, ids.chain([], rng.randint(20, 80)), rng.randint(50, 300))
                made += 1
            continue
        t += rng.expovariate(rate)
        p = rng.choices(range(prefixes), weights)[0]
        p_cont = 0.6

        def gap(turn: int, p_cont: float = p_cont) -> float | None:
            return rng.expovariate(1 / 45.0) if rng.random() < p_cont else None

        starts.append((t, ids.chain(pool[p], rng.randint(1, 4)), len(pool[p]), gap))
        made += 1
    run_sessions(tb, rng, ids, starts, n + len(tb), (1, 3))
    return tb.build(n)


#: The generators of this module by workload name.
SCENARIOS: dict[str, Callable[..., Trace]] = {
    "toolagent": toolagent,
    "rag": rag,
    "tenants": tenants,
    "bursty": bursty,
    "scan": scan,
}
