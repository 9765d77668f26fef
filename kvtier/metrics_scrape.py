"""Reading a running cache's metrics back from its Prometheus endpoint.

A process that embeds :class:`~kvtier.cache.KVCache` exposes ``cache.metrics.to_prometheus()``
(text format 0.0.4, every name prefixed ``kvtier_``), e.g. on ``/metrics`` like the example
server. :func:`scrape` fetches such an endpoint; :func:`parse_prometheus` reads the text;
:func:`cache_stats` turns the series into the per-tier and per-link summary that
``kvtier inspect stats`` shows: occupancy, hit rate, errors, link GB/s.

Raises :class:`ScrapeError` (a :class:`~kvtier.errors.KVTierError`) naming the URL and the
reason when the endpoint cannot be read, holds no kvtier metrics, or holds a ``kvtier_``
sample kvtier itself never exports (a value that is not a number, a series given twice,
or, among the series ``inspect stats`` reads, two series for one tier, link or queue, or a
value that is negative, NaN, infinite or not below 2**63), and
:class:`~kvtier.errors.KVTierUsageError` for a URL that is not ``http(s)://`` or that holds
a space, a control or a non-ASCII character.
"""

from __future__ import annotations

import http.client
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from kvtier.errors import KVTierError, KVTierUsageError

PREFIX = "kvtier_"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ScrapeError(KVTierError):
    """A metrics endpoint could not be read, or holds no kvtier metrics."""


Series = dict[str, list[tuple[dict[str, str], float]]]


_ESCAPED = re.compile(r"\\(.)")
_UNESCAPED = {"n": "\n", '"': '"', "\\": "\\"}


def _unescape(value: str) -> str:
    """A label value as written before the exposition format escaped it: ``\\\\``,
    ``\\"`` and ``\\n`` read left to right (one pass, so ``\\\\n`` is a backslash and
    an ``n``, not a backslash and a newline)."""
    return _ESCAPED.sub(lambda m: _UNESCAPED.get(m.group(1), m.group(0)), value)


#: A sample value of the text format (a Go float: digits, a point, an exponent; NaN,
#: +Inf, -Inf). Python's float() also takes "1_000", " 5" and "infinity": not these.
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|NaN")


def _number(text: str) -> float:
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"not a number of the text format: {text!r}")
    return float(text)


def _at(source: str) -> str:
    return f" at {source}" if source else ""


def parse_prometheus(text: str, source: str = "") -> Series:
    """``{metric name: [(labels, value), ...]}`` of every sample line in ``text``.

    Comments and malformed lines are skipped, and so are samples of other exporters
    whose value is not a number. A ``kvtier_`` sample whose value is not a number, or a
    ``kvtier_`` series (name and labels) given twice, raises :class:`ScrapeError` naming
    the series, its value(s) and ``source``: kvtier exports neither, and keeping one of
    them would show a figure the cache never had."""
    out: Series = defaultdict(list)
    seen: dict[tuple[str, frozenset[tuple[str, str]]], str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, value = m.group(1), m.group(4)
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(3) or "")}
        ours = name.startswith(PREFIX)
        series = f"{name}{m.group(2) or ''}"
        try:
            number = _number(value)
        except ValueError:
            if ours:
                raise ScrapeError(
                    f"{series} has value {value!r}{_at(source)}: not a number (kvtier "
                    "exports numbers only)"
                ) from None
            continue
        if ours:
            key = (name, frozenset(labels.items()))
            if key in seen:
                raise ScrapeError(
                    f"{series} is given twice{_at(source)} (values {seen[key]} and {value}): "
                    "kvtier exports each series once"
                )
            seen[key] = value
        out[name].append((labels, number))
    return dict(out)


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """The text at ``url`` (an ``http://`` or ``https://`` metrics endpoint)."""
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= 3600):
        raise KVTierUsageError(
            f"--timeout must be a number of seconds in (0, 3600], got {timeout_s}"
        )
    try:
        parsed = urllib.parse.urlparse(url)
        parsed.port  # noqa: B018 - raises for a bad port
    except ValueError as exc:
        raise KVTierUsageError(f"--url {url!r} is not a valid URL: {exc}") from None
    odd = next((i for i, c in enumerate(url) if not 32 < ord(c) < 127), None)
    if odd is not None:
        raise KVTierUsageError(
            f"--url {url!r} holds {url[odd]!r} at position {odd} (a space, a control or a "
            "non-ASCII character): percent-encode it"
        )
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise KVTierUsageError(
            f"--url must be an http(s) URL of a metrics endpoint, e.g. "
            f"http://127.0.0.1:8080/metrics; got {url!r}"
        )
    got: dict[str, Any] = {}
    worker = threading.Thread(target=_fetch, args=(url, timeout_s, got), daemon=True)
    worker.start()
    worker.join(timeout_s + 1.0)  # urlopen's timeout is per socket call, not the request's
    if worker.is_alive() or isinstance(got.get("error"), TimeoutError):
        raise ScrapeError(
            f"cannot read metrics from {url}: no whole answer within --timeout {timeout_s:g} s "
            "(the server is too slow, or trickles its answer)"
        )
    failure = got.get("error")
    if isinstance(failure, urllib.error.HTTPError):
        raise ScrapeError(f"cannot read metrics from {url}: HTTP {failure.code} {failure.reason}")
    errors = (urllib.error.URLError, OSError, ValueError, http.client.HTTPException)
    if isinstance(failure, errors):
        reason = getattr(failure, "reason", failure)
        raise ScrapeError(f"cannot read metrics from {url}: {reason}")
    if failure is not None:
        raise failure
    body: bytes = got["body"]
    return body.decode("utf-8", errors="replace")


