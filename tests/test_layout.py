"""Layer-first <-> page-first conversion, run with numpy (the same code CuPy runs on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec, preset
from kvtier.transfer.layout import LayerFirstCache, as_byte_array, gather_per_chunk

TINY = preset("tiny")  # 2 layers, 2 heads, dim 8, fp16, 4 tokens
MLA = KVSpec(3, 1, 16, "float16", 4, mla=True, name="mla-tiny")


def per_layer_shape(spec: KVSpec, layout: str, blocks: int) -> tuple[int, ...]:
    tail = (spec.page_tokens, spec.num_kv_heads, spec.head_dim)
    if layout == "blocks_first":
        return (blocks, spec.kv_factor, *tail)
    return (spec.kv_factor, blocks, *tail)


def random_cache(spec: KVSpec, layout: str, blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (spec.num_layers, *per_layer_shape(spec, layout, blocks))
    return rng.integers(-1000, 1000, size=shape).astype(np.float16)


def expected_page(spec: KVSpec, stacked: np.ndarray, layout: str, block: int) -> np.ndarray:
    """The page-first blob of one block, built independently with explicit indexing."""
    page = np.empty(spec.page_shape, dtype=stacked.dtype)
    for layer in range(spec.num_layers):
        for kv in range(spec.kv_factor):
            if layout == "blocks_first":
                page[layer, kv] = stacked[layer, block, kv]
            else:
                page[layer, kv] = stacked[layer, kv, block]
    return page.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("spec", [TINY, MLA], ids=["mha", "mla"])
def test_gather_matches_explicit_page_layout(spec: KVSpec, layout: str, stacked: bool) -> None:
    data = random_cache(spec, layout, blocks=6)
    layers = data if stacked else [data[i].copy() for i in range(spec.num_layers)]
    cache = LayerFirstCache(spec, layers, layout)  # type: ignore[arg-type]
    assert cache.num_blocks == 6
    ids = [4, 0, 4, 2]
    out = np.empty((len(ids), spec.page_bytes), dtype=np.uint8)
    cache.gather(ids, out)
    for row, block in enumerate(ids):
        np.testing.assert_array_equal(out[row], expected_page(spec, data, layout, block))
    ref = np.empty_like(out)
    gather_per_chunk(cache, ids, ref)
    np.testing.assert_array_equal(out, ref)
    assert cache.launches_per_batch == (1 if stacked else spec.num_layers)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["blocks_first", "kv_first"]),
    stacked=st.booleans(),
    blocks=st.integers(1, 12),
    data=st.data(),
)
def test_scatter_inverts_gather(layout: str, stacked: bool, blocks: int, data) -> None:
    spec = TINY
    src = random_cache(spec, layout, blocks, seed=blocks)
    n = data.draw(st.integers(0, blocks))
    ids = data.draw(st.permutations(range(blocks)))[:n]
    pages = np.empty((n, spec.page_bytes), dtype=np.uint8)
    LayerFirstCache(spec, src, layout).gather(ids, pages)  # type: ignore[arg-type]

    dst_data = np.zeros_like(src)
    dst_layers = dst_data if stacked else [dst_data[i] for i in range(spec.num_layers)]
    dst = LayerFirstCache(spec, dst_layers, layout)  # type: ignore[arg-type]
    dst.scatter(ids, pages)
    for block in range(blocks):
        sl = (slice(None), block) if layout == "blocks_first" else (slice(None), slice(None), block)
        if block in ids:
            np.testing.assert_array_equal(dst_data[sl], src[sl])
        else:
            assert not dst_data[sl].any()  # untouched blocks stay zero


def test_torch_bfloat16_tensors_are_viewed_zero_copy() -> None:
    spec = KVSpec(2, 2, 8, "bfloat16", 4, name="bf16")
    t = torch.randn(spec.num_layers, 5, 2, 4, 2, 8, dtype=torch.bfloat16)
    cache = LayerFirstCache(spec, t)
    out = np.empty((1, spec.page_bytes), dtype=np.uint8)
    cache.gather([3], out)
    want = t[:, 3].contiguous().view(torch.uint8).reshape(-1).numpy()
    np.testing.assert_array_equal(out[0], want)
    # scatter writes through to the tensor's own memory
    cache.scatter([1], out)
    assert torch.equal(t[:, 1], t[:, 3])
    assert as_byte_array(t).shape[-1] == 16


def test_bad_inputs_name_the_problem() -> None:
    spec = TINY
    good = random_cache(spec, "blocks_first", 4)
    with pytest.raises(KVTierUsageError, match="dtype float32 has 4-byte elements"):
        LayerFirstCache(spec, good.astype(np.float32))
    with pytest.raises(KVTierUsageError, match="3 layers on axis 0"):
        LayerFirstCache(spec, np.concatenate([good, good[:1]]))
    with pytest.raises(KVTierUsageError, match="got 1 layer arrays"):
        LayerFirstCache(spec, [good[0]])
    with pytest.raises(KVTierUsageError, match="kv_first layout needs axis 0 of size 2"):
        LayerFirstCache(spec, good, "kv_first")
    with pytest.raises(KVTierUsageError, match="layout must be one of"):
        LayerFirstCache(spec, good, "heads_first")  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match="stacked KV array must be C-contiguous"):
        LayerFirstCache(spec, np.concatenate([good, good], axis=1)[:, ::2])
    with pytest.raises(KVTierUsageError, match="not a whole number"):
        half_blocks = spec.bytes_per_layer // spec.dtype_size * 3 // 2  # 1.5 blocks
        LayerFirstCache(spec, np.zeros((spec.num_layers, half_blocks), np.float16))

    cache = LayerFirstCache(spec, good)
    out = np.empty((2, spec.page_bytes), dtype=np.uint8)
    with pytest.raises(KVTierUsageError, match="block id 4 out of range: the cache has 4"):
        cache.gather([0, 4], out)
    with pytest.raises(KVTierUsageError, match="block id -1"):
        cache.gather([0, -1], out)
    with pytest.raises(KVTierUsageError, match="must be distinct"):
        cache.scatter([1, 1], out)
    with pytest.raises(KVTierUsageError, match="pages hold"):
        cache.gather([0], out)
    with pytest.raises(KVTierUsageError, match="must be uint8"):
        cache.gather([0, 1], out.view(np.int16))
    with pytest.raises(KVTierUsageError, match="integers"):
        cache.gather(np.array([0.0, 1.0]), out)
    with pytest.raises(KVTierUsageError, match="numpy or CuPy"):
        cache.gather([0, 1], bytearray(out.nbytes))
    with pytest.raises(KVTierUsageError, match="must be writable"):
        ro = out.copy()
        ro.flags.writeable = False
        cache.gather([0, 1], ro)
