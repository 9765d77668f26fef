"""``pin`` hints hold under the default policy (``adaptive``) whoever leads it.

A pin is the engine saying a system prompt must stay; it is not audited, so it holds
while the ``hinted`` expert does not lead as it does while it leads (within its
``pin_share`` of the tier).
"""

from __future__ import annotations

import numpy as np
from cache_kit import PAGE, PT, open_cache

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.keys import PageKey
from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.hints import Hint


def k(i: int) -> PageKey:
    return i.to_bytes(16, "big")


def every(_key: PageKey) -> bool:
    return True


def _filled(pages: int) -> AdaptivePolicy:
    """An ``adaptive`` policy holding pages 1..``pages``, one chain each, on LRU."""
    p = AdaptivePolicy(capacity=pages)
    p.follow("0:last")
    for i in range(1, pages + 1):
        p.on_time(float(i))
        p.on_insert(k(i))
    return p


def test_pinned_pages_go_last_whoever_leads() -> None:
    p = _filled(8)
    assert p.victims(2, every) == [k(1), k(2)]  # LRU leads: the oldest first
    p.on_hint(Hint("pin", (k(1), k(2))), 9.0)
    assert p.describe()["leader"] == "two-class(bonus=0,order=last)"  # not `hinted`
    assert p.victims(8, every) == [*(k(i) for i in range(3, 9)), k(1), k(2)]
    p.on_hint(Hint("unpin", (k(1),)), 10.0)
    assert p.victims(2, every) == [k(1), k(3)]


def test_pins_over_the_share_are_plain_pages() -> None:
    p = _filled(8)
    p.on_hint(Hint("pin", tuple(k(i) for i in range(1, 6))), 9.0)  # 5 of 8 > pin_share 1/2
    assert p.victims(2, every) == [k(1), k(2)]


def test_pins_of_an_engine_whose_hints_are_distrusted_do_not_hold() -> None:
    """Half of the hints wrong must not cost more than no hints: once the audit stops
    trusting the engine's hints, its pins go too (exact hints keep them)."""
    p = _filled(40)
    p.on_hint(Hint("pin", (k(1), k(2))), 41.0)
    for i in range(3, 40):  # every `close` proved wrong: the page is used again
        p.on_hint(Hint("close", (k(i),)), 41.0)
        p.on_access(k(i))
    assert p.audit is not None and p.audit.judged >= 32 and p.audit.accuracy < 0.8
    assert p.victims(1, every) == [k(1)]  # LRU's order: the pins are plain pages


def test_a_partial_walk_closes_the_leaders_order() -> None:
    p = _filled(8)
    p.on_hint(Hint("pin", (k(1),)), 9.0)
    order = p.ordered_keys(every)
    assert next(order) == k(2)
    order.close()  # the two-class book's heap entries are given back; the policy goes on
    p.on_insert(k(9))
    assert p.victims(9, every)[-1] == k(1)


async def test_live_cache_keeps_a_pinned_system_prompt_under_adaptive() -> None:
    cfg = {
        "model": {"preset": "tiny"},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": 32 * PAGE}],
    }
    rng = np.random.default_rng(0)

    def pages(n: int) -> np.ndarray:
        return rng.integers(0, 256, (n, PAGE), np.uint8)

    async with open_cache(cfg) as cache:
        assert cache.config.tiers[0].eviction == "adaptive"
        prompt = np.arange(100_000, 100_000 + 8 * PT)
        stored = await cache.store(prompt, pages(8))
        cache.hint("pin", stored.keys)
        for i in range(60):  # requests never seen again: plain pages to evict
            tokens = np.arange(i * 1000, i * 1000 + 4 * PT)
            await cache.lookup(tokens)
            await cache.store(tokens, pages(4))
        assert len((await cache.lookup(prompt)).keys) == 8
