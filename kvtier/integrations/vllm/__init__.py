"""kvtier inside vLLM: :class:`KVTierConnector`, a vLLM KV connector (``KVConnectorBase_V1``).

vLLM loads it by name from this package (``kv_connector_module_path =
"kvtier.integrations.vllm"``). The connector class is imported lazily, so the helpers in
this package (settings, lookup protocol, paged-tensor copies) import without vLLM. See
:mod:`kvtier.integrations.vllm.connector` and docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from .connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
