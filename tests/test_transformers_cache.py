"""KVTierCache on a real (small, random-weight) Llama: same tokens as DynamicCache with
pages moving to NVMe and back, prefix reuse across requests and restarts, bad input."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.errors import CapacityError, KVTierUsageError  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    KVTierBridge,
    KVTierCache,
    attach,
    spec_for_model,
)

PAGE_TOKENS = 4
VOCAB = 256


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    m = LlamaForCausalLM(cfg).eval()
    attach(m)
    return m


def config(model: LlamaForCausalLM, store: Path, dram_pages: int) -> dict[str, Any]:
    spec = spec_for_model(model.config, page_tokens=PAGE_TOKENS)
    return {
        "model": spec.to_dict(),
        "namespace": {"model_id": "test-llama-random", "revision": "seed1234"},
        # evictions finish before the next forward, so pages really go to NVMe and come
        # back (with the background evictor, a load may keep a page that is still being
        # written down in DRAM: tests/test_room.py)
        "pipeline": {"background_eviction": False},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": spec.page_bytes * dram_pages},
            {
                "name": "nvme",
                "backend": "nvme",
                "capacity": spec.page_bytes * 4000,
                "options": {"path": str(store), "slab_bytes": 1 << 22},
            },
        ],
    }


def prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def greedy(model: LlamaForCausalLM, ids: torch.Tensor, cache: Any, new: int) -> Any:
    return model.generate(
        ids,
        cache=cache,
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize("layer_prefetch", [True, False])
def test_greedy_tokens_equal_dynamic_cache_with_pages_on_nvme(
    model: LlamaForCausalLM, tmp_path: Path, layer_prefetch: bool
) -> None:
    """Several prompt lengths (under a page, a few pages, many pages) through one small
    DRAM tier: pages are pushed to NVMe and faulted back while generation runs, and every
    token equals DynamicCache's."""
    faulted = 0
    with KVTierBridge.start(config(model, tmp_path / "nvme", dram_pages=20), env={}) as bridge:
        for i, n in enumerate([3, 17, 30, 45]):
            ids = prompt(n, seed=i)
            ref = greedy(model, ids, DynamicCache(config=model.config), 24)
            with bridge.new_cache(model.config, layer_prefetch=layer_prefetch) as c:
                out = greedy(model, ids, c, 24)
                assert torch.equal(out.sequences, ref.sequences), f"prompt of {n} tokens"
                # every token the model computed KV for is cached: prompt + 23 generated
                assert c.get_seq_length() == n + 23
                assert c.tokens == ref.sequences[0, : n + 23].tolist()
                assert c.stats.pages_published == (n + 23) // PAGE_TOKENS
                faulted += c.stats.faulted_pages
        tiers = bridge.cache.metrics.snapshot()["tiers"]
    assert faulted > 0, "no page was faulted back during generation: the test lost its point"
    assert tiers["dram"]["evicted_pages"] > 0
    assert tiers["nvme"]["hits"] > 0  # pages read back from NVMe


