"""Caches that were never closed: named in a warning instead of failing silently.

A :class:`~kvtier.cache.KVCache` holds what only ``close()`` gives back: dirty pages in
memory tiers (lost with the process), an NVMe store's writer lock, I/O threads and
connections. A cache garbage-collected while open kept its NVMe store locked for the rest
of the process (a new cache on the same path skipped the tier as "open in another
process or object", naming its own pid), and one left open at interpreter exit lost its
last pages with only asyncio's "Task was destroyed" lines on stderr. :func:`watch_open`
names both cases, without keeping the cache alive.
"""

from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass

from kvtier.log import get_logger

_log = get_logger("kvtier.cache")

#: Watches of the caches open now (small objects: never the caches themselves).
_OPEN: set[OpenWatch] = set()
_hooked: list[bool] = []


@dataclass(eq=False)
class OpenWatch:
    """One open cache, described by ``what`` (its tiers)."""

    what: str

    def closed(self) -> None:
        """The cache was closed: nothing to say about it."""
        _OPEN.discard(self)


def watch_open(cache: object, tiers: list[tuple[str, str]]) -> OpenWatch:
    """Watch ``cache`` (just opened, with ``tiers`` as (name, backend)) until
    :meth:`OpenWatch.closed` is called."""
    watch = OpenWatch(", ".join(f"{name} ({backend})" for name, backend in tiers))
    _OPEN.add(watch)
    collected = weakref.finalize(cache, _collected, watch)
    collected.atexit = False  # at exit, :func:`_at_exit` says it
    if not _hooked:
        _hooked.append(True)
        atexit.register(_at_exit)
    return watch


def _collected(watch: OpenWatch) -> None:
    if watch in _OPEN:
        _OPEN.discard(watch)
        _log.warning(
            "a KVCache was garbage-collected while open (close() was never called): pages "
            "held only in its memory tiers are lost, and what its stores hold (an NVMe "
            "store's writer lock, I/O threads, connections) stays taken until the process "
            "exits, so a new cache on the same NVMe path skips that tier; close caches you "
            "are done with (async with KVCache(...) as cache)",
            cache=watch.what,
        )


def _at_exit() -> None:
    for watch in list(_OPEN):
        _OPEN.discard(watch)
        _log.warning(
            "a KVCache was still open at interpreter exit (close() was never called): pages "
            "held only in its memory tiers are lost; close it before the process ends "
            "(async with KVCache(...) as cache, or await cache.close())",
            cache=watch.what,
        )
