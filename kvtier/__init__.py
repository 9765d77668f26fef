"""kvtier: a memory hierarchy for LLM KV caches.

GPU HBM -> pinned CPU DRAM -> NVMe SSD -> a remote memory pool, with an asyncio pipeline
that moves pages between tiers. See ``docs/architecture.md``.
"""

from pathlib import Path as _Path

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

# Run from a source checkout's root (``python -m kvtier`` there), this folder shadows the
# installed package, whose ``kvtier.backends`` and ``kvtier.cli`` are the checkout's
# ``backends/`` and ``cli/`` (pyproject's ``package-dir``): find them there too.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if not any((_Path(p) / "cli").is_dir() for p in __path__) and all(
    (_CHECKOUT / sub / "__init__.py").is_file() for sub in ("backends", "cli")
):
    __path__.append(str(_CHECKOUT))
