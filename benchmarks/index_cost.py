"""Cost per page of the index: prefix-tree insert and match, block-table packing.

Run: ``.venv/bin/python benchmarks/index_cost.py --pages 1000000 --json``

Timings on a shared machine are noisy, so each figure is the best of ``--repeat`` runs and
comes with a raw baseline measured in the same run: a plain ``dict`` insert / lookup of the
same keys (the least any keyed index can cost) and a plain ``numpy`` fill of the same
slots. Ratios are what to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvtier.index.block_table import BlockTables, SlotPool, pack_slots
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import Namespace, PageKey, page_keys


def _chains(pages: int, chain_pages: int) -> list[list[PageKey]]:
    ns = Namespace("bench", page_tokens=16)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(pages // chain_pages):
        tokens = rng.integers(0, 50_000, size=chain_pages * 16, dtype=np.int64)
        out.append(page_keys(tokens, ns))
    return out


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """The fastest of ``repeat`` timings of ``fn()`` (noise only ever adds time)."""
    return min(_time(fn) for _ in range(repeat))


def run(pages: int, chain_pages: int, seqs: int, repeat: int = 3) -> dict[str, object]:
    chains = _chains(pages, chain_pages)
    n = sum(len(c) for c in chains)

    # inserts: a fresh tree / dict per repetition
    t_ins = t_base_ins = float("inf")
    tree = PrefixTree(["dram", "disk"])
    base: dict[PageKey, int] = {}
    for _ in range(repeat):
        tree = PrefixTree(["dram", "disk"])
        base = {}

        def tree_insert(tree: PrefixTree = tree) -> None:
            for c in chains:
                tree.insert(c, "dram")

        def dict_insert(base: dict[PageKey, int] = base) -> None:
            for c in chains:
                for k in c:
                    base[k] = 1

        t_base_ins = min(t_base_ins, _time(dict_insert))
        t_ins = min(t_ins, _time(tree_insert))

    def tree_match() -> None:
        for c in chains:
            tree.match(c)

    def tree_match_length() -> None:
        for c in chains:
            tree.match_length(c)

    def dict_match() -> None:
        for c in chains:
            for k in c:
                if k not in base:
                    break

    t_base_match = _best(dict_match, repeat)
    t_match = _best(tree_match, repeat)
    t_len = _best(tree_match_length, repeat)

    # block tables: `seqs` sequences holding `n` pages in all, packed into int32
    per_seq = n // seqs
    pt = 16
    tables = BlockTables(pt, SlotPool(range(n)), lambda a, b, c: None)
    ids = []
    for _ in range(seqs):
        s = tables.create()
        tables.append(s, np.zeros(per_seq * pt, dtype=np.int64))
        ids.append(s)
    t_pack = _best(lambda: tables.pack(ids, lambda p: p.slot), repeat)
    rows = [[p.slot for p in tables.table(s).pages] for s in ids]
    t_pack_rows = _best(lambda: pack_slots(rows, per_seq), repeat)
    flat = np.asarray(rows, dtype=np.int64)
    out = np.empty((seqs, per_seq), dtype=np.int32)
    t_np = _best(lambda: np.copyto(out, flat, casting="unsafe"), repeat)
    packed = seqs * per_seq

    def ns(t: float, count: int) -> float:
        return round(t / count * 1e9, 1)

    return {
        "pages": n,
        "chain_pages": chain_pages,
        "repeat": repeat,
        "tree_nodes": tree.node_count(),
        "insert_ns_per_page": ns(t_ins, n),
        "insert_dict_baseline_ns_per_page": ns(t_base_ins, n),
        "insert_ratio": round(t_ins / t_base_ins, 2),
        "match_ns_per_page": ns(t_match, n),
        "match_length_ns_per_page": ns(t_len, n),
        "match_dict_baseline_ns_per_page": ns(t_base_match, n),
        "match_ratio": round(t_match / t_base_match, 2),
        "match_length_ratio": round(t_len / t_base_match, 2),
        "pack_seqs": seqs,
        "pack_ns_per_page": ns(t_pack, packed),
        "pack_rows_ns_per_page": ns(t_pack_rows, packed),
        "pack_numpy_baseline_ns_per_page": ns(t_np, packed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--chain-pages", type=int, default=256, help="pages per sequence")
    ap.add_argument("--seqs", type=int, default=1000, help="sequences packed")
    ap.add_argument("--repeat", type=int, default=3, help="timings per figure; the best")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run(a.pages, a.chain_pages, a.seqs, a.repeat)
    if a.json:
        sys.stdout.write(json.dumps(res) + "\n")
    else:
        for k, v in res.items():
            sys.stdout.write(f"{k:36} {v}\n")


if __name__ == "__main__":
    main()
