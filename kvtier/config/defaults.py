"""Defaults of the configuration: environment names, watermarks by position, the
embedded default configuration (a DRAM arena over a file store in the working directory).
"""

from __future__ import annotations

from typing import Any

ENV_PREFIX = "KVTIER_"

#: A tier's eviction policy when its config names none: ``adaptive`` (two-class recency
#: tuned online by miniature caches, with prefix cuts; docs/benchmarks.md "Policy suite").
#: It exposes one lazy order, so leaf-first eviction walks it once; its miniatures make its
#: bookkeeping 2.1-5.2x ``lru-k``'s per stored or faulted page since its ``interval``
#: expert (benchmarks/control_plane.py; ``lru-k`` is the cheap choice).
DEFAULT_EVICTION = "adaptive"
ENV_CONFIG_FILE = "KVTIER_CONFIG"

#: Default high watermarks by role (design guide, "watermarks by role"): the top tier evicts
#: early (0.80, the source article's L1 figure), middle tiers at 0.70 (its L2 figure), the
#: last tier fills to 0.90 (nothing below it to spill to: its eviction only drops pages).
#: A single tier is the top tier.
TOP_HIGH_WATERMARK = 0.80
MIDDLE_HIGH_WATERMARK = 0.70
LAST_HIGH_WATERMARK = 0.90
DEFAULT_HIGH_WATERMARKS: tuple[float, ...] = (TOP_HIGH_WATERMARK, MIDDLE_HIGH_WATERMARK)
DEFAULT_LOWER_HIGH_WATERMARK = LAST_HIGH_WATERMARK
#: Upper bounds of pipeline settings (beyond them a value is a mistake).
MAX_BATCH_PAGES = 1 << 20
MAX_INFLIGHT_PER_LINK = 1 << 10
#: Upper bound of ``model.page_tokens``: engines use pages of 16 to 256 tokens; beyond
#: 65536 a page of any real model is gigabytes, a mistake rather than a page size.
MAX_PAGE_TOKENS = 1 << 16
#: Upper bound of ``namespace.rank`` (the namespace's 32-bit signed range).
MAX_RANK = 2**31 - 1
#: What a tier that cannot open does: ``fail`` raises from ``KVCache.start``; ``skip``
#: logs an error and the cache runs without it (only below the top tier).
ON_OPEN_ERROR = ("skip", "fail")
#: Default low watermark = high - this: evicting 10 % of a tier at a time makes batches
#: large enough to amortise transfers without emptying the tier.
DEFAULT_HYSTERESIS = 0.10

#: Where the embedded default's file store keeps pages (under the working directory).
DEFAULT_STORE_DIR = ".kvtier-cache/file"


def default_watermarks(position: int, count: int | None = None) -> tuple[float, float]:
    """(high, low) default watermarks of the tier at ``position`` (0 = top) of ``count``
    tiers, by role: top, middle or last (see :data:`TOP_HIGH_WATERMARK`). Without
    ``count`` every tier below the second counts as last (the former rule by position)."""
    if position == 0:
        high = TOP_HIGH_WATERMARK
    elif (count is not None and position == count - 1) or (count is None and position >= 2):
        high = LAST_HIGH_WATERMARK
    else:
        high = MIDDLE_HIGH_WATERMARK
    return high, round(high - DEFAULT_HYSTERESIS, 6)


def default_raw() -> dict[str, Any]:
    """The embedded default: no GPU, a DRAM arena over a file store in the working dir."""
    return {
        "model": {"preset": "llama3-8b"},
        "namespace": {"revision": "main", "rank": 0},
        "pipeline": {
            "write_policy": "write-through",
            "admission": "all",
            "admission_params": {},
            "batch_pages": 32,
            "max_inflight_per_link": 4,
            "leaf_first": True,
            "background_eviction": True,
        },
        "log": {"format": "console", "level": "info"},
        "observe": {"whatif": False, "predictor": "none"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "512MiB"},
            {
                "name": "file",
                "backend": "file",
                "capacity": "4GiB",
                "options": {"path": DEFAULT_STORE_DIR},
            },
        ],
    }
