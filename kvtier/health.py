"""Health bookkeeping shared by tiers, backends and plugins: say a failure once.

A failing device or server fails every page it is asked for; logging each would bury the
one line that matters. Three helpers keep logs to one line per episode:

* :class:`LogOnce` answers whether a cause is new (log it) or was seen (only count it);
* :class:`Outage` tracks one outage at a time: the first failure after a healthy period
  opens it (log a warning), the first success closes it (log that it ended and how long
  it lasted);
* :class:`Health` is the outage tracker of a remote store, with fail-fast probing and
  refused-write episodes. Plugins (the Mooncake store) use it as the built-in
  ``redis`` store does.

All of them are owned by the event-loop thread (no locks). Public: third-party backends
may import this module.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

#: Seconds without a refused write after which the next refusal is logged again.
REFUSAL_QUIET_S = 60.0
#: Largest multiple of ``retry_interval_s`` between two probes of a server that is down.
MAX_BACKOFF = 32
#: Seconds after a logged recovery within which a new outage of a remote store is a flap:
#: counted, and logged only once it has lasted that long (a connection cut every 3 ms
#: logged an "unavailable" / "back" pair per cut: 495 pairs in 12 s).
FLAP_QUIET_S = 10.0


class LogOnce:
    """Causes already logged: :meth:`first` is ``True`` only the first time a cause is
    seen (log it then; count every time)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def first(self, cause: str) -> bool:
        """Whether ``cause`` is seen for the first time (and remember it)."""
        if cause in self._seen:
            return False
        self._seen.add(cause)
        return True

    def __contains__(self, cause: object) -> bool:
        return cause in self._seen


