"""The transformers integration against models and uses that break the assumptions of
token-keyed pages (found by an audit; each case gave silently wrong tokens, a leak or a
late, misleading error before): layers that share another layer's KV (Gemma 3n), rope
scaling that depends on the sequence length, multi-query Falcon, latent attention,
attention masks with zeros, two checkpoints on one bridge, a forward interrupted midway,
a store that fails partway, and a cache closed after its bridge. Tiny random models, real
DRAM tier."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.errors import KVTierUsageError, TierIOError  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    KVTierBridge,
    attach,
    spec_for_model,
)

PT = 4
VOCAB = 256


def _llama(seed: int = 0, **extra: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, **extra)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    attach(model)
    return model


def _config(model_config: Any, pages: int = 64, model_id: str = "test-model") -> dict[str, Any]:
    spec = spec_for_model(model_config, page_tokens=PT)
    return {
        "model": spec.to_dict(),
        "namespace": {"model_id": model_id},
        "pipeline": {"background_eviction": False},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": spec.page_bytes * pages}],
    }


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model: Any, ids: torch.Tensor, cache: Any, new: int = 8) -> torch.Tensor:
    out = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
    return out[0, ids.shape[1] :]


def test_layers_that_reuse_another_layers_kv_are_not_counted() -> None:
    """Gemma 3n's last ``num_kv_shared_layers`` never call cache.update: the cache waited
    for a last layer that never came (nothing cached, each step attending to itself)."""
    config_cls = getattr(transformers, "Gemma3nTextConfig", None)
    if config_cls is None:
        pytest.skip("this transformers has no Gemma 3n")
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, laurel_rank=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, max_position_embeddings=512,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Gemma3nForCausalLM(cfg).eval()
    attach(model)
    assert spec_for_model(model.config, page_tokens=PT).num_layers == 2
    ids = _prompt(17, 1)
    want = _greedy(model, ids, DynamicCache(config=model.config), 12)
    with KVTierBridge.start(_config(model.config), env={}) as bridge:
        with bridge.new_cache(model.config) as cache:
            got = _greedy(model, ids, cache, 12)
            assert cache.get_seq_length() == 17 + 11
        assert bridge.cache.directory.pinned("dram") == 0
    assert got.tolist() == want.tolist()


def test_a_spec_that_counts_a_layer_that_writes_no_kv_is_refused_after_the_forward() -> None:
    model = _llama()
    spec = spec_for_model(model.config, page_tokens=PT)
    cfg = _config(model.config)
    cfg["model"] = dict(spec.to_dict(), num_layers=spec.num_layers + 1)  # one layer too many
    with KVTierBridge.start(cfg, env={}) as bridge, bridge.new_cache() as cache:
        with pytest.raises(KVTierUsageError, match="ended before layer 3 wrote its KV"):
            model(_prompt(9, 2), cache=cache)
        assert bridge.cache.directory.pinned("dram") == 0  # its pins were dropped


@pytest.mark.parametrize(
    ("rope", "kind"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
             "original_max_position_embeddings": 256},
            "longrope",
        ),
    ],
)  # fmt: skip
def test_rope_scaling_that_depends_on_the_length_is_refused(
    rope: dict[str, Any], kind: str
) -> None:
    """Pages computed by a short request were served to a long one (wrong tokens)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)  # fmt: skip
    # set after construction: transformers' own checks vary by version
    setattr(cfg, "rope_parameters" if hasattr(cfg, "rope_parameters") else "rope_scaling", rope)
    with pytest.raises(KVTierUsageError, match=f"'{kind}' rope scaling"):
        spec_for_model(cfg, page_tokens=PT)


def test_multi_query_falcon_has_one_kv_head() -> None:
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, multi_query=True,
                                    new_decoder_architecture=False)  # fmt: skip
    assert spec_for_model(cfg, page_tokens=PT).num_kv_heads == 1
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg).eval()
    attach(model)
    ids = _prompt(13, 3)
    want = _greedy(model, ids, DynamicCache(config=model.config))
    with (
        KVTierBridge.start(_config(model.config), env={}) as bridge,
        bridge.new_cache(model.config) as cache,
    ):
        assert _greedy(model, ids, cache).tolist() == want.tolist()


def test_latent_attention_is_refused_up_front() -> None:
    config_cls = getattr(transformers, "DeepseekV3Config", None)
    if config_cls is None:
        pytest.skip("this transformers has no DeepSeek V3")
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, kv_lora_rank=16, q_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
    with pytest.raises(KVTierUsageError, match="multi-head latent attention"):
        spec_for_model(cfg, page_tokens=PT)


