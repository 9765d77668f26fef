"""Defaults of the configuration: environment names, watermarks by position, the
embedded default configuration (a DRAM arena over a file store in the working directory).
"""

from __future__ import annotations

from typing import Any

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"

#: Default high watermark of a tier by position: the top 0.80, the next 0.70 (the source
#: article's L1/L2 figures), lower ones 0.90 (stores have no hot working set to protect,
#: and their eviction only drops or hands down pages).
DEFAULT_HIGH_WATERMARKS: tuple[float, ...] = (0.80, 0.70)
DEFAULT_LOWER_HIGH_WATERMARK = 0.90
#: Default low watermark = high - this: evicting 10 % of a tier at a time makes batches
#: large enough to amortise transfers without emptying the tier.
DEFAULT_HYSTERESIS = 0.10

#: Where the embedded default's file store keeps pages (under the working directory).
DEFAULT_STORE_DIR = ".kvtier-cache/file"


def default_watermarks(position: int) -> tuple[float, float]:
    """(high, low) default watermarks of the tier at ``position`` (0 = top)."""
    high = (
        DEFAULT_HIGH_WATERMARKS[position]
        if position < len(DEFAULT_HIGH_WATERMARKS)
        else DEFAULT_LOWER_HIGH_WATERMARK
    )
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
