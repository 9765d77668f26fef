"""kvtier: a memory hierarchy for LLM KV caches.

GPU HBM -> pinned CPU DRAM -> NVMe SSD -> a remote memory pool, with an asyncio pipeline
that moves pages between tiers. See ``docs/architecture.md``.
"""

from kvtier.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    IntegrityError,
    KVTierError,
    KVTierUsageError,
    TierIOError,
    UnknownBackendError,
)
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.spec import PRESETS, KVSpec, adaptive_page_tokens, preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "BackendUnavailableError",
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "KVSpec",
    "KVTierError",
    "KVTierUsageError",
    "Namespace",
    "PageKey",
    "TierIOError",
    "UnknownBackendError",
    "__version__",
    "adaptive_page_tokens",
    "page_keys",
    "preset",
]