@pytest.mark.parametrize("where", ["left padding", "a masked token"])
def test_an_attention_mask_with_zeros_is_refused(where: str) -> None:
    """KV depends on the mask, page keys on token ids only: pages made under one mask were
    served under another (wrong tokens)."""
    model = _llama()
    ids = _prompt(12, 4)
    mask = torch.ones_like(ids)
    mask[0, 0 if where == "left padding" else 6] = 0
    with KVTierBridge.start(_config(model.config), env={}) as bridge:
        with (
            bridge.new_cache(model.config) as cache,
            pytest.raises(KVTierUsageError, match="attention_mask of all ones"),
        ):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2)
        with bridge.new_cache(model.config) as cache:  # all ones is fine
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                           max_new_tokens=2, do_sample=False)  # fmt: skip


def test_the_mask_generate_infers_from_the_pad_token_is_refused() -> None:
    """A prompt holding the pad token: generate masks those tokens out and shifts the
    positions after them. The same ids without that mask compute other KV, and page keys
    are the ids only: pages stored under one were served under the other (wrong tokens,
    found by a docs-only probe). All ones, passed explicitly, is served and reused."""
    model = _llama(pad_token_id=0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    ids = _prompt(18, 8)
    ids[0, 3] = ids[0, 11] = 0
    ones = torch.ones_like(ids)
    with KVTierBridge.start(_config(model.config), env={}) as bridge:
        with (
            bridge.new_cache(model.config) as cache,
            pytest.raises(KVTierUsageError, match=r"attention_mask=torch\.ones_like"),
        ):
            _greedy(model, ids, cache)
        want = model.generate(ids, attention_mask=ones, cache=DynamicCache(config=model.config),
                              max_new_tokens=8, do_sample=False)  # fmt: skip
        for _ in range(2):  # the second time from the pages the first one stored
            with bridge.new_cache(model.config) as cache:
                cache.load_prefix(ids)
                out = model.generate(ids, attention_mask=ones, cache=cache, max_new_tokens=8,
                                     do_sample=False)  # fmt: skip
                assert out.tolist() == want.tolist()
        assert cache.stats.prefix_tokens == 16


def test_positions_that_do_not_continue_the_cache_are_refused() -> None:
    """position_ids 500.. gave the pages rope at other positions, and a plain request with
    the same ids then loaded them (wrong tokens)."""
    model = _llama()
    ids = _prompt(12, 5)
    with KVTierBridge.start(_config(model.config), env={}) as bridge, torch.no_grad():
        with (
            bridge.new_cache(model.config) as cache,
            pytest.raises(KVTierUsageError, match="position_ids that continue the cached"),
        ):
            model(ids, cache=cache, position_ids=torch.arange(500, 512)[None])
        with bridge.new_cache(model.config) as cache:  # the positions generate uses: fine
            model(ids, cache=cache, position_ids=torch.arange(12)[None])
            model(ids[:, :1], cache=cache, position_ids=torch.tensor([[12]]))
            assert cache.tokens == [*ids[0].tolist(), int(ids[0, 0])]


def test_another_config_of_one_checkpoint_is_refused() -> None:
    """The same checkpoint with a rope override computes other KV for the same ids: it
    loaded the plain model's pages (wrong tokens)."""
    plain = _llama()
    scaled = _llama(rope_theta=20000.0)
    plain.config._name_or_path = scaled.config._name_or_path = "org/llama"
    with KVTierBridge.start(_config(plain.config), env={}) as bridge:
        bridge.new_cache(plain.config).close()
        bridge.new_cache(_llama().config).close()  # an equal config is the same model
        with pytest.raises(KVTierUsageError, match="config differs"):
            bridge.new_cache(scaled.config)


def test_a_second_checkpoint_on_one_bridge_is_refused() -> None:
    """Two checkpoints of one shape through one bridge shared pages: wrong tokens."""
    a, b = _llama(seed=0), _llama(seed=1)
    a.config._name_or_path, b.config._name_or_path = "org/llama-a", "org/llama-b"
    with KVTierBridge.start(_config(a.config, model_id="org/llama-a"), env={}) as bridge:
        bridge.new_cache(a.config).close()
        bridge.new_cache(a.config).close()
        with pytest.raises(KVTierUsageError, match="needs its own bridge"):
            bridge.new_cache(b.config)


def test_a_forward_interrupted_midway_leaks_no_pins() -> None:
    """The next forward on the same cache overwrote the interrupted one's pins: they
    outlived the cache and the next sequence got CapacityError."""
    model = _llama()
    armed = {"on": False}

    def interrupt(module: Any, args: Any, kwargs: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt("Ctrl-C in layer 2")

    handle = model.model.layers[2].register_forward_pre_hook(interrupt, with_kwargs=True)
    try:
        ids = _prompt(32, 5)
        with KVTierBridge.start(_config(model.config, pages=24), env={}) as bridge:
            with bridge.new_cache(model.config) as cache, torch.no_grad():
                model(ids, cache=cache)  # 8 pages published
                armed["on"] = True
                with pytest.raises(KeyboardInterrupt):
                    model(ids[:, :1], cache=cache)
                model(ids[:, :1], cache=cache)
            assert bridge.cache.directory.pinned("dram") == 0
            with bridge.new_cache(model.config) as other, torch.no_grad():
                model(_prompt(4 * 17, 6), cache=other)  # 17 pages: room for them
    finally:
        handle.remove()


def test_after_a_partly_failed_store_the_cache_ends_at_its_last_stored_page() -> None:
    """The working slot kept the KV of the tokens after the pages that could not be
    stored, counted at their positions: a retry on the same cache gave wrong tokens, and
    pages of wrong KV were published. (Stand-in for a top tier that fails to commit:
    ``store_pages`` reports all but the first page of one call not stored.)"""
    model = _llama()
    ids = _prompt(30, 4)  # 7 whole pages and 2 tokens in one prefill
    want = _greedy(model, ids, DynamicCache(config=model.config))
    with KVTierBridge.start(_config(model.config), env={}) as bridge:
        real = bridge.cache.store_pages
        armed = {"on": True}

        async def failing(keys: Any, pages: Any, parents: Any = None, namespace: Any = None):  # type: ignore[no-untyped-def]
            ok = await real(keys, pages, parents=parents, namespace=namespace)
            if armed["on"] and len(ok) > 1:
                armed["on"] = False
                return ok[:1] + [False] * (len(ok) - 1)
            return ok

        bridge.cache.store_pages = failing  # type: ignore[method-assign]
        with bridge.new_cache(model.config) as cache:
            with pytest.raises(TierIOError, match="could not store pages"):
                _greedy(model, ids, cache)
            assert cache.get_seq_length() == PT  # the one stored page, nothing after it
            assert _greedy(model, ids, cache).tolist() == want.tolist()  # a retry recomputes
        with bridge.new_cache(model.config) as later:
            later.load_prefix(ids)
            assert _greedy(model, ids, later).tolist() == want.tolist()


def test_closing_a_cache_after_its_bridge_is_quiet() -> None:
    model = _llama()
    with KVTierBridge.start(_config(model.config), env={}) as bridge:
        cache = bridge.new_cache(model.config)
        with torch.no_grad():
            model(_prompt(9, 7), cache=cache)
    cache.close()  # raised "Event loop is closed"


def _tiny_llava() -> Any:
    """A random LLaVA: a 1-layer CLIP vision tower (28 x 28 images, 4 patches) over the
    tiny Llama; token 255 is the image placeholder."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1)
    model = LlavaForConditionalGeneration(cfg).eval()
    attach(model)
    return model


def test_a_forward_with_an_image_is_refused_naming_the_input() -> None:
    """An image sits behind placeholder ids that are the same whatever the image: pages
    keyed by token ids would serve one image's KV for another. Before, the first request
    stored such pages, and a second image whose prefix they covered failed inside LLaVA
    ("Image features and image tokens do not match"); a model without that check would
    have answered about the first image. Text-only requests on the same model still work."""
    model = _tiny_llava()
    text_config = model.config.text_config
    with_image = torch.tensor([[1, 2, 3, 4] + [VOCAB - 1] * 4 + [5, 6, 7, 8, 9]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    text_only = _prompt(12, 3) % (VOCAB - 2) + 1  # no placeholder
    want = _greedy(model, text_only, DynamicCache(config=text_config))
    with KVTierBridge.start(_config(text_config), env={}) as bridge:
        with (
            bridge.new_cache(text_config) as cache,
            pytest.raises(KVTierUsageError, match="keys pages by token ids only: this forward"),
        ):
            model.generate(with_image, pixel_values=pixels, cache=cache, max_new_tokens=2,
                           do_sample=False)  # fmt: skip
        for _ in range(2):  # the second time from the pages the first one stored
            with bridge.new_cache(text_config) as cache:
                cache.load_prefix(text_only)
                assert _greedy(model, text_only, cache).tolist() == want.tolist()
        assert cache.stats.prefix_tokens == 8
