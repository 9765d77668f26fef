"""A KV connector that does nothing: the baseline that separates vLLM's own cost of
running *a* connector (its connector code path in the scheduler, the workers and the
engine loop) from kvtier's cost. ``benchmarks/vllm_serve.py`` runs it as a third server.
Not part of kvtier; loaded by ``kv_connector_module_path = "vllm_null_connector"`` with
``benchmarks/`` on ``PYTHONPATH``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class _Empty(KVConnectorMetadata):  # type: ignore[misc]
    pass


class NullConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Loads nothing, saves nothing, answers every lookup with 0 tokens."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _Empty()