def test_caches_dropped_without_close_give_their_slots_back(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    """A cache used like DynamicCache (no ``with``, no ``close()``) and dropped gives its
    working slot back once collected: twice as many such caches as the top tier has pages
    all run, and each still gets DynamicCache's tokens. Before, each kept a slot reserved
    and the 12-page tier refused the 12th with CapacityError."""
    dram_pages = 12
    with KVTierBridge.start(config(model, tmp_path / "nvme", dram_pages), env={}) as bridge:
        for i in range(2 * dram_pages):
            ids = prompt(6, seed=100 + i)
            ref = greedy(model, ids, DynamicCache(config=model.config), 2)
            cache = bridge.new_cache(model.config)
            out = greedy(model, ids, cache, 2)
            assert torch.equal(out.sequences, ref.sequences), f"cache {i}"
            del cache, out
            gc.collect()  # a KVTierCache is in a reference cycle with its layer views
        with bridge.new_cache(model.config) as c:
            greedy(model, prompt(6, seed=99), c, 2)
            assert c.stats.forwards == 2


def test_prefix_reuse_same_tokens_and_logits(model: LlamaForCausalLM, tmp_path: Path) -> None:
    """A second request sharing a long prefix prefills only the rest and gives the same
    tokens (and logits within float tolerance) as computing it from scratch."""
    first = prompt(41, seed=7)
    with KVTierBridge.start(config(model, tmp_path / "nvme", dram_pages=64), env={}) as bridge:
        with bridge.new_cache(model.config) as c:
            greedy(model, first, c, 8)
        follow = torch.cat([first, prompt(9, seed=8)], dim=1)  # a later turn: 41 + 9
        ref = greedy(model, follow, DynamicCache(config=model.config), 12)
        with bridge.new_cache(model.config) as c:
            reused = c.load_prefix(follow)
            assert reused == 40  # 41 cached tokens, whole pages only
            out = greedy(model, follow, c, 12)
            assert c.stats.computed_tokens == follow.shape[1] - reused + 11
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_prefix_served_from_nvme_after_restart(model: LlamaForCausalLM, tmp_path: Path) -> None:
    """The prefix survives a restart in the NVMe tier and is faulted up from there."""
    store = tmp_path / "nvme"
    ids = prompt(50, seed=11)
    with (
        KVTierBridge.start(config(model, store, dram_pages=64), env={}) as bridge,
        bridge.new_cache(model.config) as c,
    ):
        greedy(model, ids, c, 4)
        stored = c.stats.pages_published
    ref = greedy(model, ids, DynamicCache(config=model.config), 10)
    with KVTierBridge.start(config(model, store, dram_pages=64), env={}) as bridge:
        with bridge.new_cache(model.config) as c:  # sets bridge.namespace: the config's
            hit = bridge.call(bridge.cache.lookup(ids[0].tolist(), namespace=bridge.namespace))
            assert hit.cached_tokens == 48 and set(hit.tiers) == {"nvme"}
            assert stored >= len(hit.keys)
            assert c.load_prefix(ids) == 48
            out = greedy(model, ids, c, 10)
            assert c.stats.computed_tokens == 2 + 9
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        # the 12 prefix pages came up from NVMe (by load_prefix's prefetch or the fault)
        assert bridge.cache.metrics.snapshot()["links"]["nvme->dram"]["pages"] >= 12


def test_direct_forward_logits_match(model: LlamaForCausalLM, tmp_path: Path) -> None:
    """Chunked forward calls (prefill in three chunks, then single tokens) match one
    DynamicCache forward over the same tokens."""
    ids = prompt(37, seed=3)
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=model.config)).logits
    with (
        KVTierBridge.start(config(model, tmp_path / "nvme", dram_pages=32), env={}) as bridge,
        bridge.new_cache(model.config) as c,
        torch.no_grad(),
    ):
        parts = [model(ids[:, a:b], cache=c).logits for a, b in [(0, 6), (6, 22), (22, 35)]]
        parts += [model(ids[:, t : t + 1], cache=c).logits for t in (35, 36)]
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-4, atol=1e-4)


