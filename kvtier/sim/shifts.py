"""Workloads whose popularity changes over time: mixes every other generator lacks.

The generators of :mod:`kvtier.sim.workloads` and :mod:`kvtier.sim.scenarios` draw
their prefixes from popularity laws that stay fixed for the whole trace. Real traffic
moves: a product launch, a news event or a new tool makes a new set of prompts hot while
the old one fades. Pages that were hot keep a long history in frequency-minded policies
(LRU-2, ARC's frequency list, ``interval``'s forecasts) and are slow to leave; recency
forgets at once. These generators test that trade.

* ``shift``: a shared system prompt, then a prefix drawn from the *current* pool of
  documents (Zipf-popular); the pool is replaced by a new one ``phases - 1`` times at
  equal intervals of requests, a share ``carry`` of requests still asking for an older
  pool's documents.
* ``drift``: one pool of Zipf-popular prefixes whose ranks drift: every ``every``
  requests, ``swaps`` random pairs of ranks trade places (trending content rises, old
  favourites sink).

Both are seeded, follow the prefix rule of real traces (a block id names the block and
everything before it) and pin their system prompt (the one hint an engine can give
here: nothing is known about sessions).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvtier.sim.gen import Ids, TraceBuilder, poisson_times, zipf_weights
from kvtier.sim.trace import Trace


def shift(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    phases: int = 3,
    prefixes: int = 400,
    alpha: float = 1.0,
    carry: float = 0.1,
) -> Trace:
    """Popularity that moves to a new pool of documents ``phases - 1`` times (see the
    module doc); ``rate`` is requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("shift", block_tokens)
    system = [ids.shared((30, i)) for i in range(2)]
    tb.hint(0.0, "pin", system)
    pools = [
        [ids.shared_chain(system, (31, ph, d), rng.randint(2, 12)) for d in range(prefixes)]
        for ph in range(max(1, phases))
    ]
    weights = zipf_weights(prefixes, alpha)
    for i, t in enumerate(poisson_times(n, rate, rng)):
        phase = min(len(pools) - 1, i * len(pools) // n)
        if phase and rng.random() < carry:
            phase = rng.randrange(phase)  # the long tail of an older pool
        doc = rng.choices(pools[phase], weights)[0]
        tb.request(t, ids.chain(doc, rng.randint(1, 3)), rng.randint(20, 400))
    return tb.build()


def drift(
    n: int = 5000,
    rate: float = 4.0,
    seed: int = 0,
    block_tokens: int = 512,
    prefixes: int = 800,
    alpha: float = 0.9,
    every: int = 50,
    swaps: int = 20,
) -> Trace:
    """One pool of prefixes whose popularity ranks drift (see the module doc); ``rate``
    is requests per second."""
    rng = random.Random(seed)
    ids = Ids()
    tb = TraceBuilder("drift", block_tokens)
    system = [ids.shared((40, 0))]
    tb.hint(0.0, "pin", system)
    pool = [ids.shared_chain(system, (41, d), rng.randint(2, 10)) for d in range(prefixes)]
    rank = list(range(prefixes))  # rank -> document
    weights = zipf_weights(prefixes, alpha)
    for i, t in enumerate(poisson_times(n, rate, rng)):
        if i and i % max(1, every) == 0:
            for _ in range(swaps):
                a, b = rng.randrange(prefixes), rng.randrange(prefixes)
                rank[a], rank[b] = rank[b], rank[a]
        doc = pool[rank[rng.choices(range(prefixes), weights)[0]]]
        tb.request(t, ids.chain(doc, rng.randint(1, 3)), rng.randint(20, 400))
    return tb.build()


#: The generators of this module by workload name.
SHIFTS: dict[str, Callable[..., Trace]] = {"shift": shift, "drift": drift}
