"""NVMe store recovery time: fill a store with N small pages, reopen it, report the time.

Usage::

    .venv/bin/python benchmarks/nvme_recovery.py --dir /tmp/nvrecov --pages 100000

Recovery reads the SQLite index only; the figure is ``NvmeStore.stats()["recovery_seconds"]``
(opening, locking, probing O_DIRECT and loading every row). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from pathlib import Path

import numpy as np
from kvtier.backends.nvme import NvmeStore

PAGE = 4096


async def main(root: Path, pages: int, reopens: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    buf = np.ones(PAGE, np.uint8)
    start = time.perf_counter()
    async with NvmeStore(
        page_bytes=PAGE, capacity_pages=pages, path=root, slab_bytes=256 << 20
    ) as s:
        for i in range(0, pages, 2000):
            keys = [j.to_bytes(16, "little") for j in range(i, min(pages, i + 2000))]
            if not all(await s.put(keys, [buf] * len(keys))):
                raise RuntimeError("a page could not be stored")
    print(f"filled {pages} pages in {time.perf_counter() - start:.1f} s")
    for _ in range(reopens):
        async with NvmeStore(page_bytes=PAGE, capacity_pages=pages, path=root) as s:
            st = s.stats()
            pages_back, seconds = st["recovered_pages"], st["recovery_seconds"]
            print(f"recovered_pages {pages_back} recovery_seconds {seconds:.3f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--reopens", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(main(args.dir, args.pages, args.reopens))
