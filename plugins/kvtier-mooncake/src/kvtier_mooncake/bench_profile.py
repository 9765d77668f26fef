"""``kvtier bench io --tier mooncake``: the plugin's bench profile.

Registered into kvtier's bench registry when the plugin loads (see ``__init__``): the bench
starts a loopback :class:`~kvtier_mooncake.server.MooncakeCluster` and, beside kvtier's
``put``/``get``, times a bare client loop on the same connected client:
``batch_upsert_from`` / ``batch_get_into`` of the same bytes from/into one registered
buffer, ``batch_pages`` per call (no header, no checksum, no copy out).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import TierIOError


@contextlib.asynccontextmanager
async def mooncake_options(_scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """A loopback deployment for one bench run (a lease long enough for 4 MiB batches)."""
    from kvtier_mooncake.server import MooncakeCluster

    cluster = MooncakeCluster(pool_bytes=1 << 30, lease_ms=2000)
    await asyncio.to_thread(cluster.__enter__)
    try:
        yield {**cluster.options(), "op_timeout_s": 60.0}
    finally:
        await asyncio.to_thread(cluster.close)


async def mooncake_baseline(target: Any) -> Any:
    """The bare-client baseline on the backend's own connected client."""
    from kvtier.bench.baselines import BaselineSample

    store = target.backend
    client = getattr(store, "_client", None)
    if client is None:
        raise TierIOError("mooncake baseline: the store is not connected")
    page, n, depth = target.page_bytes, len(target.pages), max(1, target.batch_pages)
    src = np.concatenate(list(target.pages))
    dst = np.empty_like(src)
    names = [f"kvtier-bench-raw/{bytes(k).hex()}" for k in target.keys]

    def run() -> tuple[float, float]:
        for buf in (src, dst):
            if client.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise TierIOError("mooncake baseline: register_buffer failed")
        try:
            start = time.perf_counter()
            for i in range(0, n, depth):
                count = min(depth, n - i)
                ptrs = [src.ctypes.data + (i + j) * page for j in range(count)]
                codes = client.batch_upsert_from(names[i : i + count], ptrs, [page] * count)
                if any(c != 0 for c in codes):
                    raise TierIOError(f"mooncake baseline: upsert answered {codes}")
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            for i in range(0, n, depth):
                count = min(depth, n - i)
                ptrs = [dst.ctypes.data + (i + j) * page for j in range(count)]
                got = client.batch_get_into(names[i : i + count], ptrs, [page] * count)
                if any(g != page for g in got):
                    raise TierIOError(f"mooncake baseline: get answered {got}")
            read_s = time.perf_counter() - start
            client.batch_remove(names, True)
        finally:
            for buf in (src, dst):
                client.unregister_buffer(buf.ctypes.data)
        return write_s, read_s

    write_s, read_s = await store.run_blocking(run)
    if not np.array_equal(src, dst):
        raise TierIOError("mooncake baseline read back different bytes")
    return BaselineSample(
        f"mooncake batch_upsert_from/batch_get_into, {depth} per call", write_s, read_s, n * page
    )


def register() -> None:
    """Add the profile to kvtier's bench registry (no-op where the bench is absent)."""
    try:
        from kvtier.bench.baselines import IOProfile, register_profile
    except ImportError:
        return
    register_profile(
        "mooncake",
        IOProfile(mooncake_options, mooncake_baseline, "bare Mooncake client, same deployment"),
        replace=True,
    )