def test_bad_input_is_named(model: LlamaForCausalLM, tmp_path: Path) -> None:
    with KVTierBridge.start(config(model, tmp_path / "nvme", dram_pages=16), env={}) as bridge:
        with (
            bridge.new_cache(model.config) as c,
            pytest.raises(KVTierUsageError, match="one sequence"),
        ):
            model(prompt(8, 1).repeat(2, 1), cache=c)
        with (
            bridge.new_cache(model.config) as c,
            pytest.raises(KVTierUsageError, match="input_ids"),
        ):
            model(inputs_embeds=torch.zeros(1, 3, 64), cache=c)
        other = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        with pytest.raises(KVTierUsageError, match="does not match"):
            bridge.new_cache(other)
        c = bridge.new_cache(model.config)
        k = torch.zeros(1, 2, 1, 16)
        with pytest.raises(KVTierUsageError, match="without token ids"):
            c.update(k, k, 0)
        with pytest.raises(KVTierUsageError, match="dtype"):
            c.update(k.half(), k.half(), 0)
        with pytest.raises(KVTierUsageError, match=r"\[1, 2, tokens, 16\]"):
            c.update(torch.zeros(1, 3, 1, 16), torch.zeros(1, 3, 1, 16), 0)
        with pytest.raises(KVTierUsageError, match="must be an int"):
            c.load_prefix([1, "2", 3])
        c.close()
        with pytest.raises(KVTierUsageError, match="closed"):
            c.load_prefix([1, 2, 3])
        # a sequence longer than the top tier can hold pinned
        with bridge.new_cache(model.config) as c, pytest.raises(CapacityError):
            model.generate(prompt(100, 5), cache=c, max_new_tokens=2, do_sample=False)


async def test_bridge_refuses_the_loop_thread(model: LlamaForCausalLM, tmp_path: Path) -> None:
    """Waiting on the cache's own loop would deadlock: it raises instead."""
    from kvtier.cache import KVCache

    async with KVCache(config(model, tmp_path / "nvme", dram_pages=16), env={}) as cache:
        bridge = KVTierBridge(cache, asyncio.get_running_loop())
        with pytest.raises(KVTierUsageError, match="executor"):
            bridge.call(cache.flush())
        # new_cache() on the loop raises at once, not at the cache's first use
        with pytest.raises(KVTierUsageError, match=r"new_cache\(\) was called on the event loop"):
            bridge.new_cache(model.config)
        # from an executor thread it works
        loop = asyncio.get_running_loop()
        c: KVTierCache = await loop.run_in_executor(None, bridge.new_cache, model.config)
        got = await loop.run_in_executor(None, c.load_prefix, [1, 2, 3, 4, 5])
        assert got == 0
        await loop.run_in_executor(None, c.close)


async def test_bridge_needs_an_arena_top_tier(model: LlamaForCausalLM, tmp_path: Path) -> None:
    from kvtier.cache import KVCache

    cfg = config(model, tmp_path / "nvme", dram_pages=16)
    cfg["tiers"] = cfg["tiers"][1:]  # the NVMe store alone
    async with KVCache(cfg, env={}) as cache:
        with pytest.raises(KVTierUsageError, match="memory arena"):
            KVTierBridge(cache, asyncio.get_running_loop())
    with pytest.raises(KVTierUsageError, match="open KVCache"):
        KVTierBridge(cache, asyncio.get_running_loop())


@pytest.mark.parametrize(
    ("checkpoint", "model_id", "warned"),
    [
        ("/models/llama-a", None, True),  # the namespace names only the shape: warned
        ("/models/llama-a", "org/llama-a", False),  # named by the user
        ("/models/llama-a", "llama-a", False),  # named as the checkpoint's folder
        ("", None, False),  # no checkpoint (a model built in code): nothing to name
        ("/models/llama-b", "org/llama-a", True),  # the namespace names another one
    ],
)
def test_a_checkpoint_the_namespace_does_not_name_is_warned_about_once(
    model: LlamaForCausalLM, tmp_path: Path, checkpoint: str, model_id: str | None, warned: bool
) -> None:
    from structlog.testing import capture_logs

    cfg = config(model, tmp_path / "nvme", dram_pages=16)
    cfg["namespace"] = {} if model_id is None else {"model_id": model_id}
    model_config = LlamaConfig.from_dict(model.config.to_dict())
    model_config._name_or_path = checkpoint
    with KVTierBridge.start(cfg, env={}) as bridge, capture_logs() as logs:
        for _ in range(2):
            bridge.new_cache(model_config).close()
    events = [e for e in logs if e["event"] == "hf.namespace_not_the_checkpoint"]
    assert len(events) == (1 if warned else 0)
    if warned:
        assert events[0]["checkpoint"] == checkpoint
        assert events[0]["model_id"] == (model_id or "llama")
