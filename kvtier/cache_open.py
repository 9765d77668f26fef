"""Opening a cache's backends (:meth:`kvtier.cache.KVCache.start`'s first step)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backend import Backend
from kvtier.config import KVTierConfig
from kvtier.errors import TierOpenError
from kvtier.log import get_logger

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
