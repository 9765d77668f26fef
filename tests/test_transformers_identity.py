"""KVTierCache never serves one model's KV to another (from a docs-only probe that got
wrong tokens three ways), and misuse that broke a bridge for good is harmless now:

- pages are keyed with the digest of the model config (``bridge.namespace``), so a model
  whose config changes the KV (another ``rope_theta``) misses the pages of before a
  restart instead of reusing them (the bridge's own check saw one process only);
- a cache made for one model and passed to another model's forward is refused;
- a forward with autograd on no longer makes the shared arena need grad (every later
  gather failed with "functions with out=... arguments don't support automatic
  differentiation");
- a batch of two (beam search) is named as such, and ``new_cache`` on a closed bridge is
  refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.errors import KVTierUsageError  # noqa: E402
from kvtier.integrations.transformers import KVTierBridge, attach, spec_for_model  # noqa: E402

PAGE_TOKENS = 4
VOCAB = 256


def _llama(rope_theta: float = 10000.0) -> LlamaForCausalLM:
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=rope_theta,
    )  # fmt: skip
    m = LlamaForCausalLM(cfg).eval()
    attach(m)
    return m


def _config(model: LlamaForCausalLM, store: Path) -> dict[str, Any]:
    spec = spec_for_model(model.config, page_tokens=PAGE_TOKENS)
    return {
        "model": spec.to_dict(),
        "namespace": {"model_id": "org/probe", "revision": "r1"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": spec.page_bytes * 64},
            {"name": "nvme", "backend": "nvme", "capacity": spec.page_bytes * 512,
             "options": {"path": str(store), "slab_bytes": 1 << 22}},
        ],
    }  # fmt: skip


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model: LlamaForCausalLM, ids: torch.Tensor, cache: Any, new: int = 4) -> Any:
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)


def test_another_config_misses_the_pages_of_before_a_restart(tmp_path: Path) -> None:
    first, other = _llama(10000.0), _llama(50.0)
    ids = _ids(41, 1)
    with KVTierBridge.start(_config(first, tmp_path / "s"), env={}) as bridge:
        with bridge.new_cache(first.config) as c:
            _greedy(first, ids, c)
        assert bridge.namespace.revision.startswith("r1+hf-config.")
    with (
        KVTierBridge.start(_config(other, tmp_path / "s"), env={}) as bridge,
        bridge.new_cache(other.config) as c,
    ):
        assert c.load_prefix(ids) == 0  # before: 40 tokens of the other rope reused
        out = _greedy(other, ids, c)
    assert out.tolist() == _greedy(other, ids, DynamicCache(config=other.config)).tolist()
    with KVTierBridge.start(_config(first, tmp_path / "s"), env={}) as bridge:
        ns = bridge.namespace_for(first.config)
        assert bridge.call(bridge.cache.lookup(ids[0].tolist(), namespace=ns)).cached_tokens == 40
        with bridge.new_cache(first.config) as c:
            assert c.load_prefix(ids) == 40  # the same model after a restart still reuses


def test_a_cache_made_for_one_model_is_refused_by_another(tmp_path: Path) -> None:
    a, b = _llama(10000.0), _llama(500.0)
    with KVTierBridge.start(_config(a, tmp_path / "s"), env={}) as bridge:
        with (
            bridge.new_cache(a.config) as c,
            pytest.raises(KVTierUsageError, match="serves another model config"),
        ):
            _greedy(b, _ids(9, 2), c)
        named = LlamaConfig.from_dict(a.config.to_dict())
        named._name_or_path = "/models/a"
        with bridge.new_cache(named) as c:
            _greedy(a, _ids(9, 3), c)  # same weights, same config, unnamed: allowed
        b_named = _llama(10000.0)
        b_named.config._name_or_path = "/models/b"
        with (
            bridge.new_cache(named) as c,
            pytest.raises(KVTierUsageError, match="serves checkpoint '/models/a'"),
        ):
            _greedy(b_named, _ids(9, 4), c)


def test_a_forward_with_autograd_on_leaves_the_bridge_usable(tmp_path: Path) -> None:
    model = _llama()
    ids = _ids(21, 5)
    want = _greedy(model, ids, DynamicCache(config=model.config))
    with KVTierBridge.start(_config(model, tmp_path / "s"), env={}) as bridge:
        with bridge.new_cache(model.config) as c:
            model(ids, cache=c)  # grad mode on, as a scoring script runs it
        assert not bridge.pages.requires_grad
        with bridge.new_cache(model.config) as c:
            assert _greedy(model, ids, c).tolist() == want.tolist()


def test_beam_search_is_named_and_a_closed_bridge_refuses_new_caches(tmp_path: Path) -> None:
    model = _llama()
    with (
        KVTierBridge.start(_config(model, tmp_path / "s"), env={}) as bridge,
        bridge.new_cache(model.config) as c,
        pytest.raises(KVTierUsageError, match=r"batch of 2 \(a batch, beam search"),
        torch.no_grad(),
    ):
        model.generate(_ids(9, 6), cache=c, max_new_tokens=2, num_beams=2)
    with pytest.raises(KVTierUsageError, match="closed bridge"):
        bridge.new_cache(model.config)


def test_close_from_another_thread_mid_generation_is_a_usage_error(tmp_path: Path) -> None:
    """Before: 7 of 25 such closes surfaced as a bare AssertionError (the working slot
    gone) and 5 as "cannot schedule new futures after shutdown" (the helper thread)."""
    import random
    import threading

    model = _llama()
    rnd = random.Random(1)
    outcomes: dict[str, int] = {}
    with KVTierBridge.start(_config(model, tmp_path / "s"), env={}) as bridge:
        for i in range(12):
            cache = bridge.new_cache(model.config)
            timer = threading.Timer(rnd.uniform(0.0, 0.1), cache.close)
            timer.start()
            try:
                _greedy(model, _ids(40, 100 + i), cache, new=30)
                kind = "completed"
            except KVTierUsageError as exc:
                kind = f"KVTierUsageError: {exc}"
            timer.join()
            outcomes[kind] = outcomes.get(kind, 0) + 1
        ids = _ids(21, 5)
        with bridge.new_cache(model.config) as c:  # the bridge is still sound
            assert _greedy(model, ids, c).tolist() == _greedy(model, ids, None).tolist()
    assert set(outcomes) <= {"completed", "KVTierUsageError: this KVTierCache is closed"}


def test_a_closed_cache_given_to_generate_again_is_named_closed(tmp_path: Path) -> None:
    """A cache closed by its ``with`` block and passed to ``generate`` again was refused
    for its ``position_ids`` ("needs position_ids that continue the cached tokens (12 to
    11)"), not for being closed."""
    model = _llama()
    ids = _ids(12, 8)
    with KVTierBridge.start(_config(model, tmp_path / "s"), env={}) as bridge:
        with bridge.new_cache(model.config) as cache:
            _greedy(model, ids, cache)
        for prompt in (ids, ids[:, :5]):
            with pytest.raises(KVTierUsageError, match="this KVTierCache is closed"):
                _greedy(model, prompt, cache)
