"""Lossless codecs under a real (small, random-weight) Llama: with pages pushed through a
zstd file tier and an lz4 NVMe tier and faulted back during generation, the greedy tokens
equal DynamicCache's and the logits equal those of tiers without a codec, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.integrations.transformers import KVTierBridge, attach, spec_for_model  # noqa: E402

PAGE_TOKENS = 4
VOCAB = 256


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(4321)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    m = LlamaForCausalLM(cfg).eval()
    attach(m)
    return m


def _config(
    model: LlamaForCausalLM, root: Path, file_codec: str, nvme_codec: str
) -> dict[str, Any]:
    spec = spec_for_model(model.config, page_tokens=PAGE_TOKENS)
    return {
        "model": spec.to_dict(),
        "namespace": {"model_id": "test-llama-codec"},
        # evictions done before each forward returns: both runs hold the same pages at the
        # same steps (the background evictor's timing would vary which prefix hits)
        "pipeline": {"write_policy": "write-back", "background_eviction": False},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": spec.page_bytes * 20},
            {"name": "file", "backend": "file", "capacity": spec.page_bytes * 5,
             "codec": file_codec, "options": {"path": str(root / "file")}},
            {"name": "nvme", "backend": "nvme", "capacity": spec.page_bytes * 400,
             "codec": nvme_codec, "options": {"path": str(root / "nvme"), "slab_bytes": 1 << 22}},
        ],
    }  # fmt: skip


def _run(model: LlamaForCausalLM, cfg: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
    """Three prompts, then the first again with its prefix loaded from the lower tiers."""
    kwargs = {"max_new_tokens": 20, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True}  # fmt: skip
    prompts = [
        torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(i))
        for i, n in enumerate([17, 30, 45])
    ]
    outs, faulted = [], 0
    with KVTierBridge.start(cfg, env={}) as bridge:
        for ids in [*prompts, prompts[0]]:
            with bridge.new_cache(model.config) as c:
                c.load_prefix(ids)
                outs.append(model.generate(ids, cache=c, **kwargs))
                faulted += c.stats.faulted_pages
        tiers = {t["name"]: t for t in bridge.cache.stats()["tiers"]}
    refs = [model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
            for ids in [*prompts, prompts[0]]]  # fmt: skip
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out.sequences, ref.sequences)
    return outs, faulted, tiers


def test_lossless_codec_tiers_give_the_same_tokens_and_logits_bit_for_bit(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    """Pages go down through a zstd file tier and an lz4 NVMe tier, are faulted back
    during generation and reused as a prefix: tokens equal DynamicCache's, and every logit
    equals, bit for bit, the same run on tiers without a codec."""
    plain, _, _ = _run(model, _config(model, tmp_path / "plain", "none", "none"))
    coded, faulted, tiers = _run(model, _config(model, tmp_path / "coded", "zstd", "lz4"))
    assert faulted > 0, "no page was faulted back: the test lost its point"
    for a, b in zip(plain, coded, strict=True):
        assert torch.equal(a.sequences, b.sequences)
        for x, y in zip(a.logits, b.logits, strict=True):
            assert torch.equal(x, y)
    for name in ("file", "nvme"):
        backend = tiers[name]["backend_stats"]
        assert backend["decoded_pages"] > 0, f"no page came back through the {name} codec"
        assert backend["frame_failures"] == 0