MAX_BODY = 64 << 20


def _fetch(url: str, timeout_s: float, got: dict[str, Any]) -> None:
    """Read ``url``'s body (at most :data:`MAX_BODY`) into ``got["body"]``, or the error
    into ``got["error"]``: a :class:`TimeoutError` once ``timeout_s`` has passed since the
    start, checked after every socket read (a server sending a byte every half second
    held a 2 s scrape for as long as it liked)."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            chunks: list[bytes] = []
            size = 0
            while size < MAX_BODY:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no whole answer within {timeout_s:g} s")
                chunk = response.read1(min(1 << 16, MAX_BODY - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            got["body"] = b"".join(chunks)
    except BaseException as exc:  # handed to the caller's thread
        got["error"] = exc


def _by(series: Series, name: str, label: str, source: str = "") -> dict[str, float]:
    """``{value of label: sample}`` of metric ``name``. Two series with one value of
    ``label`` (one with labels kvtier never adds) raise :class:`ScrapeError`: keeping
    either would show a figure the cache never had."""
    out: dict[str, float] = {}
    first: dict[str, dict[str, str]] = {}
    for labels, value in series.get(PREFIX + name, []):
        row = labels.get(label, "")
        if row in out:
            raise ScrapeError(
                f"{PREFIX}{name} has two series for {label}={row!r} ({first[row]} and "
                f"{labels}){_at(source)}: kvtier exports one per {label}"
            )
        out[row], first[row] = value, labels
    return out


def _rows(
    series: Series, fields: dict[str, str], label: str, source: str = ""
) -> dict[str, dict[str, float | None]]:
    """One row per value of ``label`` (sorted), holding each of ``fields`` (row key ->
    metric name); a metric a row lacks reads 0."""
    per_field = {k: _by(series, v, label, source) for k, v in fields.items()}
    names = sorted({n for values in per_field.values() for n in values})
    return {n: {k: per_field[k].get(n, 0.0) for k in fields} for n in names}


#: The series :func:`cache_stats` reads (without the prefix): counts, totals and gauges
#: that kvtier exports as finite numbers >= 0 below :data:`MAX_COUNT`.
STATS_SERIES = (
    "used_pages", "capacity_pages", "hits_total", "misses_total", "stored_pages_total",
    "evicted_pages_total", "dropped_pages_total", "failed_pages_total", "link_pages_total",
    "link_bytes_total", "link_seconds_total", "link_failed_pages_total", "queue_depth",
    "fetch_latency_seconds_count", "fetch_latency_seconds_sum",
)  # fmt: skip
#: Bound (exclusive) of every value in :data:`STATS_SERIES`: no count kvtier keeps
#: reaches it (it is also where a float stops holding whole numbers near exactly).
MAX_COUNT = 2.0**63


def _shown(value: float) -> str:
    """``value`` as a message shows it: whole numbers without ``.0``."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _labelled(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}" if inner else name


def check_counts(series: Series, source: str = "") -> None:
    """Refuse a value of :data:`STATS_SERIES` that kvtier never exports: negative, NaN,
    infinite, not below :data:`MAX_COUNT`, or a fraction where the series counts (pages,
    bytes, hits, batches: all but the seconds). Raises :class:`ScrapeError` naming the
    series, its value and ``source``."""
    for short in STATS_SERIES:
        name = PREFIX + short
        counts = not short.endswith(("seconds_total", "seconds_sum"))
        for labels, value in series.get(name, []):
            if math.isfinite(value) and 0 <= value < MAX_COUNT:
                if not counts or value.is_integer():
                    continue
                raise ScrapeError(
                    f"{_labelled(name, labels)} has value {_shown(value)}{_at(source)}: "
                    "kvtier exports this series as a whole number (it counts)"
                )
            raise ScrapeError(
                f"{_labelled(name, labels)} has value {_shown(value)}{_at(source)}: kvtier "
                "exports this series as a finite number >= 0 below 2**63"
            )


