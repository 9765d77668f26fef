"""A model whose layers keep different kinds of KV (sliding-window layers beside
full-attention ones, as in Gemma 2/3 or Cohere 2) with vLLM's hybrid KV cache manager on:
the connector declares ``SupportsHMA``, so vLLM keeps two KV cache groups, and a
sliding-window layer holds only the blocks of its window.

A tiny random Gemma 3 (a 32-token window, blocks of 32 tokens: a hit of ``n`` pages leaves
the window layers only the last page) gives vLLM's own greedy tokens and logprobs whether
its prompts' KV is computed or loaded from kvtier (most of it from the NVMe tier), also
beside vLLM's own prefix cache (a prompt's first pages from vLLM, the rest from kvtier), and
damaged pages are recomputed: with several groups a failed load is reported per request and
vLLM recomputes it whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_engines import (
    Engine,
    base_env,
    connector,
    dram_over_nvme,
    flip_every_slot,
    llm_kwargs,
    one_by_one,
)
from vllm_models import tiny_gemma3
from vllm_prompts import LENGTHS, prompts_for

BLOCK = 32


def test_hybrid_model_gives_vllm_s_tokens_with_kv_computed_loaded_or_damaged(
    runtime_dir: Path, tmp_path: Path
) -> None:
    model = tiny_gemma3()
    prompts = prompts_for(512, LENGTHS, seed=4)
    prefix = prompts[-1][:100]  # the 257-token prompt's first 3 pages and 4 tokens
    pages = [(len(p) - 1) // BLOCK for p in prompts]  # whole pages before the last token
    env = base_env(runtime_dir)
    # vLLM's prefix cache off: kvtier's hits are the only reuse
    base = llm_kwargs(block_size=BLOCK, enable_prefix_caching=False)
    with Engine(model, base, env, tmp_path / "ref.log") as eng:
        assert eng.ready["hybrid_kv_cache_manager"] is True  # vLLM alone: on
        ref = one_by_one(eng, [*prompts, prefix])
    ref_prefix = {k: v.pop() for k, v in ref.items()}

    store = tmp_path / "nvme"
    kv = dram_over_nvme(store, dram="80KiB", capacity="8MiB")  # a page: 32 KiB, DRAM holds 2
    llm = dict(base, kv_transfer_config=connector(kv))
    with Engine(model, llm, env, tmp_path / "kv.log") as eng:
        # without SupportsHMA vLLM turns the manager off for a connector
        assert eng.ready["hybrid_kv_cache_manager"] is True
        cold = one_by_one(eng, prompts)
        stored = eng.settled_metrics()
        warm = one_by_one(eng, prompts)
        m = eng.metrics()
    assert cold["tokens"] == ref["tokens"]
    assert cold["cached"] == [0] * len(prompts)
    assert stored["saved_pages"] >= sum(pages)
    assert warm["tokens"] == ref["tokens"]
    assert warm["cached"] == [n * BLOCK for n in pages]
    assert m["loaded_pages"] == sum(pages)
    # with two KV cache groups every hit loads across steps (see kvtier.integrations.vllm.groups)
    assert m["async_loads"] == sum(1 for n in pages if n)
    assert m.get("hit_tokens.nvme", 0) > 0
    assert m.get("load_errors", 0) == 0
    for got, want in zip(warm["logprobs"], ref["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-2)

    # A fresh engine, vLLM's prefix cache on: the prefix loads its 3 pages from kvtier
    # (vLLM keeps them), then the 257-token prompt takes them from vLLM's cache and its 5
    # other pages from kvtier, the window layers only the last.
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    kv = dram_over_nvme(copy, dram="80KiB", capacity="8MiB")
    llm = dict(base, enable_prefix_caching=True, kv_transfer_config=connector(kv))
    with Engine(model, llm, env, tmp_path / "prefix.log") as eng:
        both = one_by_one(eng, [prefix, prompts[-1]])
        m = eng.settled_metrics()
    assert both["tokens"] == [ref_prefix["tokens"], ref["tokens"][-1]]
    assert both["cached"] == [3 * BLOCK, 8 * BLOCK]
    assert m["loaded_pages"] == 3 + 5 and m.get("load_errors", 0) == 0
    for got, want in zip(both["logprobs"], [ref_prefix["logprobs"], ref["logprobs"][-1]],
                         strict=True):  # fmt: skip
        assert got == pytest.approx(want, abs=1e-2)

    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    assert flip_every_slot(damaged) > 0
    kv = dram_over_nvme(damaged, dram="80KiB", capacity="8MiB")
    with Engine(model, dict(base, kv_transfer_config=connector(kv)), env,
                tmp_path / "damaged.log") as eng:  # fmt: skip
        out = one_by_one(eng, prompts)
        m = eng.settled_metrics()
    assert out["tokens"] == ref["tokens"]
    assert m.get("loaded_pages", 0) == 0
    assert m["load_errors"] == sum(pages)
    assert out["cached"] == [0] * len(prompts)  # recomputed whole, not served from damage
