"""An MLA model (multi-head latent attention, as DeepSeek-V2/V3 and Kimi K2): vLLM caches
one latent per token (``[num_blocks, 1, block_size, 576]`` per layer), and kvtier stores and
loads those blocks like any other. A tiny random DeepSeek-V2 on vLLM's CPU MLA backend
gives vLLM's own greedy tokens and logprobs whether its prompts' latents are computed or
loaded from kvtier (most of them from the NVMe tier: the DRAM tier holds two pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engines import Engine, base_env, connector, dram_over_nvme, llm_kwargs, one_by_one
from vllm_models import tiny_deepseek_v2
from vllm_prompts import LENGTHS, prompts_for

#: vLLM's CPU MLA kernel takes blocks of 16 tokens only
MLA_BLOCK = 16


def test_mla_model_gives_vllm_s_tokens_with_latents_computed_and_loaded(
    runtime_dir: Path, tmp_path: Path
) -> None:
    model = tiny_deepseek_v2()
    prompts = prompts_for(512, LENGTHS, seed=3)
    env = base_env(runtime_dir)
    # float32: a loaded hit's tokens are computed against cached latents (vLLM's MLA
    # context path; vLLM-CPU turns its own prefix cache off for MLA, so only kvtier's hits
    # take it here), whose rounding differs from a whole prefill's. In bfloat16 that moved
    # logprobs by up to 0.004 and flipped 2 of 56 greedy tokens at near-ties; in float32
    # no token flips.
    base = llm_kwargs(block_size=MLA_BLOCK, enable_prefix_caching=False, dtype="float32")

    with Engine(model, base, env, tmp_path / "ref.log") as eng:
        ref = one_by_one(eng, prompts)
    kv = dram_over_nvme(tmp_path / "nvme", dram="160KiB", capacity="8MiB")  # a page: 72 KiB
    with Engine(model, dict(base, kv_transfer_config=connector(kv)), env,
                tmp_path / "kv.log") as eng:  # fmt: skip
        cold = one_by_one(eng, prompts)
        stored = eng.settled_metrics()
        warm = one_by_one(eng, prompts)
        m = eng.metrics()
    pages = [(len(p) - 1) // MLA_BLOCK for p in prompts]  # whole pages before the last token
    assert cold["tokens"] == ref["tokens"]
    assert cold["cached"] == [0] * len(prompts)
    assert stored["saved_pages"] >= sum(pages)
    assert warm["tokens"] == ref["tokens"]
    assert warm["cached"] == [n * MLA_BLOCK for n in pages]
    assert m["loaded_pages"] == sum(pages)
    assert m.get("hit_tokens.nvme", 0) > 0
    assert m.get("load_errors", 0) == 0
    for got, want in zip(warm["logprobs"], ref["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-2)
