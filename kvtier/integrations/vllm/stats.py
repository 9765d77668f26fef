"""Observability for vLLM: connector stats, Prometheus metrics and KV events.

* :class:`KVTierConnectorStats` travels from the workers (loads, saves, errors) and the
  scheduler (lookups, hit tokens by tier) to vLLM's stats logger, which aggregates and
  logs it (``KV Transfer metrics: ...``) and feeds :class:`KVTierPromMetrics`.
* :class:`KVTierPromMetrics` exports counters on vLLM's ``/metrics``:
  ``vllm:kvtier_hit_tokens{tier}``, ``vllm:kvtier_load_bytes``,
  ``vllm:kvtier_load_seconds``, ``vllm:kvtier_save_bytes``, ``vllm:kvtier_save_seconds``,
  ``vllm:kvtier_load_errors``, ``vllm:kvtier_saves_dropped``, ``vllm:kvtier_save_failures``,
  ``vllm:kvtier_lookup_errors``, ``vllm:kvtier_hinted_pages``, ``vllm:kvtier_hint_errors``,
  ``vllm:kvtier_unkeyed_requests``, ``vllm:kvtier_async_loads``,
  ``vllm:kvtier_lookups``, ``vllm:kvtier_loaded_pages``, ``vllm:kvtier_saved_pages``
  (each ``_total``). The workers' counts are summed by vLLM: with N ranks a page counts
  N times (each rank loads, saves or hints its own part of it).
* :class:`KVTierKVEvents` carries ``BlockStored`` / ``BlockRemoved`` events (the medium is
  the kvtier tier's name, the block hash the 16-byte page key) from the workers to the
  scheduler, which hands them to vLLM's KV event publisher (``take_events``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

#: counters summed across workers and intervals (everything but ``hit_tokens``)
COUNTERS = (
    "lookups",
    "lookup_errors",
    "loaded_pages",
    "load_bytes",
    "load_seconds",
    "load_errors",
    "saved_pages",
    "save_bytes",
    "save_seconds",
    "save_failures",
    "saves_dropped",
    "hinted_pages",
    "hint_errors",
    "unkeyed_requests",
    "async_loads",
)


@dataclass
class KVTierConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last report; ``data["hit_tokens"]`` maps tier -> tokens."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)
        self.data.setdefault("hit_tokens", {})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def add_hits(self, tiers: dict[str, int]) -> None:
        hits = self.data["hit_tokens"]
        for tier, n in tiers.items():
            hits[tier] = hits.get(tier, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        self.add_hits(dict(other.data.get("hit_tokens", {})))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            k: d[k] for k in COUNTERS if not k.endswith("_seconds") and not k.endswith("_bytes")
        }
        for what in ("load", "save"):
            secs = d[f"{what}_seconds"]
            out[f"{what}_GB"] = round(d[f"{what}_bytes"] / 1e9, 4)
            out[f"{what}_GBps"] = round(d[f"{what}_bytes"] / secs / 1e9, 3) if secs else 0.0
        for tier, n in sorted(d["hit_tokens"].items()):
            out[f"hit_tokens_{tier}"] = n
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS) and not self.data["hit_tokens"]


class KVTierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvtier's counters on vLLM's Prometheus endpoint, per engine."""

    _DOCS: ClassVar[dict[str, str]] = {
        "load_bytes": "Bytes of KV loaded from kvtier into the engine's blocks.",
        "load_seconds": "Seconds spent loading KV from kvtier.",
        "save_bytes": "Bytes of KV saved from the engine's blocks into kvtier.",
        "save_seconds": "Seconds kvtier took to accept saved KV (off the forward path).",
        "load_errors": "Blocks whose KV kvtier could not give back (recomputed).",
        "saves_dropped": "Pages not saved because the save backlog was full.",
        "save_failures": "Pages kvtier could not store.",
        "lookup_errors": "Scheduler lookups that could not reach a worker (misses).",
        "loaded_pages": "Pages loaded from kvtier.",
        "saved_pages": "Pages saved into kvtier.",
        "lookups": "Prompt lookups the scheduler made.",
        "hinted_pages": "Pages named by hints from requests' kv_transfer_params (per hint).",
        "hint_errors": "Requests whose kv_transfer_params.kvtier was malformed (ignored).",
        "unkeyed_requests": "Requests kvtier left alone: multimodal inputs (their token ids "
        "do not name their KV).",
        "async_loads": "Requests whose kvtier hit loaded across engine steps (kvtier_load_async).",
    }

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            k: self._counter_cls(name=f"vllm:kvtier_{k}", documentation=doc, labelnames=labelnames)
            for k, doc in self._DOCS.items()
        }
        self._hits = self._counter_cls(
            name="vllm:kvtier_hit_tokens",
            documentation="Prompt tokens whose KV kvtier gave, by the tier that held it.",
            labelnames=[*labelnames, "tier"],
        )
        # Every engine's counters exist from the start, at 0: an error counter that has
        # counted nothing reads 0, not "no sample" (the tiers of hit_tokens are known only
        # from their first hit).
        for values in per_engine_labelvalues.values():
            for counter in self._counters.values():
                counter.labels(*[str(v) for v in values])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for k, counter in self._counters.items():
            v = transfer_stats_data.get(k, 0)
            if v:
                counter.labels(*labels).inc(v)
        for tier, n in transfer_stats_data.get("hit_tokens", {}).items():
            if n:
                self._hits.labels(*labels, tier).inc(n)


class KVTierKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """A plain list of KV events; every worker's events are kept (ranks hash pages into
    their own namespaces, so events are never common across workers)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1
