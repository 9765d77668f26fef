"""The page model: the geometry of one model's KV cache and the size of its pages.

A *page* holds ``page_tokens`` tokens of KV for every layer. Per layer it takes
``kv_heads x head_dim x page_tokens x 2 x dtype_size`` bytes (K and V); a model with
multi-head latent attention (MLA, DeepSeek) stores one compressed latent per token instead
of K and V, so the factor 2 drops out and ``kv_heads`` is 1 with ``head_dim`` the latent
width. Lower tiers store pages page-first: one contiguous blob of all layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KVTierUsageError

#: Bytes per element of each KV dtype kvtier knows, by canonical name.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(dtype: str) -> str:
    """Return the canonical name of a KV dtype, accepting common aliases and torch names.

    Raises :class:`KVTierUsageError` naming the dtype when it is not known.
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_SIZES:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise KVTierUsageError(f"unknown KV dtype {dtype!r}; known: {known}")
    return name


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise KVTierUsageError(f"KVSpec.{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class KVSpec:
    """Geometry of one model's KV cache.

    Attributes:
        num_layers: attention layers that keep KV.
        num_kv_heads: KV heads per layer (after GQA); 1 for MLA.
        head_dim: elements per head and token (the latent width for MLA).
        dtype: canonical dtype name (see :data:`DTYPE_SIZES`).
        page_tokens: tokens per page.
        mla: multi-head latent attention: one latent per token, not K and V.
        name: a label for display.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_tokens: int = 16
    mla: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            object.__setattr__(self, field, _positive(field, getattr(self, field)))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not isinstance(self.mla, bool):
            raise KVTierUsageError(f"KVSpec.mla must be a bool, got {self.mla!r}")

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V, 1 for an MLA latent."""
        return 1 if self.mla else 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of KV one token takes in one layer."""
        return self.num_kv_heads * self.head_dim * self.kv_factor * self.dtype_size

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of one page in one layer: ``kv_heads x head_dim x page_tokens x 2 x size``."""
        return self.bytes_per_token_per_layer * self.page_tokens

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (the unit stored on L2-L4)."""
        return self.bytes_per_layer * self.num_layers

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Logical shape of one page-first blob: ``[layers, kv, page_tokens, heads, dim]``."""
        return (
            self.num_layers,
            self.kv_factor,
            self.page_tokens,
            self.num_kv_heads,
            self.head_dim,
        )

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens (the last may be partial)."""
        if num_tokens < 0:
            raise KVTierUsageError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_tokens)

    def with_page_tokens(self, page_tokens: int) -> KVSpec:
        """The same model with another page size."""
        return dataclasses.replace(self, page_tokens=page_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for JSON and config files)."""
        return dataclasses.asdict(self)


#: Geometry of common models. KV dtype bfloat16, 16-token pages unless stated.
PRESETS: dict[str, KVSpec] = {
    "llama3-8b": KVSpec(32, 8, 128, "bfloat16", 16, name="llama3-8b"),
    "llama3-70b": KVSpec(80, 8, 128, "bfloat16", 16, name="llama3-70b"),
    "qwen3-32b": KVSpec(64, 8, 128, "bfloat16", 16, name="qwen3-32b"),
    # DeepSeek-V3: MLA latent of kv_lora_rank 512 + rope dim 64 = 576 per token and layer.
    "deepseek-v3": KVSpec(61, 1, 576, "bfloat16", 16, mla=True, name="deepseek-v3"),
    # The source article's example: 128 heads x 512 dim, 16 tokens, fp16 -> 4 MiB per
    # layer per page. One layer, so one page is exactly 4 MiB (the I/O benchmark's unit).
    "article-example": KVSpec(1, 128, 512, "float16", 16, name="article-example"),
    # A tiny geometry for tests and laptops.
    "tiny": KVSpec(2, 2, 8, "float16", 4, name="tiny"),
}


def preset(name: str) -> KVSpec:
    """Return the preset ``name``; raises :class:`KVTierUsageError` listing known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise KVTierUsageError(f"unknown KVSpec preset {name!r}; known: {known}") from None


def adaptive_page_tokens(context_tokens: int) -> int:
    """The source article's adaptive page size for a context length.

    <= 8K tokens: 16; 32K-128K: 32; >= 128K: 64. The article leaves 8K-32K open; kvtier
    uses 32 there (past 8K, fewer larger pages cut block-table and transfer overhead).
    """
    if isinstance(context_tokens, bool) or context_tokens < 0:
        raise KVTierUsageError(f"context length must be >= 0 tokens, got {context_tokens!r}")
    if context_tokens <= 8 * 1024:
        return 16
    if context_tokens < 128 * 1024:
        return 32
    return 64
