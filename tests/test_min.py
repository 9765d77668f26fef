"""Belady MIN against a brute-force optimum on tiny traces."""

from __future__ import annotations

import functools
import random

import pytest

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.eviction import make_policy
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Request, Trace
from kvtier.sim.workloads import workload


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def brute_force_hits(seq: list[int], cap: int) -> int:
    """Most hits any policy (with bypass) can get: explore every choice."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        x = seq[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < cap:
            options.append(best(i + 1, cache | {x}))
        else:
            for v in cache:
                options.append(best(i + 1, (cache - {v}) | {x}))
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_min_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n_keys = rng.randint(2, 6)
    seq = [rng.randrange(n_keys) for _ in range(rng.randint(1, 12))]
    cap = rng.randint(1, 3)
    res = belady_min([[k(x)] for x in seq], cap)
    assert res.hits == brute_force_hits(seq, cap)
    assert res.prefix_hits == res.hits  # one block per request


def test_min_prefix_hits_stop_at_first_miss() -> None:
    # Request 2 = [1, 2] with capacity 1: 1 is cached (reused later), 2 is not.
    res = belady_min([[k(1)], [k(1), k(2)], [k(1)]], 1)
    assert res.hits == 2 and res.prefix_hits == 2
    res2 = belady_min([[k(2)], [k(1), k(2)], [k(2)]], 1)
    assert res2.hits == 2 and res2.prefix_hits == 1  # 2 hit behind the missed 1


def test_min_bad_capacity() -> None:
    with pytest.raises(KVTierUsageError, match="capacity"):
        belady_min([[k(1)]], -1)


def test_the_ceiling_holds_on_a_trace_that_reuses_ids_out_of_prefix_position() -> None:
    """Ids reused outside their prefix (a hand-made or foreign trace): MIN's own prefix
    hits fall below LRU's, but the ceiling (its block hits) stays above every policy."""
    requests = [[k(1)], [k(5)], [k(4), k(6), k(5), k(1)], [k(6), k(4)]]
    trace = Trace(
        "non-prefix",
        512,
        [Request(float(t), 512 * len(r), 1, tuple(r)) for t, r in enumerate(requests)],
    )
    for cap in (2, 3):
        ceiling = belady_min(requests, cap)
        assert ceiling.prefix_hit_rate < ceiling.ceiling
        for policy in ("lru", "lru-k", "arc", "s3-fifo", "adaptive"):
            got = replay(trace, make_tiers([cap], functools.partial(make_policy, policy)))
            assert got.prefix_hit_rate <= ceiling.ceiling, (policy, cap)
    lru = replay(trace, make_tiers([3], functools.partial(make_policy, "lru")))
    assert lru.prefix_hit_rate == 0.25 > belady_min(requests, 3).prefix_hit_rate


@pytest.mark.parametrize("name", ["chat", "docqa", "rag", "agent"])
def test_on_prefix_consistent_traces_the_ceiling_is_mins_prefix_hit_rate(name: str) -> None:
    tr = workload(name, n=600, seed=1).without_hints()
    blocks = [r.blocks for r in tr.requests]
    for share in (0.01, 0.05, 0.25):
        got = belady_min(blocks, max(1, int(share * tr.distinct_blocks())))
        assert got.hits == got.prefix_hits