def _whole(value: float | None) -> float | int | None:
    """A count read back from the text format (where every number is a float) as an int
    when it is a whole number (a count is; an odd exporter's fraction stays a float)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def capacity_order(label: str) -> float:
    """``"-25%"`` -> -25.0, for sorting what-if labels (others last)."""
    try:
        return float(label.rstrip("%"))
    except ValueError:
        return math.inf


def whatif_stats(series: Series, source: str = "") -> dict[str, dict[str, Any]]:
    """Per tier with what-if sizing on (``kvtier_whatif_*`` gauges): ``measured`` (the hit
    rate lookups found, ``None`` when not exported) and ``estimates`` (capacity label such
    as ``"-50%"`` -> estimated hit rate, by capacity); ``{}`` when what-if is off. Raises
    :class:`ScrapeError` for a value outside [0, 1]."""
    out: dict[str, dict[str, Any]] = {}
    for short, label in (("whatif_hit_rate", "capacity"), ("whatif_measured_hit_rate", None)):
        for labels, value in series.get(PREFIX + short, []):
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ScrapeError(
                    f"{_labelled(PREFIX + short, labels)} has value {_shown(value)}"
                    f"{_at(source)}: kvtier exports a hit rate in [0, 1]"
                )
            row = out.setdefault(labels.get("tier", ""), {"measured": None, "estimates": {}})
            if label is None:
                row["measured"] = value
            else:
                row["estimates"][labels.get(label, "")] = value
    for row in out.values():
        row["estimates"] = dict(
            sorted(row["estimates"].items(), key=lambda kv: capacity_order(kv[0]))
        )
    return dict(sorted(out.items()))


def cache_stats(series: Series, source: str = "") -> dict[str, Any]:
    """Per tier ``used_pages``, ``capacity_pages``, ``occupancy``, ``hits``, ``misses``,
    ``hit_rate``, ``stored_pages``, ``evicted_pages``, ``dropped_pages``,
    ``failed_pages``; per link ``pages``, ``bytes``, ``seconds``, ``gb_per_s``,
    ``failed_pages``; fetch latency count and mean; queue depths; what-if sizing
    (:func:`whatif_stats`, ``{}`` when off). Counts (pages, bytes,
    fetches, queued batches) are ints; seconds, rates and shares are floats.

    Raises :class:`ScrapeError` when ``series`` holds no kvtier metrics, or a value
    :func:`check_counts` refuses (so no NaN, infinity or negative count reaches the
    report)."""
    if not any(name.startswith(PREFIX) for name in series):
        hint = ""
        if any(name.startswith("vllm:kvtier_") for name in series):
            # vLLM's own /metrics carries the connector's counters, not the cache's
            hint = (
                "; this is vLLM's /metrics (its vllm:kvtier_* series are the connector's "
                "counters): the cache's metrics are served on the port set by the "
                "connector's kvtier_metrics_port"
            )
        raise ScrapeError(f"no kvtier metrics (names starting with {PREFIX!r}) at {source}{hint}")
    check_counts(series, source)
    fields = {
        "used_pages": "used_pages",
        "capacity_pages": "capacity_pages",
        "hits": "hits_total",
        "misses": "misses_total",
        "stored_pages": "stored_pages_total",
        "evicted_pages": "evicted_pages_total",
        "dropped_pages": "dropped_pages_total",
        "failed_pages": "failed_pages_total",
    }
    tiers = _rows(series, fields, "tier", source)
    for row in tiers.values():
        cap, used = row["capacity_pages"] or 0.0, row["used_pages"] or 0.0
        looked = (row["hits"] or 0.0) + (row["misses"] or 0.0)
        row["occupancy"] = used / cap if cap else None
        row["hit_rate"] = (row["hits"] or 0.0) / looked if looked else None
        for key in fields:
            row[key] = _whole(row[key])
    link_fields = {
        "pages": "link_pages_total",
        "bytes": "link_bytes_total",
        "seconds": "link_seconds_total",
        "failed_pages": "link_failed_pages_total",
    }
    links = _rows(series, link_fields, "link", source)
    for lrow in links.values():
        secs, nbytes = lrow["seconds"] or 0.0, lrow["bytes"] or 0.0
        lrow["gb_per_s"] = nbytes / secs / 1e9 if secs > 0 else None
        for key in ("pages", "bytes", "failed_pages"):
            lrow[key] = _whole(lrow[key])
    count = sum(v for _, v in series.get(PREFIX + "fetch_latency_seconds_count", []))
    total = sum(v for _, v in series.get(PREFIX + "fetch_latency_seconds_sum", []))
    queues = {q: _whole(v) for q, v in _by(series, "queue_depth", "queue", source).items()}
    return {
        "source": source,
        "tiers": tiers,
        "links": links,
        "queues": queues,
        "fetch_latency_s": {"count": _whole(count), "mean": total / count if count else None},
        "whatif": whatif_stats(series, source),
    }
