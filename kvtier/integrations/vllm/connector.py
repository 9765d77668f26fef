"""``KVTierConnector``: kvtier as a vLLM KV connector (``KVConnectorBase_V1``).

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvtier_config": "/etc/kvtier.toml"}}'

vLLM creates one instance in the scheduler process (role ``SCHEDULER``:
:class:`~.scheduler.SchedulerSide`) and one per worker (role ``WORKER``:
:class:`~.worker.WorkerSide`); this class only dispatches. See docs/integrations.md.

It declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on for models whose
layers keep different kinds of KV (sliding-window beside full attention), and the connector
moves each KV cache group's blocks (:mod:`.groups`). With several groups every load runs
asynchronously and a failed one is reported per request (``failed_recving``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.errors import ConfigError
from kvtier.log import get_logger

from .groups import KVGroups
from .identity import parallel_place
from .metadata import KVTierMetadata
from .scheduler import SchedulerSide
from .settings import parse_settings, runtime_dir
from .stats import KVTierConnectorStats, KVTierKVEvents, KVTierPromMetrics
from .worker import WorkerSide

_log = get_logger("kvtier.vllm")

_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}


def _hit_source(kind: str, tier: str) -> CacheHitSource:
    if kind == "arena":
        return CacheHitSource.DEVICE if tier.startswith("hbm") else CacheHitSource.HOST
    return CacheHitSource.DISK if kind == "store" else CacheHitSource.EXTERNAL_UNSPECIFIED


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvtier's tiers (DRAM, NVMe, a remote pool) behind vLLM's prefix cache."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        settings = parse_settings(ktc.kv_connector_extra_config)
        if ktc.kv_role not in _ROLES:
            raise ConfigError(
                f"KVTierConnector: kv_role must be one of {', '.join(_ROLES)}, got {ktc.kv_role!r}"
            )
        loads, saves = _ROLES[ktc.kv_role]
        groups = KVGroups.of(kv_cache_config)  # refuses Mamba and other non-attention groups
        runtime = runtime_dir(settings)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if loads and getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
                _log.warning(
                    "kv_load_failure_policy is not 'recompute': a kvtier hit that goes stale "
                    "before it is loaded (evicted, failed checksum, tier down) will fail the "
                    "request instead of recomputing it; set kv_load_failure_policy="
                    "'recompute' in --kv-transfer-config"
                )
            place = parallel_place(vllm_config, worker=False)
            self._scheduler = SchedulerSide(
                vllm_config, settings, place, runtime, loads, saves, groups
            )
        else:
            place = parallel_place(vllm_config, worker=True)
            self._worker = WorkerSide(vllm_config, settings, place, runtime, loads, saves, groups)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost KV

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise waits cannot be captured in a CUDA graph

    # -- worker side -------------------------------------------------------------------

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Saves copy blocks out synchronously on the CPU; on a GPU the copy may still be in
        # flight when a preempted request's blocks are handed to another: fence it.
        self.worker.fence_saves()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are copied out once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVTierMetadata):
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received, _ = self.worker.finished(finished_req_ids)
        return (sent or None), (received or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # With several KV cache groups a failed load is reported per request (vLLM cannot
        # map a block id back to a request then): the request recomputes its KV.
        sent, received, failed = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return None

    def get_kv_connector_kv_cache_events(self) -> KVTierKVEvents | None:
        return self._worker.take_events() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ----------------------------------------------------------------

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker's connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0:
            return {}
        out: dict[CacheHitSource, int] = {}
        for (tier, kind), tokens in self.scheduler.hit_sources(request).items():
            src = _hit_source(kind, tier)
            out[src] = out.get(src, 0) + tokens
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.loads_reported(
            getattr(connector_output, "invalid_block_ids", None),
            getattr(connector_output, "finished_recving", None),
            getattr(connector_output, "failed_recving", None),
        )
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KVTierKVEvents):
            self.scheduler.add_events(events.get_all_events())

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, (block_ids,)), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids), None

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