class LogEvery:
    """At most one log line per cause per ``interval_s`` seconds, for a condition that
    repeats while it lasts (a write-down blocked on every store): :meth:`due` answers how
    many lines were held back since the last one (log now, with that count) or ``None``
    (hold this one back)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def due(self, cause: str) -> int | None:
        """``None`` within ``interval_s`` of the last line for ``cause``; else the lines
        held back since it (0 the first time)."""
        now = time.monotonic()
        last = self._last.get(cause)
        if last is not None and now - last < self.interval_s:
            self._held[cause] = self._held.get(cause, 0) + 1
            return None
        self._last[cause] = now
        return self._held.pop(cause, 0)


class ThreadLogEvery(LogEvery):
    """:class:`LogEvery` for lines logged from worker threads (an executor's file I/O):
    :meth:`due` holds a lock."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__(interval_s)
        self._lock = threading.Lock()

    def due(self, cause: str) -> int | None:
        with self._lock:
            return super().due(cause)


class Ended(NamedTuple):
    """An outage :class:`Outage` closed: ``seconds`` from its first failure until the
    calls worked again, ``failures`` counted in it, ``relapses`` (failures after calls had
    worked again, within the quiet period)."""

    seconds: float
    failures: int
    relapses: int


class Outage:
    """One outage at a time: opened by the first failure, closed once calls have worked
    for ``quiet_s`` seconds without a failure (0: by the first success). A failure sooner
    continues it, as a relapse, so a condition that flaps (a full disk that takes some
    writes and refuses the next) is one outage, not one per flap.

    Attributes:
        quiet_s: how long calls must work before the outage counts as over.
        since: monotonic start of the open outage, ``None`` when there is none.
        failures: failures counted in the open outage (pages or batches, as the caller
            counts).
        relapses: failures in it after calls had worked again.
        outages: outages opened so far.
    """

    def __init__(self, quiet_s: float = 0.0) -> None:
        self.quiet_s = quiet_s
        self.since: float | None = None
        self.failures = 0
        self.relapses = 0
        self.outages = 0
        self._last_ok = True
        self._working_since: float | None = None  # first success since the last failure

    @property
    def healthy(self) -> bool:
        """Whether the last call worked (an outage may still be open: :attr:`since`)."""
        return self._last_ok

    def failed(self, count: int = 1) -> bool:
        """Count a failure; ``True`` when it opens an outage (log a warning then). Call
        :meth:`close_if_quiet` first, so that an outage already over is closed (and
        logged) before this one opens."""
        self._last_ok = False
        if self.since is not None and self._working_since is not None:
            self.relapses += 1
        self._working_since = None
        self.failures += count
        if self.since is not None:
            return False
        self.since = time.monotonic()
        self.outages += 1
        return True

    def succeeded(self) -> Ended | None:
        """A call worked: the outage this closes (log it), or ``None`` (none open, or the
        calls have not worked for ``quiet_s`` yet)."""
        self._last_ok = True
        if self.since is not None and self._working_since is None:
            self._working_since = time.monotonic()
        return self.close_if_quiet()

    def close_if_quiet(self) -> Ended | None:
        """Close the open outage when calls have worked for ``quiet_s`` since its last
        failure; what it was, or ``None``."""
        if self.since is None or self._working_since is None:
            return None
        if time.monotonic() - self._working_since < self.quiet_s:
            return None
        ended = Ended(self._working_since - self.since, self.failures, self.relapses)
        self.since = self._working_since = None
        self.failures = self.relapses = 0
        return ended


@dataclass
class Health:
    """Outage state and counters of one remote store.

    A store reports every failed batch (:meth:`failed`) and every batch that reached the
    server (:meth:`succeeded`). The first failure after a healthy period logs one warning
    and opens an outage; later failures only count; the first success after it logs one
    line saying the server is back and how long it was gone. An outage that opens within
    :data:`FLAP_QUIET_S` of a logged recovery (a flapping connection) is counted in
    :attr:`flaps` and logged only if it lasts that long; one that ends sooner ends
    silently, and the next logged line says how many such outages went unlogged.

    A server that answers but refuses writes (out of memory with ``maxmemory-policy
    noeviction``) is not an outage: reads still work, and refusals come and go with every
    page written or deleted. :meth:`refused` logs the first refusal and then stays quiet
    until :data:`REFUSAL_QUIET_S` pass without one.

    With a ``retry_interval_s`` above 0, an outage also fails fast: :meth:`may_send` lets
    one probe batch through per interval (doubling after each failed probe, up to
    :data:`MAX_BACKOFF` times the interval) and answers ``False`` for everything else, so
    calls miss at once instead of each waiting for a deadline.

    Attributes:
        name: what to call the server in log lines (its URL, no credentials).
        logger: where the lines go.
        outages: outages seen so far.
        failed_batches: batches that failed (timeout, connection, server error).
        refused_writes: pages the server refused to store (out of memory).
        down_since: monotonic start of the current outage, ``None`` when healthy.
        flaps: outages not logged (short ones right after a recovery) since the last
            "unavailable" line.
    """

    name: str
    logger: logging.Logger
    retry_interval_s: float = 0.0
    outages: int = 0
    failed_batches: int = 0
    refused_writes: int = 0
    down_since: float | None = None
    skipped_batches: int = 0
    flaps: int = 0
    _reason: str = field(default="", repr=False)
    _logged: bool = field(default=False, repr=False)  # the open outage was logged
    _back_at: float | None = field(default=None, repr=False)  # last logged recovery
    _last_refusal: float | None = field(default=None, repr=False)
    _backoff: float = field(default=0.0, repr=False)
    _next_probe: float = field(default=0.0, repr=False)
    _probing: bool = field(default=False, repr=False)

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def reason(self) -> str | None:
        """Why the store is down (the error that opened the outage), ``None`` when up."""
        return self._reason if self.down_since is not None else None

    def may_send(self) -> bool:
        """Whether a batch may go to the server now. Always while healthy or when fail-fast
        is off; during an outage only the one probe of each interval (the caller then
        reports :meth:`failed`, :meth:`succeeded` or :meth:`probe_abandoned`)."""
        if self.down_since is None or self.retry_interval_s <= 0:
            return True
        if self._probing or time.monotonic() < self._next_probe:
            self.skipped_batches += 1
            return False
        self._probing = True
        return True

    def probe_abandoned(self) -> None:
        """The probe let through by :meth:`may_send` was not sent after all."""
        self._probing = False

    def _schedule_probe(self, backoff: float) -> None:
        self._backoff = backoff
        self._next_probe = time.monotonic() + backoff
        self._probing = False

    def failed(self, reason: str) -> None:
        """Record a failed batch; log only when this opens an outage. The first failure
        schedules the first probe; a failed probe doubles the wait for the next one
        (other batches of the same wave failing change nothing)."""
        self.failed_batches += 1
        if self.down_since is None:
            self._schedule_probe(self.retry_interval_s)
        elif self._probing:
            self._schedule_probe(min(self._backoff * 2, self.retry_interval_s * MAX_BACKOFF))
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
            self._reason = reason
            self._logged = False
            if self._back_at is not None and now - self._back_at < FLAP_QUIET_S:
                self.flaps += 1  # a flap: logged only if it lasts
                return
            self._log_down(reason)
        elif not self._logged and now - self.down_since >= FLAP_QUIET_S:
            self.flaps -= 1  # this one is logged now
            self._log_down(reason)

    def _log_down(self, reason: str) -> None:
        unlogged = (
            f"; {self.flaps} short outage(s) after a recovery were not logged" if self.flaps else ""
        )
        self.flaps = 0
        self._logged = True
        self.logger.warning(
            "remote store %s unavailable (%s); its pages count as misses until it is back%s",
            self.name,
            reason,
            unlogged,
        )

    def succeeded(self) -> None:
        """Record a batch that reached the server; log when this ends a logged outage."""
        self._probing = False
        if self.down_since is not None:
            now = time.monotonic()
            gone = now - self.down_since
            self.down_since = None
            if self._logged:
                self._back_at = now
                self.logger.warning(
                    "remote store %s is back after %.1f s (it had failed with: %s)",
                    self.name,
                    gone,
                    self._reason,
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
