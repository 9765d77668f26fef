"""Write a Mooncake-format trace of short sessions behind one shared system prompt: the
shape on which a docs-only probe (2026-12-05) found ``adaptive`` up to 0.03 below LRU at
20-40 % capacity (docs/benchmarks.md, "Policy suite"). Not a suite workload: nothing was
tuned on it.

Sessions arrive every 0.9 s on average (exponential); each runs 1, 1, 2, 3, 4 or 6 turns
(drawn uniformly from that list) 40 s apart on average, each turn adding 8-16 blocks to
the context; every request starts with the same 16-block prompt.

    .venv/bin/python benchmarks/sysprompt_trace.py --seed 11 --out /tmp/A_sysprompt.jsonl
    .venv/bin/kvtier bench sim --trace /tmp/A_sysprompt.jsonl --policy adaptive \\
        --policy lru --capacity 10% --capacity 20% --capacity 40%
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def sessions(seed: int, n: int = 4000, prompt_blocks: int = 16) -> list[tuple[float, list[int]]]:
    """``n`` requests (arrival in ms, block ids), sorted by arrival."""
    rnd = random.Random(seed)
    next_id = prompt_blocks
    system = list(range(prompt_blocks))
    reqs: list[tuple[float, list[int]]] = []
    t = 0.0
    while len(reqs) < n:
        t += rnd.expovariate(1 / 900.0)
        ctx, at = list(system), t
        for _turn in range(rnd.choice([1, 1, 2, 3, 4, 6])):
            k = rnd.randint(8, 16)
            ctx = ctx + list(range(next_id, next_id + k))
            next_id += k
            reqs.append((at, list(ctx)))
            at += rnd.expovariate(1 / 40000.0)
    reqs = reqs[:n]
    reqs.sort(key=lambda r: r[0])
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    reqs = sessions(args.seed, args.requests)
    with open(args.out, "w") as f:
        for t, ids in reqs:
            row = {"timestamp": int(t), "input_length": 512 * len(ids), "output_length": 100,
                   "hash_ids": ids}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    refs = sum(len(ids) for _, ids in reqs)
    distinct = len({b for _, ids in reqs for b in ids})
    print(f"{args.out}: {len(reqs)} requests, {refs} block references, {distinct} distinct")


if __name__ == "__main__":
    main()
