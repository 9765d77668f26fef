"""Counters, gauges and histograms, readable from Python and as Prometheus text.

A :class:`Metrics` registry holds labelled metric families. Everything is updated on the
event-loop thread (the pipeline owns the metadata), so no locks are taken. Two read-outs:

* :meth:`Metrics.snapshot` -> plain nested dicts (``{"counters": {name: {labels: v}}, ...}``)
  plus the cache-level summary that :class:`CacheMetrics` adds;
* :meth:`Metrics.to_prometheus` -> the Prometheus text exposition format (version 0.0.4).

Values computed from other state (what-if estimates) register a refresher
(:meth:`Metrics.refresh_on_read`), run before each read-out, so a scrape never sees them
stale.

Histograms keep cumulative buckets (for Prometheus) and a bounded window of recent samples
from which exact percentiles (p50, p99) are computed.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The queues a link's gate orders batches in (``queue_depth``'s label values).
QUEUES = ("fetch", "prefetch", "evict")

#: Default latency buckets in seconds (10 us .. 10 s).
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
    2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

LabelValues = tuple[str, ...]


def _label_str(names: Sequence[str], values: LabelValues) -> str:
    return ",".join(f"{n}={v}" for n, v in zip(names, values, strict=True))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _prom_labels(names: Sequence[str], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _prom_number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


@dataclass
class _Family:
    name: str
    help: str
    labels: tuple[str, ...]

    def _key(self, values: Sequence[str]) -> LabelValues:
        if len(values) != len(self.labels):
            raise ValueError(
                f"metric {self.name} takes labels {self.labels}, got {len(values)} values"
            )
        return tuple(str(v) for v in values)


@dataclass
class Counter(_Family):
    """A monotonically increasing count per label set."""

    values: dict[LabelValues, float] = field(default_factory=dict)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        """Add ``by`` (>= 0) to the series with these label values."""
        if by < 0:
            raise ValueError(f"counter {self.name} cannot decrease (by={by})")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + by

    def get(self, *labels: str) -> float:
        """Current value (0 for a series never incremented)."""
        return self.values.get(self._key(labels), 0.0)


@dataclass
class Gauge(_Family):
    """A value that goes up and down (queue depth, pages used)."""

    values: dict[LabelValues, float] = field(default_factory=dict)

    def set(self, value: float, *labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def add(self, delta: float, *labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + delta

    def get(self, *labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)


@dataclass
class _Series:
    buckets: list[int]
    window: deque[float]
    count: int = 0
    total: float = 0.0
    max: float = 0.0


@dataclass
class Histogram(_Family):
    """Distribution of observed values: cumulative buckets plus a window for percentiles."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    window: int = 10_000
    series: dict[LabelValues, _Series] = field(default_factory=dict)

    def _get(self, labels: Sequence[str]) -> _Series:
        key = self._key(labels)
        s = self.series.get(key)
        if s is None:
            s = _Series([0] * len(self.bounds), deque(maxlen=self.window))
            self.series[key] = s
        return s

    def observe(self, value: float, *labels: str) -> None:
        """Record one value."""
        s = self._get(labels)
        s.count += 1
        s.total += value
        s.max = max(s.max, value)
        s.window.append(value)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                s.buckets[i] += 1
                break

    def percentile(self, q: float, *labels: str) -> float | None:
        """The ``q``-th percentile (0..100) of the recent window; ``None`` when empty."""
        s = self.series.get(self._key(labels))
        if s is None or not s.window:
            return None
        data = sorted(s.window)
        # nearest-rank percentile: the smallest value with at least q % of samples <= it
        rank = max(1, math.ceil(q / 100.0 * len(data)))
        return data[min(rank, len(data)) - 1]

    def summary(self, *labels: str) -> dict[str, float | int | None]:
        """count, mean, p50, p99 and max of one series."""
        s = self.series.get(self._key(labels))
        if s is None or s.count == 0:
            return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
        return {
            "count": s.count,
            "mean": s.total / s.count,
            "p50": self.percentile(50, *labels),
            "p99": self.percentile(99, *labels),
            "max": s.max,
        }


