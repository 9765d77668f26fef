"""Caches that were never closed are named, and a bridge left open does not hang the exit.

A probe of servers' process life found: a ``KVTierBridge.start()`` whose ``with`` was never
left hung the interpreter at exit for good and lost its last pages; a ``KVCache``
garbage-collected while open kept its NVMe store locked for the rest of the process
without a word; one left open at exit lost pages with only asyncio's noise on stderr.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from cache_kit import config, open_cache, sequence
from structlog.testing import capture_logs

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from cache_kit import config, sequence
    from kvtier.cache import KVCache
    from kvtier.integrations.transformers import KVTierBridge

    cfg = config(__import__("pathlib").Path({path!r}), dram_pages=4,
                 file_backend="nvme", file_pages=256)
    rng = np.random.default_rng(7)
    if {mode!r} == "bridge":
        held = KVTierBridge.start(cfg, env={{}})
        bridge = held.__enter__()  # and never left
        for _ in range(10):
            bridge.call(bridge.cache.store(*sequence(rng, 3)))
    else:
        import asyncio
        async def main():
            cache = KVCache(cfg, env={{}})
            await cache.start()
            await cache.store(*sequence(rng, 3))
            return cache
        loop = asyncio.new_event_loop()
        kept = loop.run_until_complete(main())  # never closed
    print("stored", flush=True)
    """
)


def _child(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    code = _CHILD.format(tests=str(Path(__file__).parent), path=str(tmp_path), mode=mode)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, check=False)  # fmt: skip


def test_a_bridge_never_left_is_closed_at_exit_and_keeps_its_pages(tmp_path: Path) -> None:
    done = _child(tmp_path, "bridge")  # before: killed by the timeout, 24 pages missing
    assert done.returncode == 0 and "stored" in done.stdout, done.stderr
    assert "KVTierBridge.start() was never left" in done.stderr

    async def count() -> int:
        cfg = config(tmp_path, dram_pages=4, file_backend="nvme", file_pages=256)
        async with open_cache(cfg) as cache:
            return len(cache.directory.keys_in("file"))

    import asyncio

    assert asyncio.run(count()) == 30  # all ten sequences reached NVMe


def test_a_cache_left_open_at_exit_is_named(tmp_path: Path) -> None:
    done = _child(tmp_path, "cache")
    assert done.returncode == 0 and "stored" in done.stdout, done.stderr
    assert "a KVCache was still open at interpreter exit" in done.stderr
    assert "dram (dram), file (nvme)" in done.stderr


async def test_a_cache_collected_while_open_is_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    cache = open_cache(config(tmp_path))
    await cache.start()
    await cache.store(*sequence(rng, 2))
    with capture_logs() as logs:
        del cache
        gc.collect()
    said = [e for e in logs if e["event"].startswith("a KVCache was garbage-collected")]
    assert len(said) == 1 and said[0]["cache"] == "dram (dram), file (file)", logs


async def test_a_closed_cache_says_nothing_when_collected(tmp_path: Path) -> None:
    async with open_cache(config(tmp_path)) as cache:
        pass
    with capture_logs() as logs:
        del cache
        gc.collect()
    assert not [e for e in logs if "KVCache was" in e["event"]], logs
