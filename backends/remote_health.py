"""Outage tracking for a remote store: one log line per outage, not one per page.

A store reports every failed batch (:meth:`Health.failed`) and every batch that reached
the server (:meth:`Health.succeeded`). The first failure after a healthy period logs one
warning and opens an outage; later failures only count; the first success after it logs
one line saying the server is back and how long it was gone. Owned by the event-loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field


@dataclass
class Health:
    """Outage state and counters of one remote store.

    Attributes:
        name: what to call the server in log lines (its URL, no credentials).
        logger: where the lines go.
        outages: outages seen so far.
        failed_batches: batches that failed (timeout, connection, server error).
        down_since: monotonic start of the current outage, ``None`` when healthy.
    """

    name: str
    logger: logging.Logger
    outages: int = 0
    failed_batches: int = 0
    down_since: float | None = None
    _reason: str = field(default="", repr=False)

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
