"""Bookkeeping cost of the ``hinted`` policy per evicted page, against ``lru-k``'s.

A policy alone (no cache): it is filled with ``--pages`` pages, then ``--batches`` rounds
each evict ``--batch`` victims and store as many new pages (the first round includes
building ``hinted``'s forecast ranking, so the default 200 rounds span several rebuilds
on a large tier). Two kinds of traffic:

* ``rates``: every page is referenced three times, one millisecond apart, and no hint
  comes: every page has an unforeseen rate (the forecast ranking's worst case);
* ``predicted``: every page is covered by a ``next_turn`` hint (16 pages per hint,
  1,000-1,100 s ahead): every page has a live prediction;
* ``once``: every page is referenced once and no hint comes: no page has a forecast, and
  every walk reads the fallback's order (prefill traffic: most pages are used once).

``lru-k`` runs the same references (and ignores the hints): the baseline measured in the
same run. Prints microseconds per evicted-and-stored page and the ratio.

    .venv/bin/python benchmarks/hinted_cost.py --pages 20000 --pages 100000
    .venv/bin/python benchmarks/hinted_cost.py --pages 20000 --policy adaptive

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import time

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import Hint, hint_target


class Clock:
    """Trace time for ``policy``: one millisecond per reference."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.now = 0.0
        self.target = hint_target(policy)

    def tick(self) -> None:
        self.now += 0.001
        if self.target is not None:
            self.target.on_time(self.now)


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def store(policy: EvictionPolicy, clock: Clock, keys: list[PageKey], traffic: str) -> None:
    """Store ``keys`` as ``traffic`` does (see the module docstring)."""
    target = clock.target
    for i, k in enumerate(keys):
        clock.tick()
        policy.on_insert(k)
        if traffic == "rates":
            for _ in range(2):
                clock.tick()
                policy.on_access(k)
        elif traffic == "predicted" and i % 16 == 15 and target is not None:
            target.on_hint(
                Hint("next_turn", tuple(keys[i - 15 : i + 1]), 1000.0 + i % 97), clock.now
            )


def cost(name: str, traffic: str, pages: int, batch: int, batches: int) -> float:
    """Microseconds per page of ``batches`` rounds of evicting and storing ``batch`` pages."""
    policy = make_policy(name)
    clock = Clock(policy)
    store(policy, clock, [key(i) for i in range(pages)], traffic)
    t0 = time.perf_counter()
    for j in range(batches):
        for victim in policy.victims(batch, lambda _k: True):
            policy.on_remove(victim)
        store(policy, clock, [key(10**9 + j * batch + i) for i in range(batch)], traffic)
    return (time.perf_counter() - t0) / (batches * batch) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, action="append", default=[])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--policy", default="hinted", help="the policy set beside lru-k")
    ap.add_argument(
        "--batches", type=int, default=200, help="rounds (enough for several ranking rebuilds)"
    )
    args = ap.parse_args()
    print(f"traffic    pages | {args.policy} us/page | lru-k us/page | ratio")
    for pages in args.pages or [20000]:
        for traffic in ("rates", "predicted", "once"):
            h = cost(args.policy, traffic, pages, args.batch, args.batches)
            b = cost("lru-k", traffic, pages, args.batch, args.batches)
            print(f"{traffic:9s} {pages:6d} | {h:10.1f} | {b:13.1f} | {h / b:5.1f}", flush=True)


if __name__ == "__main__":
    main()
