"""Opening a cache's backends (:meth:`kvtier.cache.KVCache.start`'s first step), the
cache's owner (the event loop and thread that started it) and what a cut-short close
leaves unwritten."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence

from kvtier.backend import Backend
from kvtier.config import KVTierConfig
from kvtier.errors import KVTierUsageError, TierOpenError
from kvtier.index.directory import Directory
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.plan.planner import Planner
from kvtier.transfer.tier import Tier

#: The event loop, thread and process that started a cache.
Owner = tuple[asyncio.AbstractEventLoop, int, int]

_log = get_logger("kvtier.cache")


async def open_backends(
    config: KVTierConfig, make_backend: Callable[[int], Backend], skipped: dict[str, str]
) -> list[tuple[int, Backend]]:
    """Construct (``make_backend(i)``) and open every tier's backend. A tier whose open
    fails raises :class:`TierOpenError`, or with ``on_open_error = "skip"`` is logged as
    an error and recorded in ``skipped`` (tier name -> why). Returns the opened backends
    with their tier index; on an error, those opened are closed again."""
    backends = [make_backend(i) for i in range(len(config.tiers))]
    opened: list[tuple[int, Backend]] = []
    try:
        for i, b in enumerate(backends):
            tc = config.tiers[i]
            try:
                await b.open()
            except Exception as exc:
                if tc.on_open_error != "skip":
                    raise TierOpenError.of(tc.name, tc.backend, exc) from exc
                skipped[tc.name] = f"{type(exc).__name__}: {exc}"
                _log.error(
                    "tier skipped: it cannot open",
                    tier=tc.name,
                    backend=tc.backend,
                    error=str(exc),
                    error_type=type(exc).__name__,
                )
                continue
            opened.append((i, b))
    except BaseException:
        for _, b in reversed(opened):
            await b.close()
        raise
    return opened


def current_owner() -> Owner:
    """The running event loop, this thread and this process (call from the loop)."""
    return asyncio.get_running_loop(), threading.get_ident(), os.getpid()


def check_owner(owner: Owner | None) -> None:
    """Raise :class:`KVTierUsageError` when called from a forked child of the process that
    started the cache (the child's copy used the parent's executors and loop state: a raw
    "no running event loop"), or from another thread or event loop than ``owner``: a
    cache's directory, policies and futures belong to the loop that started it and have
    no locks (a call from a foreign loop hung, or marked a tier failing)."""
    if owner is None:
        return
    loop, thread, pid = owner
    if os.getpid() != pid:
        raise KVTierUsageError(
            f"this KVCache was started in process {pid}, and this is a forked child "
            f"({os.getpid()}): its loop, threads, locks and connections belong to the parent; "
            "open a new KVCache in the child (an NVMe store has one writer: give it another "
            "path), and neither use nor close the parent's"
        )
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if threading.get_ident() != thread or (running is not None and running is not loop):
        raise KVTierUsageError(
            "KVCache is used from another thread or event loop than the one that started "
            "it; call it on that loop (from another thread: a coroutine method through "
            "asyncio.run_coroutine_threadsafe(coro, loop), a plain one such as hint() "
            "through loop.call_soon_threadsafe)"
        )


def report_unwritten(
    planner: Planner, tiers: Sequence[Tier], directory: Directory, metrics: CacheMetrics, why: str
) -> int:
    """Count and log the pages of memory tiers that are still dirty (:meth:`Planner.dirty`,
    the pages ``Writer.flush`` picks) as the cache closes: they are lost with the process.
    ``why`` says why they were not written down (the log line's event). Each tier's count
    goes to ``dropped_pages_total``; returns the total."""
    lost = {t.name: len(planner.dirty(t.index, directory.keys_in(t.name))) for t in tiers[:-1]
            if t.is_arena}  # fmt: skip
    lost = {name: n for name, n in lost.items() if n}
    for name, n in lost.items():
        metrics.dropped.inc(name, by=n)
    if lost:
        _log.warning(why, pages=sum(lost.values()), tiers=lost)
    return sum(lost.values())
