"""Reference attention: agrees with torch's SDPA, gathers through tables, rejects bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.attention import attention, gather_kv, page_tensor, paged_attention
from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec

SPEC = KVSpec(2, 2, 8, "float32", 4, name="attn")


def test_attention_matches_torch_sdpa_with_gqa_and_causal_mask() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn((3, 4, 8), generator=g)
    k = torch.randn((10, 2, 8), generator=g)
    v = torch.randn((10, 2, 8), generator=g)
    out = attention(q, k, v)
    # SDPA with the same mask: query i sits at position 7 + i
    mask = torch.arange(10)[None, :] <= torch.arange(7, 10)[:, None]
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    assert torch.allclose(out, expect, atol=1e-5)
    assert not torch.allclose(attention(q, k, v, causal=False), out)


def _pages_for(k: torch.Tensor, v: torch.Tensor, slots: list[int], n_slots: int) -> torch.Tensor:
    """Scatter one layer-0 K/V into pages at ``slots`` of a pool (other slots random)."""
    pool = torch.randn((n_slots, *SPEC.page_shape))
    pt = SPEC.page_tokens
    for i, slot in enumerate(slots):
        part_k, part_v = k[i * pt : (i + 1) * pt], v[i * pt : (i + 1) * pt]
        pool[slot, 0, 0, : len(part_k)] = part_k
        pool[slot, 0, 1, : len(part_v)] = part_v
    return pool


def test_paged_attention_gathers_through_the_table_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn((10, 2, 8), generator=g), torch.randn((10, 2, 8), generator=g)
    k2, v2 = torch.randn((5, 2, 8), generator=g), torch.randn((5, 2, 8), generator=g)
    pool = _pages_for(k1, v1, [6, 2, 4], 8)
    pool[1, 0, 0, :4], pool[1, 0, 1, :4] = k2[:4], v2[:4]
    pool[7, 0, 0, :1], pool[7, 0, 1, :1] = k2[4:], v2[4:]
    table = np.array([[6, 2, 4], [1, 7, -1]], dtype=np.int32)
    q = torch.randn((2, 1, 4, 8), generator=g)
    out = paged_attention(q, pool, table, [10, 5], 0, SPEC)
    assert torch.equal(out[0], attention(q[0], k1, v1))
    assert torch.equal(out[1], attention(q[1], k2, v2))
    # the slot-getter form reads the same pages
    assert torch.equal(paged_attention(q, lambda s: pool[s], table, [10, 5], 0, SPEC), out)


def test_page_tensor_views_bytes_without_copy() -> None:
    raw = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    page = page_tensor(raw, SPEC)
    page[1, 1, 3, 1, 7] = 2.5
    assert page.shape == SPEC.page_shape
    assert raw.view(np.float32).reshape(SPEC.page_shape)[1, 1, 3, 1, 7] == 2.5
    with pytest.raises(KVTierUsageError, match="uint8 bytes"):
        page_tensor(np.zeros(3, dtype=np.uint8), SPEC)


def test_mla_latent_serves_as_k_and_v() -> None:
    mla = KVSpec(1, 1, 8, "float32", 4, mla=True, name="mla")
    pool = torch.randn((2, *mla.page_shape))
    k, v = gather_kv(pool, np.array([1], dtype=np.int32), 3, 0, mla)
    assert torch.equal(k, v) and torch.equal(k, pool[1, 0, 0, :3])


def test_bad_input() -> None:
    pool = torch.zeros((4, *SPEC.page_shape))
    q = torch.zeros((1, 1, 4, 8))
    with pytest.raises(KVTierUsageError, match="int32"):
        paged_attention(q, pool, np.zeros((1, 2), dtype=np.int64), [4], 0, SPEC)
    with pytest.raises(KVTierUsageError, match="number of sequences"):
        paged_attention(q, pool, np.zeros((2, 2), dtype=np.int32), [4, 4], 0, SPEC)
    with pytest.raises(KVTierUsageError, match="lacks a page"):
        paged_attention(q, pool, np.array([[0, -1]], dtype=np.int32), [6], 0, SPEC)
    with pytest.raises(KVTierUsageError, match="layer 2 out of range"):
        paged_attention(q, pool, np.array([[0]], dtype=np.int32), [2], 2, SPEC)
    with pytest.raises(KVTierUsageError, match="multiple of kv heads"):
        attention(torch.zeros((1, 3, 8)), torch.zeros((2, 2, 8)), torch.zeros((2, 2, 8)))
    with pytest.raises(KVTierUsageError, match="2 keys"):
        attention(torch.zeros((3, 2, 8)), torch.zeros((2, 2, 8)), torch.zeros((2, 2, 8)))
