"""Prefill side of the hand-off: compute KV for prompts and store it to the shared tier.

    python prefill.py --url redis://127.0.0.1:6379/0 [--prompts 4]

Prints one JSON line: pages stored per prompt. Pages of the shared system prefix are
stored once (keys are content addresses: the second prompt finds them present).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from toymodel import ToyModel, config, prompts

from kvtier.cache import KVCache


async def main(url: str, count: int) -> dict[str, object]:
    model = ToyModel()
    stored = []
    async with KVCache(config(url)) as cache:
        for tokens in prompts(count):
            pages = model.prefill(tokens)  # [n, *page_shape] float32: the spec dtype
            result = await cache.store(tokens, pages)
            stored.append(sum(result.stored))
        await cache.flush()  # every page is in the remote tier before we exit
        remote = next(t for t in cache.stats()["tiers"] if t["name"] == "remote")
    return {"stored_pages": stored, "remote_used_pages": remote["used_pages"]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="redis:// URL of the shared remote tier")
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.url, args.prompts))))
