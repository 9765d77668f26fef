"""Five more workloads, each stressing one trait the other generators lack.

They come from an adversarial probe of the default policy (2026-12-04, docs/benchmarks.md,
"Policy suite"): traffic shapes a serving deployment meets that no earlier generator had.

* ``rotation``: tenants active in turn. Each tenant has its own Zipf-popular working set
  and gets most of the traffic for ``turn`` requests, then the next one; the first comes
  back after all the others. A loop at the scale of whole working sets: recency forgets a
  tenant just before it returns.
* ``longchat``: long conversations (10-60 turns) with heavy-tailed think times (Pareto),
  many open at once: a context grows by a few blocks a turn and returns after seconds or
  after an hour.
* ``templates``: sharing several levels deep: a few system prompts, each with many
  templates, each with a few examples, then a one-off query; popularity is Zipf at every
  level, so one page is hot while its siblings are cold.
* ``sizes``: heavy-tailed request sizes: mostly short chat prompts (1-3 blocks past a
  short system prompt) and a few Pareto-sized documents of 100-400 blocks.
* ``uniform``: documents drawn with no skew at all (every prefix as likely as another):
  what a cache can keep is a share of them, whatever it chooses.

Each is seeded, follows the prefix rule of real traces (a block id names the block and
everything before it) and pins its shared system prompts; ``longchat`` also gives the
session hints of :mod:`kvtier.sim.scenarios` (``next_turn`` with the true gap,
``close``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvtier.sim.gen import Ids, TraceBuilder, poisson_times, zipf_weights
from kvtier.sim.scenarios import Start, run_sessions
from kvtier.sim.trace import Trace


def rotation(
    n: int = 5000,
    rate: float = 5.0,
    seed: int = 0,
    block_tokens: int = 512,
    tenants: int = 4,
    prefixes: int = 150,
    turn: int = 250,
    loyal: float = 0.9,
    alpha: float = 0.8,
) -> Trace:
    """Tenants active in turn, ``turn`` requests each (see the module doc); a share
    ``loyal`` of requests goes to the active tenant, the rest to any; ``rate`` is
    requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("rotation", block_tokens)
    systems = [[ids.shared((50, t, 0))] for t in range(tenants)]
    for system in systems:
        tb.hint(0.0, "pin", system)
    sets = [
        [ids.shared_chain(systems[t], (51, t, d), rng.randint(2, 10)) for d in range(prefixes)]
        for t in range(tenants)
    ]
    weights = zipf_weights(prefixes, alpha)
    for i, t in enumerate(poisson_times(n, rate, rng)):
        active = (i // max(1, turn)) % tenants
        tenant = active if rng.random() < loyal else rng.randrange(tenants)
        doc = rng.choices(sets[tenant], weights)[0]
        tb.request(t, ids.chain(doc, rng.randint(0, 2)), rng.randint(20, 400))
    return tb.build()


def longchat(
    n: int = 5000,
    rate: float = 0.3,
    seed: int = 0,
    block_tokens: int = 512,
    think_s: float = 60.0,
    shape: float = 1.2,
) -> Trace:
    """Long conversations with heavy-tailed think times (see the module doc): 5 s plus
    ``think_s`` x a Pareto(``shape``) draw between turns; ``rate`` is new conversations
    per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("longchat", block_tokens)
    system = [ids.shared((60, i)) for i in range(4)]
    tb.hint(0.0, "pin", system)
    starts: list[Start] = []
    for t in poisson_times(max(n // 20, 1), rate, rng):
        turns = rng.randint(10, 60)

        def gap(turn: int, turns: int = turns) -> float | None:
            return None if turn >= turns - 1 else 5.0 + think_s * rng.paretovariate(shape)

        starts.append((t, ids.chain(system, rng.randint(1, 3)), len(system), gap))
    run_sessions(tb, rng, ids, starts, n, (1, 3))
    return tb.build(n)


def templates(
    n: int = 5000,
    rate: float = 5.0,
    seed: int = 0,
    block_tokens: int = 512,
    systems: int = 4,
    per_system: int = 30,
    examples: int = 10,
) -> Trace:
    """System prompt -> template -> example -> one-off query (see the module doc);
    ``rate`` is requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("templates", block_tokens)
    roots = [ids.shared_chain([], (70, s), rng.randint(2, 6)) for s in range(systems)]
    for root in roots:
        tb.hint(0.0, "pin", root)
    mids = [
        [ids.shared_chain(roots[s], (71, s, m), rng.randint(1, 8)) for m in range(per_system)]
        for s in range(systems)
    ]
    leaves = [
        [
            [ids.shared_chain(mid, (72, s, m, e), rng.randint(1, 6)) for e in range(examples)]
            for m, mid in enumerate(row)
        ]
        for s, row in enumerate(mids)
    ]
    w_sys = zipf_weights(systems, 1.0)
    w_mid = zipf_weights(per_system, 0.8)
    w_leaf = zipf_weights(examples, 1.2)
    for t in poisson_times(n, rate, rng):
        s = rng.choices(range(systems), w_sys)[0]
        m = rng.choices(range(per_system), w_mid)[0]
        e = rng.choices(range(examples), w_leaf)[0]
        tb.request(t, ids.chain(leaves[s][m][e], rng.randint(1, 3)), rng.randint(20, 400))
    return tb.build()


def sizes(
    n: int = 5000,
    rate: float = 5.0,
    seed: int = 0,
    block_tokens: int = 512,
    documents: int = 40,
    chats: int = 300,
    doc_share: float = 0.15,
) -> Trace:
    """Short chat prompts and a few very long documents (see the module doc): a share
    ``doc_share`` of requests reads a document of 100-400 blocks (Pareto-sized);
    ``rate`` is requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("sizes", block_tokens)
    system = [ids.shared((80, i)) for i in range(2)]
    tb.hint(0.0, "pin", system)
    docs = [
        ids.shared_chain(system, (81, d), int(min(400.0, 100.0 * rng.paretovariate(1.5))))
        for d in range(documents)
    ]
    talks = [ids.shared_chain(system, (82, c), rng.randint(1, 3)) for c in range(chats)]
    w_doc = zipf_weights(documents, 0.9)
    w_talk = zipf_weights(chats, 1.0)
    for t in poisson_times(n, rate, rng):
        if rng.random() < doc_share:
            prompt = ids.chain(rng.choices(docs, w_doc)[0], rng.randint(1, 3))
        else:
            prompt = ids.chain(rng.choices(talks, w_talk)[0], rng.randint(0, 2))
        tb.request(t, prompt, rng.randint(20, 400))
    return tb.build()


def uniform(
    n: int = 5000,
    rate: float = 5.0,
    seed: int = 0,
    block_tokens: int = 512,
    prefixes: int = 1500,
) -> Trace:
    """Prefixes of 2-8 blocks drawn uniformly from ``prefixes`` (see the module doc);
    ``rate`` is requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("uniform", block_tokens)
    docs = [ids.shared_chain([], (90, d), rng.randint(2, 8)) for d in range(prefixes)]
    for t in poisson_times(n, rate, rng):
        tb.request(t, ids.chain(rng.choice(docs), rng.randint(0, 2)), rng.randint(20, 400))
    return tb.build()


#: The generators of this module by workload name.
MIXES: dict[str, Callable[..., Trace]] = {
    "rotation": rotation,
    "longchat": longchat,
    "templates": templates,
    "sizes": sizes,
    "uniform": uniform,
}