class Metrics:
    """A registry of metric families (create each once, update from the loop thread)."""

    def __init__(self, prefix: str = "kvtier") -> None:
        self.prefix = prefix
        self._families: dict[str, Counter | Gauge | Histogram] = {}
        self._refreshers: list[Callable[[], None]] = []

    def refresh_on_read(self, refresh: Callable[[], None]) -> Callable[[], None]:
        """Call ``refresh`` (it sets gauges from state it owns) before every
        :meth:`raw`, :meth:`snapshot` and :meth:`to_prometheus`; returns a function that
        stops it. A refresher that raises is skipped for that read-out: a read-out never
        fails for it."""
        self._refreshers.append(refresh)

        def stop() -> None:
            if refresh in self._refreshers:
                self._refreshers.remove(refresh)

        return stop

    def _refresh(self) -> None:
        for refresh in list(self._refreshers):
            with contextlib.suppress(Exception):  # the read-out shows the last values
                refresh()

    def _add(self, family: Counter | Gauge | Histogram) -> Any:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} registered twice")
        self._families[family.name] = family
        return family

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        return self._add(Counter(f"{self.prefix}_{name}", help, tuple(labels)))  # type: ignore[no-any-return]

    def gauge(self, name: str, help: str, labels: Iterable[str] = ()) -> Gauge:
        return self._add(Gauge(f"{self.prefix}_{name}", help, tuple(labels)))  # type: ignore[no-any-return]

    def histogram(
        self,
        name: str,
        help: str,
        labels: Iterable[str] = (),
        bounds: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> Histogram:
        return self._add(  # type: ignore[no-any-return]
            Histogram(f"{self.prefix}_{name}", help, tuple(labels), bounds=bounds)
        )

    def families(self) -> list[Counter | Gauge | Histogram]:
        return list(self._families.values())

    def raw(self) -> dict[str, Any]:
        """Every series as plain data: ``{"counters": {name: {"l=v,..": value}}, ...}``."""
        self._refresh()
        out: dict[str, dict[str, Any]] = {"counters": {}, "gauges": {}, "histograms": {}}
        for fam in self._families.values():
            if isinstance(fam, Counter):
                out["counters"][fam.name] = {
                    _label_str(fam.labels, k): v for k, v in fam.values.items()
                }
            elif isinstance(fam, Gauge):
                out["gauges"][fam.name] = {
                    _label_str(fam.labels, k): v for k, v in fam.values.items()
                }
            else:
                out["histograms"][fam.name] = {
                    _label_str(fam.labels, k): fam.summary(*k) for k in fam.series
                }
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view of every metric (subclasses add a summary)."""
        return self.raw()

    def to_prometheus(self) -> str:
        """The Prometheus text exposition of every series."""
        self._refresh()
        lines: list[str] = []
        for fam in self._families.values():
            kind = (
                "counter"
                if isinstance(fam, Counter)
                else "gauge"
                if isinstance(fam, Gauge)
                else "histogram"
            )
            lines.append(f"# HELP {fam.name} {fam.help}")
            lines.append(f"# TYPE {fam.name} {kind}")
            if isinstance(fam, Counter | Gauge):
                for key, value in sorted(fam.values.items()):
                    lines.append(f"{fam.name}{_prom_labels(fam.labels, key)} {_prom_number(value)}")
                continue
            for key, s in sorted(fam.series.items()):
                cumulative = 0
                for bound, n in zip(fam.bounds, s.buckets, strict=True):
                    cumulative += n
                    le = f'le="{_prom_number(bound)}"'
                    lines.append(
                        f"{fam.name}_bucket{_prom_labels(fam.labels, key, le)} {cumulative}"
                    )
                inf = 'le="+Inf"'
                lines.append(f"{fam.name}_bucket{_prom_labels(fam.labels, key, inf)} {s.count}")
                lines.append(
                    f"{fam.name}_sum{_prom_labels(fam.labels, key)} {_prom_number(s.total)}"
                )
                lines.append(f"{fam.name}_count{_prom_labels(fam.labels, key)} {s.count}")
        return "\n".join(lines) + "\n"


class CacheMetrics(Metrics):
    """The metrics a :class:`~kvtier.cache.KVCache` keeps, with a readable summary.

    ``snapshot()`` returns::

        {"tiers": {tier: {"hits", "misses", "stored_pages", "evicted_pages",
                          "dropped_pages", "failed_pages", "used_pages",
                          "capacity_pages"}},
         "links": {"src->dst": {"pages", "bytes", "seconds", "batches", "failed_pages",
                                "gb_per_s"}},
         "queues": {"fetch", "prefetch", "evict"},          # current depth
         "fetch_latency_s": {"count", "mean", "p50", "p99", "max"},
         "prefetch": {"arrived", "late", "cancelled", "missing"},
         "raw": {...every series...}}
    """

    def __init__(self, prefix: str = "kvtier") -> None:
        super().__init__(prefix)
        self.hits = self.counter(
            "hits_total",
            "Pages a read or load got from a tier (the first that served them)",
            ["tier"],
        )
        self.misses = self.counter(
            "misses_total",
            "Pages asked for that a tier did not serve (absent or failed)",
            ["tier"],
        )
        self.stored = self.counter("stored_pages_total", "Pages committed to a tier", ["tier"])
        self.evicted = self.counter(
            "evicted_pages_total", "Pages evicted from a tier by watermark pressure", ["tier"]
        )
        self.dropped = self.counter(
            "dropped_pages_total",
            "Pages that left a tier with no copy below (evicted, or dirty at close)",
            ["tier"],
        )
        self.failed = self.counter(
            "failed_pages_total", "Page operations a tier failed (treated as misses)", ["tier"]
        )
        self.link_pages = self.counter("link_pages_total", "Pages moved over a link", ["link"])
        self.link_bytes = self.counter("link_bytes_total", "Bytes moved over a link", ["link"])
        self.link_seconds = self.counter(
            "link_seconds_total", "Seconds spent in transfers over a link", ["link"]
        )
        self.link_batches = self.counter(
            "link_batches_total", "Transfer batches run over a link", ["link"]
        )
        self.link_failed = self.counter(
            "link_failed_pages_total", "Pages a link failed to move", ["link"]
        )
        self.used = self.gauge("used_pages", "Pages reserved or committed in a tier", ["tier"])
        self.capacity = self.gauge("capacity_pages", "Pages a tier can hold", ["tier"])
        self.queue_depth = self.gauge(
            "queue_depth", "Batches waiting for a link slot, by queue", ["queue"]
        )
        for queue in QUEUES:  # every queue exported from the start, 0 while empty
            self.queue_depth.set(0, queue)
        self.fetch_latency = self.histogram(
            "fetch_latency_seconds", "Latency of demand fetches (load) per call"
        )
        self.prefetch_pages = self.counter(
            "prefetch_pages_total", "Prefetched pages by outcome", ["outcome"]
        )

    def record_transfer(self, link: str, pages: int, nbytes: int, seconds: float) -> None:
        """Account one finished transfer batch."""
        self.link_pages.inc(link, by=pages)
        self.link_bytes.inc(link, by=nbytes)
        self.link_seconds.inc(link, by=seconds)
        self.link_batches.inc(link)

    def snapshot(self) -> dict[str, Any]:
        """See the class docstring. Counts of pages, bytes, batches and queued batches
        are ``int``; seconds, rates and latencies are ``float``."""
        tiers: dict[str, dict[str, int]] = {}
        names = {
            k[0] for fam in (self.hits, self.misses, self.stored, self.used) for k in fam.values
        }
        for t in sorted(names):
            tiers[t] = {
                "hits": _count(self.hits.get(t)),
                "misses": _count(self.misses.get(t)),
                "stored_pages": _count(self.stored.get(t)),
                "evicted_pages": _count(self.evicted.get(t)),
                "dropped_pages": _count(self.dropped.get(t)),
                "failed_pages": _count(self.failed.get(t)),
                "used_pages": _count(self.used.get(t)),
                "capacity_pages": _count(self.capacity.get(t)),
            }
        links: dict[str, dict[str, float | int | None]] = {}
        for (link,) in sorted(self.link_batches.values):
            secs = self.link_seconds.get(link)
            nbytes = self.link_bytes.get(link)
            links[link] = {
                "pages": _count(self.link_pages.get(link)),
                "bytes": _count(nbytes),
                "seconds": secs,
                "batches": _count(self.link_batches.get(link)),
                "failed_pages": _count(self.link_failed.get(link)),
                "gb_per_s": nbytes / secs / 1e9 if secs > 0 else None,
            }
        return {
            "tiers": tiers,
            "links": links,
            "queues": {q: _count(self.queue_depth.get(q)) for q in QUEUES},
            "fetch_latency_s": self.fetch_latency.summary(),
            "prefetch": {
                o: _count(self.prefetch_pages.get(o))
                for o in ("arrived", "late", "cancelled", "missing")
            },
            "raw": self.raw(),
        }


def _count(value: float) -> int:
    """A counter or gauge that counts whole things (pages, bytes, batches), as an int."""
    return round(value)
