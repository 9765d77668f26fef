"""Requests whose KV is more than their token ids, in a real engine: a LoRA adapter, a
cache salt and prompt embeddings are keyed in namespaces of their own (reused among
themselves, never across), prompt-embedding pages by their embeddings. Before, a
prompt-embeds request loaded the KV of another one of the same length (vLLM gives both
placeholder token ids) and a LoRA request loaded the base model's KV: both answered
wrongly; a salted request loaded another tenant's KV. Greedy tokens must equal vLLM alone
(no connector, no prefix cache) for every request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from vllm_engines import Engine, base_env, connector, llm_kwargs

BLOCK = 32
PROMPT = 300  # 9 whole pages; 9 x 32 = 288 tokens can come from kvtier


def _adapter(model: Path, out: Path) -> Path:
    """A rank-8 LoRA adapter on k_proj and v_proj (it changes the KV) for ``model``."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, hidden, generator=g) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv, 8, generator=g) * 0.2
    out.mkdir()
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, out / "adapter_model.safetensors"
    )
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"],
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
        "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None,
    }))  # fmt: skip
    return out


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + j * 613 + (j * j) % 97) % 500 + 3 for j in range(PROMPT)]


def test_lora_salted_and_embedded_prompts_get_their_own_kv(
    tiny_model: Path, runtime_dir: Path, tmp_path: Path
) -> None:
    lora = ["kv-lora", 1, str(_adapter(tiny_model, tmp_path / "adapter"))]
    x, y = _prompt(1), _prompt(2)
    x_head = x[:200] + _prompt(3)[200:]  # x's first 6 whole pages (192 tokens), then others
    embeds = {"embeds": True}
    # (name, prompt, extras): one request per generate call, in this order
    steps: list[tuple[str, list[int], dict[str, Any] | None]] = [
        ("embeds x", x, embeds),
        ("embeds y", y, embeds),  # same length as x: same placeholder ids
        ("embeds x again", x, embeds),
        ("embeds x head", x_head, embeds),  # shares x's embeddings for 6 pages
        ("x", x, None),  # the same KV as "embeds x" (its rows are x's), another namespace
        ("x lora", x, {"lora": lora}),  # must not load the base model's KV of x
        ("x lora again", x, {"lora": lora}),
        ("x again", x, None),
        ("y salt a", y, {"cache_salt": "tenant-a"}),
        ("y salt b", y, {"cache_salt": "tenant-b"}),  # must not load tenant a's KV
        ("y salt a again", y, {"cache_salt": "tenant-a"}),
    ]
    common = {
        "enable_prompt_embeds": True,
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 1,
        "enable_prefix_caching": False,  # every hit comes from kvtier
    }
    kv = {
        "tiers": [{"name": "dram", "backend": "dram", "capacity": "8MiB"}],
        "log": {"level": "warning"},
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for label, extra in (("alone", {}), ("kvtier", {"kv_transfer_config": connector(kv)})):
        llm = llm_kwargs(**common, **extra)
        log = tmp_path / f"{label}.log"
        with Engine(tiny_model, llm, base_env(runtime_dir), log) as eng:
            results[label] = [eng.generate([p], 8, extras=[e]) for _, p, e in steps]
            if label == "kvtier":
                metrics = eng.settled_metrics()
    names = [name for name, _, _ in steps]
    tokens = {k: [r["tokens"][0] for r in v] for k, v in results.items()}
    same = [n for n, a, b in zip(names, tokens["kvtier"], tokens["alone"], strict=True) if a == b]
    assert same == names
    cached = [r["cached"][0] for r in results["kvtier"]]
    hits = {"embeds x again": 288, "embeds x head": 192, "x lora again": 288, "x again": 288,
            "y salt a again": 288}  # fmt: skip
    assert dict(zip(names, cached, strict=True)) == {n: hits.get(n, 0) for n in names}
    assert metrics.get("unkeyed_requests", 0) == 0 and metrics.get("load_errors", 0) == 0
