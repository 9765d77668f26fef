"""Cost per key of a ``next_turn`` hint: a policy alone, and with what-if sizing.

A policy (no cache) is filled with ``--pages`` pages in chains of 256, then takes
``--hints`` hints of ``--keys`` keys each (overlapping windows of the held pages, one
second apart). The first hint under ``adaptive`` also builds its ``hinted`` expert, which
learns every held page: it is printed apart from the later ones. ``--whatif`` adds the
what-if miniatures of one tier (:class:`~kvtier.sim.whatif.WhatIf`), which take the hint
too. The baseline, measured in the same run: one plain ``dict`` write per key.

    .venv/bin/python benchmarks/hint_cost.py --policy hinted
    .venv/bin/python benchmarks/hint_cost.py --policy adaptive --whatif

A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import time

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.keys import PageKey
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import Hint, hint_target
from kvtier.sim.whatif import TierModel, WhatIf


def _key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def _dict_us_per_key(keys: tuple[PageKey, ...], now: float) -> float:
    """The baseline: one dict write per key, best of three."""
    best = float("inf")
    for _ in range(3):
        d: dict[PageKey, tuple[float, float]] = {}
        t0 = time.perf_counter()
        for k in keys:
            d[k] = (now, now)
        best = min(best, time.perf_counter() - t0)
    return best / len(keys) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--pages", type=int, default=20_000)
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--hints", type=int, default=6)
    ap.add_argument("--whatif", action="store_true")
    a = ap.parse_args(argv)
    if not 1 <= a.keys < a.pages or a.hints < 2:
        ap.error("need 1 <= --keys < --pages and --hints >= 2")
    policy = make_policy(a.policy)
    target = hint_target(policy)
    whatif = None
    if a.whatif:
        whatif = WhatIf([TierModel("t0", a.pages, lambda: make_policy(a.policy))])
    now = 0.0
    keys = [_key(i) for i in range(a.pages)]
    for c in range(0, a.pages, 256):
        chain = keys[c : c + 256]
        now += 0.01
        if target is not None:
            target.on_time(now)
        if whatif is not None:
            whatif.on_time(now)
            whatif.on_request(chain)
        prev = None
        for k in chain:
            policy.on_insert(k, prev)
            prev = k
    per_key = []
    for h in range(a.hints):
        now += 1.0
        lo = (h * 977) % (a.pages - a.keys)
        hint = Hint("next_turn", tuple(keys[lo : lo + a.keys]), 30.0 + h)
        t0 = time.perf_counter()
        if target is not None:
            target.on_hint(hint, now)
        if whatif is not None:
            whatif.on_hint(hint, now)
        per_key.append((time.perf_counter() - t0) / a.keys * 1e6)
    base = _dict_us_per_key(tuple(keys[: a.keys]), now)
    later = per_key[1:]
    print(
        f"{a.policy}{' + what-if' if a.whatif else ''}: µs per hinted key, first hint "
        f"{per_key[0]:.2f}, later {min(later):.2f}-{max(later):.2f}; a dict write "
        f"{base:.3f} (later / dict: {min(later) / base:.0f}-{max(later) / base:.0f}x)"
    )


if __name__ == "__main__":
    main()
