"""Outage tracking for a remote store: one log line per outage, not one per page.

A store reports every failed batch (:meth:`Health.failed`) and every batch that reached
the server (:meth:`Health.succeeded`). The first failure after a healthy period logs one
warning and opens an outage; later failures only count; the first success after it logs
one line saying the server is back and how long it was gone.

A server that answers but refuses writes (out of memory with ``maxmemory-policy
noeviction``) is not an outage: reads still work, and refusals come and go with every
page written or deleted. :meth:`Health.refused` logs the first refusal and then stays
quiet until :data:`REFUSAL_QUIET_S` pass without one. Owned by the event-loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

#: Seconds without a refused write after which the next refusal is logged again.
REFUSAL_QUIET_S = 60.0


@dataclass
class Health:
    """Outage state and counters of one remote store.

    Attributes:
        name: what to call the server in log lines (its URL, no credentials).
        logger: where the lines go.
        outages: outages seen so far.
        failed_batches: batches that failed (timeout, connection, server error).
        refused_writes: pages the server refused to store (out of memory).
        down_since: monotonic start of the current outage, ``None`` when healthy.
    """

    name: str
    logger: logging.Logger
    outages: int = 0
    failed_batches: int = 0
    refused_writes: int = 0
    down_since: float | None = None
    _reason: str = field(default="", repr=False)
    _last_refusal: float | None = field(default=None, repr=False)

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, reason: str) -> None:
        """Record a failed batch; log only when this opens an outage."""
        self.failed_batches += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            self._reason = reason
            self.logger.warning(
                "remote store %s unavailable (%s); its pages count as misses until it is back",
                self.name,
                reason,
            )

    def succeeded(self) -> None:
        """Record a batch that reached the server; log when this ends an outage."""
        if self.down_since is not None:
            gone = time.monotonic() - self.down_since
            self.down_since = None
            self.logger.warning(
                "remote store %s is back after %.1f s (%s)", self.name, gone, self._reason
            )

    def refused(self, pages: int, reason: str) -> None:
        """Record pages the server refused to store; log only the first refusal of an
        episode (one that follows :data:`REFUSAL_QUIET_S` seconds without refusals)."""
        self.refused_writes += pages
        now = time.monotonic()
        if self._last_refusal is None or now - self._last_refusal > REFUSAL_QUIET_S:
            self.logger.warning(
                "remote store %s refuses writes (%s); pages that do not fit are not stored",
                self.name,
                reason,
            )
        self._last_refusal = now
