"""The default policy against the classics on short windows of a Mooncake-format trace.

A trace the size of a short held-out one (``--requests`` requests, 4,000 by default) is
where an online choice has the least to go on. Each window ``[lo, lo + requests)`` of
``--trace`` is replayed through one tier at each ``--capacity`` share of its distinct
blocks as a cell of ``kvtier bench sim --suite`` (``kvtier.sim.suite.run_cell``), with
``adaptive`` and the four classic policies; prints the default's prefix hit rate, the
best classic's, and the gain.

    .venv/bin/python benchmarks/mooncake_windows.py \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl

A benchmark, not a test: nothing here asserts a hit rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvtier.policy  # noqa: F401 - registers the policies
from kvtier.sim.suite import CLASSIC, DEFAULT_POLICY, run_cell
from kvtier.sim.trace import read_mooncake


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--capacity", type=float, action="append", default=[])
    args = ap.parse_args()
    tr = read_mooncake(args.trace)
    gains = []
    for w in range(args.windows):
        lo = w * args.requests
        if lo >= len(tr.requests):
            break
        window = tr.slice(lo, lo + args.requests, f"requests {lo}-{lo + args.requests}")
        for share in args.capacity or [0.01, 0.05, 0.10]:
            cell = run_cell(window, share, (DEFAULT_POLICY, *CLASSIC))
            rates, best = cell["hit_rate"], cell["best_classic"]
            gains.append(cell["gain"])
            print(
                f"{window.name} {share * 100:g}% ({cell['capacity_pages']} pages): "
                f"{DEFAULT_POLICY} {rates[DEFAULT_POLICY]:.4f}, best classic {best} "
                f"{rates[best]:.4f}, gain {cell['gain']:+.4f}",
                flush=True,
            )
    ahead = sum(g > 0 for g in gains)
    print(f"ahead in {ahead} of {len(gains)}, sum of the gains {sum(gains):+.4f}")


if __name__ == "__main__":
    main()
