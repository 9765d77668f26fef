"""Configuration: TOML files, ``KVTIER_*`` environment variables and Python objects.

Every value of a resolved configuration remembers where it came from (``default``,
``file:PATH``, ``python``, ``env:KVTIER_...``) so that ``kvtier inspect config`` can show
it. Layers apply in this order, later ones winning: the embedded default, then the given
source (a TOML file, a dict or a :class:`KVTierConfig`), then the environment.

The file format::

    [model]                   # a preset, optionally with field overrides, or every field
    preset = "llama3-8b"      # or: num_layers, num_kv_heads, head_dim, dtype, page_tokens,
                              #     mla, name
    [namespace]
    model_id = "meta-llama/Llama-3.1-8B"   # default: the model name
    revision = "main"
    rank = 0
    [pipeline]
    write_policy = "write-through"   # write-through | write-back | selective
    admission = "all"                # admission policy for "selective"
    batch_pages = 32                 # pages per transfer batch
    max_inflight_per_link = 4        # batches in flight per link
    leaf_first = true                # evict prefix-tree leaves before their parents
    background_eviction = true       # victims written down by the evict queue, not the caller
    [log]
    format = "console"               # console | json
    level = "info"
    [observe]
    whatif = false                   # what-if sizing per tier (stats, Prometheus)
    predictor = "none"               # live prefetch: none | prefix | lookahead | prefix+lookahead
    [[tiers]]                        # top tier first
    name = "dram"
    backend = "dram"                 # entry-point name or "module:Class"
    capacity = "4GiB"                # bytes, or a size string
    high_watermark = 0.80            # default by role: top 0.80, middle 0.70, last 0.90
    low_watermark = 0.70             # default high - 0.10
    on_open_error = "skip"           # a tier below the top that cannot open: skip | fail
    eviction = "adaptive"            # adaptive (default) | lru | lru-k | arc | hinted | ...
    [tiers.eviction_params]          # e.g. k = 2 for lru-k
    [tiers.options]                  # passed to the backend, e.g. path = "/mnt/nvme/kv"
    codec = "none"                   # store tiers: none | zstd | lz4 | fp8-e4m3 | a plugin's
    [tiers.codec_params]             # e.g. level = 3 for zstd, scale = "token" for fp8-e4m3

Environment variables use ``__`` between levels: ``KVTIER_MODEL__PRESET=llama3-70b``,
``KVTIER_PIPELINE__WRITE_POLICY=write-back``, ``KVTIER_TIERS__DRAM__CAPACITY=2GiB``
(a tier by name or by index), ``KVTIER_TIERS__FILE__OPTIONS__PATH=/tmp/kv``. Values are
parsed as TOML literals when they are one (numbers, booleans), else taken as strings.
``KVTIER_CONFIG=PATH`` names a TOML file used when no source is given. Other ``KVTIER_``
variables without ``__`` are left to other parts of kvtier, except one that starts with a
section (``KVTIER_PIPELINE_BATCH_PAGES``: a misspelt setting, refused by name).

Every mistake raises :class:`~kvtier.errors.ConfigError` naming the key (``tiers[1].capacity``)
and the source it came from.

The package: :mod:`~kvtier.config.defaults` (defaults and environment names),
:mod:`~kvtier.config.raw` (file-shaped dicts, merging, the environment layer),
:mod:`~kvtier.config.model` (the typed dataclasses and validation),
:mod:`~kvtier.config.load` (:func:`load_config`). Size units live in :mod:`kvtier.units`,
the admission registry in :mod:`kvtier.policy.admission`; both are re-exported here.
"""

from kvtier.config.defaults import (
    DEFAULT_EVICTION,
    DEFAULT_HIGH_WATERMARKS,
    DEFAULT_HYSTERESIS,
    DEFAULT_LOWER_HIGH_WATERMARK,
    DEFAULT_STORE_DIR,
    ENV_CONFIG_FILE,
    ENV_PREFIX,
    LAST_HIGH_WATERMARK,
    MAX_BATCH_PAGES,
    MAX_INFLIGHT_PER_LINK,
    MAX_PAGE_TOKENS,
    MAX_RANK,
    MIDDLE_HIGH_WATERMARK,
    ON_OPEN_ERROR,
    TOP_HIGH_WATERMARK,
    default_raw,
    default_watermarks,
)
from kvtier.config.load import default_config, load_config
from kvtier.config.model import KVTierConfig, ResolvedConfig, TierConfig
from kvtier.policy.admission import admission_names, make_admission, register_admission
from kvtier.policy.write import WRITE_POLICIES, WritePolicy
from kvtier.units import MAX_SIZE_BYTES, format_size, parse_size

__all__ = [
    "DEFAULT_EVICTION",
    "DEFAULT_HIGH_WATERMARKS",
    "DEFAULT_HYSTERESIS",
    "DEFAULT_LOWER_HIGH_WATERMARK",
    "DEFAULT_STORE_DIR",
    "ENV_CONFIG_FILE",
    "ENV_PREFIX",
    "LAST_HIGH_WATERMARK",
    "MAX_BATCH_PAGES",
    "MAX_INFLIGHT_PER_LINK",
    "MAX_PAGE_TOKENS",
    "MAX_RANK",
    "MAX_SIZE_BYTES",
    "MIDDLE_HIGH_WATERMARK",
    "ON_OPEN_ERROR",
    "TOP_HIGH_WATERMARK",
    "WRITE_POLICIES",
    "KVTierConfig",
    "ResolvedConfig",
    "TierConfig",
    "WritePolicy",
    "admission_names",
    "default_config",
    "default_raw",
    "default_watermarks",
    "format_size",
    "load_config",
    "make_admission",
    "parse_size",
    "register_admission",
]
