"""Belady MIN against a brute-force optimum on tiny traces."""

from __future__ import annotations

import functools
import random

import pytest

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.sim.belady import belady_min


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
