"""The concurrent KVCache fuzz (``cache_fuzz.py``), killed: no wrong byte after a crash.

One *run* (one seed) draws a hierarchy and sequences as :func:`cache_fuzz.run_one` does
(file, NVMe-compat and flaky file stores, codecs; no remote tier: the pool would outlive
the kill anyway). A child process opens the cache and makes random calls from several
tasks until the parent sends it SIGKILL, 0.05-1.5 s after its first pages were flushed
down: mid-write, mid-commit, mid-eviction, mid-flush. Then the parent opens the same
configuration, lets the stores recover, and reads every sequence: a page may be missing
(it was in DRAM, or its write had not committed), but every page served must be the
page's bytes. The recovered cache must then take new pages and serve them. (The child
logs to stderr, which is dropped: its stdout carries only the line saying it is ready.)

``python tests/cache_crash_fuzz.py FIRST LAST`` runs seeds ``FIRST`` to ``LAST - 1``;
``tests/test_cache_fuzz.py`` runs a few in CI.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from cache_fuzz import (
    PAGE,
    PT,
    FuzzFailure,
    calls,
    check_pages,
    draw_config,
    draw_sequences,
    page_bytes,
    run_seeds,
)

from kvtier.cache import KVCache

HERE = Path(__file__).resolve().parent
READY = "first pages flushed"


def _plan(seed: int, root: Path) -> tuple[dict, list[np.ndarray]]:
    """The run's configuration and sequences: the same in the child and the parent."""
    r = random.Random(seed)
    return draw_config(r, root), draw_sequences(r)


async def child(seed: int, root: Path) -> None:
    """Open the cache, store and flush the first sequence (so the kill finds pages on
    disk), say so on stdout, then make calls until killed."""
    cfg, seqs = _plan(seed, root)
    cache = KVCache(cfg, env={}, configure_log=False)
    await cache.start()
    first = seqs[0]
    n = len(first) // PT
    await cache.store(first, np.stack([page_bytes(first[: (i + 1) * PT]) for i in range(n)]))
    await cache.flush()
    print(READY, flush=True)
    seen: Counter = Counter()
    workers = [calls(cache, random.Random(seed * 1000 + w), seqs, seen) for w in range(4)]
    while True:  # the parent kills us; should the calls end first, start again
        await asyncio.gather(*workers)
        workers = [calls(cache, random.Random(seed * 77 + w), seqs, seen) for w in range(4)]


def _ready(stdout: Any) -> bool:
    """Whether the child said :data:`READY` before its stdout closed."""
    return any(line.strip() == READY for line in stdout)


async def crash_one(seed: int, hang_s: float = 60.0) -> Counter:
    """One killed run; returns what the reopened cache found."""
    seen: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-crash-") as tmp:
        root = Path(tmp)
        cfg, seqs = _plan(seed, root)
        where = f"seed {seed} ({cfg})"
        child = subprocess.Popen(
            [sys.executable, str(HERE / "cache_crash_fuzz.py"), "--child", str(seed), tmp],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=HERE.parent,
        )
        try:
            assert child.stdout is not None
            if not await asyncio.wait_for(asyncio.to_thread(_ready, child.stdout), hang_s):
                raise FuzzFailure(f"{where}: the child did not open its cache (rc {child.poll()})")
            await asyncio.sleep(random.Random(seed).uniform(0.05, 1.5))
            if child.poll() is not None:
                raise FuzzFailure(
                    f"{where}: the child died before the kill (rc {child.returncode})"
                )
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        cache = KVCache(cfg, env={}, configure_log=False)
        await asyncio.wait_for(cache.start(), hang_s)
        try:
            for tokens in seqs:
                n = len(tokens) // PT
                out = np.zeros((n, PAGE), np.uint8)
                ok = await asyncio.wait_for(cache.read(cache.page_keys(tokens), out), hang_s)
                seen["pages after the kill"] += check_pages(tokens, out, ok, f"{where}: after kill")
            fresh = np.arange(1_000_000, 1_000_000 + 3 * PT)  # tokens no run draws
            rows = np.stack([page_bytes(fresh[: (i + 1) * PT]) for i in range(3)])
            await cache.store(fresh, rows)
            out = np.zeros((3, PAGE), np.uint8)
            ok = await cache.read(cache.page_keys(fresh), out)
            if check_pages(fresh, out, ok, f"{where}: a new page after the kill") != 3:
                raise FuzzFailure(
                    f"{where}: the recovered cache lost a page stored after it opened"
                )
        finally:
            await asyncio.wait_for(cache.close(), hang_s)
    return seen


async def main(first: int, last: int) -> int:
    return await run_seeds(range(first, last), crash_one)


if __name__ == "__main__":
    import cache_crash_fuzz  # the module the parent and "cache_fuzz:..." configs share

    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
        asyncio.run(cache_crash_fuzz.child(int(sys.argv[2]), Path(sys.argv[3])))
    elif len(sys.argv) == 3:
        sys.exit(asyncio.run(cache_crash_fuzz.main(int(sys.argv[1]), int(sys.argv[2]))))
    else:
        sys.exit("usage: python tests/cache_crash_fuzz.py FIRST_SEED LAST_SEED")
