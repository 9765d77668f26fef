"""A tiny deterministic transformer stand-in whose prefill produces real KV pages.

Both sides of the hand-off import it: the prefill process to compute the KV it stores,
the test to know which bytes the decode process must end up with. The weights come from a
fixed seed, so every process computes the same KV for the same tokens (CPU, float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.spec import KVSpec

#: The toy model's cache geometry: 4 layers x 2 KV heads x 32 dims, 16 tokens per page,
#: float32 -> 32 KiB pages.
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", page_tokens=16,
              name="toy-4l")  # fmt: skip
VOCAB = 1000
HIDDEN = 64


def config(url: str, dram: str = "4MiB") -> dict[str, Any]:
    """The KVCache configuration both processes use: a small DRAM tier over the shared
    remote tier (write-through, so stored pages reach the remote pool at once)."""
    s = SPEC
    return {
        "model": {
            "num_layers": s.num_layers,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "dtype": s.dtype,
            "page_tokens": s.page_tokens,
            "name": s.name,
        },
        "namespace": {"model_id": "toy-4l", "revision": "seed-0"},
        "pipeline": {"write_policy": "write-through"},
        "log": {"format": "json", "level": "warning"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": dram},
            {
                "name": "remote",
                "backend": "redis",
                "capacity": "256MiB",
                "options": {"url": url, "key_prefix": "kvtier:toy-4l"},
            },
        ],
    }


class ToyModel(torch.nn.Module):
    """Embedding + per-layer K/V projections (+ a residual mix so layers differ)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        s = SPEC
        width = s.num_kv_heads * s.head_dim
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.wk = torch.nn.Parameter(torch.randn(s.num_layers, HIDDEN, width, generator=gen))
        self.wv = torch.nn.Parameter(torch.randn(s.num_layers, HIDDEN, width, generator=gen))
        self.mix = torch.nn.Parameter(torch.randn(s.num_layers, HIDDEN, HIDDEN, generator=gen))

    @torch.no_grad()
    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """KV pages of every full page of ``tokens``: ``[n_pages, *SPEC.page_shape]``."""
        s = SPEC
        n = len(tokens) // s.page_tokens
        h = self.embed[torch.as_tensor(tokens[: n * s.page_tokens], dtype=torch.long)]
        layers = []
        for layer in range(s.num_layers):
            k = (h @ self.wk[layer]).view(n, s.page_tokens, s.num_kv_heads, s.head_dim)
            v = (h @ self.wv[layer]).view(n, s.page_tokens, s.num_kv_heads, s.head_dim)
            layers.append(torch.stack([k, v], dim=1))  # [n, kv, tokens, heads, dim]
            h = torch.tanh(h @ self.mix[layer]) + h
        return torch.stack(layers, dim=1).contiguous().numpy()  # [n, layers, kv, t, h, d]


def prompts(count: int = 4, seed: int = 1) -> list[np.ndarray]:
    """Prompts that share a 3-page system prefix, then differ (lengths not page-aligned)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 3 * SPEC.page_tokens)
    return [
        np.concatenate([system, rng.integers(0, VOCAB, int(rng.integers(20, 90)))])
        for _ in range(count)
    ]
