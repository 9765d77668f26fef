"""The example server's model and kvtier configuration.

No model hub is reachable here, so the model is a Llama-shaped network with random
weights from a fixed seed: every process that builds the same size gets the same weights,
so answers are reproducible and KV cached by one run is valid for the next. Token ids are
fed directly (no tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.errors import KVTierUsageError
from kvtier.integrations.transformers import attach, spec_for_model


@dataclass(frozen=True)
class ModelSize:
    """Geometry of one random-weight model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


#: Sizes the server can build. ``tiny`` is for tests (fast on 2 cores); ``small`` for a
#: demo; ``bench`` is the benchmark's model (prefill costs real time on a CPU).
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden=64, layers=3, heads=4, kv_heads=2, intermediate=128, vocab=256),
    "small": ModelSize(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=688, vocab=1024),
    "bench": ModelSize(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=4096),
}

SEED = 20231116


def build_model(size: str, max_positions: int = 8192, seed: int = SEED) -> LlamaForCausalLM:
    """A random-weight ``LlamaForCausalLM`` of ``size`` (fp32, eval mode, no EOS so that
    greedy generation always runs ``max_new_tokens``), hooked for :class:`KVTierCache`.

    Raises :class:`KVTierUsageError` for an unknown size.
    """
    try:
        s = SIZES[size]
    except KeyError:
        raise KVTierUsageError(f"unknown model size {size!r}; known: {sorted(SIZES)}") from None
    cfg = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    attach(model)
    return model


def kvtier_config(
    model: LlamaForCausalLM,
    size: str,
    store: str | Path,
    dram_bytes: int,
    nvme_bytes: int = 4 << 30,
    page_tokens: int = 16,
    backend: str = "nvme",
) -> dict[str, Any]:
    """A DRAM -> NVMe configuration for ``model`` (namespace: the size and the seed, so
    caches of different models never mix)."""
    spec = spec_for_model(model.config, page_tokens=page_tokens, name=f"llama-random-{size}")
    options: dict[str, Any] = {"path": str(store)}
    if backend == "nvme":
        options["slab_bytes"] = 64 << 20
    return {
        "model": spec.to_dict(),
        "namespace": {"model_id": f"llama-random-{size}", "revision": f"seed{SEED}"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": dram_bytes},
            {"name": backend, "backend": backend, "capacity": nvme_bytes, "options": options},
        ],
    }
