"""Decode side of the hand-off: find the prompts' KV in the shared tier and load it.

    python decode.py --url redis://127.0.0.1:6379/0 [--prompts 4] [--out pages.npz]

Started separately from the prefill process (another process, possibly another machine),
it opens its own KVCache on the same remote tier, looks each prompt up (longest cached
prefix), loads those pages into its DRAM tier (pinned) and reads them out instead of
recomputing them. Prints one JSON line: cached tokens and pages loaded per prompt. With
``--out`` it saves the loaded pages (``prompt<i>`` -> ``[n, *page_shape]`` float32).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
from toymodel import SPEC, config, prompts

from kvtier.cache import KVCache


async def main(url: str, count: int, out: str | None) -> dict[str, object]:
    cached, loaded, recompute = [], [], []
    saved: dict[str, np.ndarray] = {}
    async with KVCache(config(url)) as cache:
        for i, tokens in enumerate(prompts(count)):
            hit = await cache.lookup(tokens)
            result = await cache.load(hit.keys)  # into DRAM, pinned while we use them
            try:
                pages = np.empty((len(hit.keys), *SPEC.page_shape), dtype=np.float32)
                ok = await cache.read(hit.keys, pages)
            finally:
                cache.release(hit.keys)
            cached.append(hit.cached_tokens)
            loaded.append(sum(ok))
            recompute.append(len(tokens) - hit.cached_tokens + SPEC.page_tokens * ok.count(False))
            if result.missing:
                print(json.dumps({"prompt": i, "missing": len(result.missing)}))
            saved[f"prompt{i}"] = pages
    if out is not None:
        np.savez(out, **saved)
    return {"cached_tokens": cached, "loaded_pages": loaded, "tokens_to_compute": recompute}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="redis:// URL of the shared remote tier")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default=None, help="save the loaded pages to this .npz")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.url, args.prompts, args.out))))
