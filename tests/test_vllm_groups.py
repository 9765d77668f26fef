"""The connector's view of vLLM's KV cache groups (``kvtier.integrations.vllm.groups``) and
the paged copies with several groups (``PagedKV`` with ``layer_groups``), without vLLM: the
group specs are stand-ins named like vLLM's classes, the KV tensors plain CPU tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.integrations.vllm.groups import (
    NOT_HELD,
    KVGroups,
    held_by_all,
    page_blocks,
    saveable_runs,
)
from kvtier.integrations.vllm.paged import PagedKV


def _spec(kind: str, block_size: int = 16) -> object:
    return type(kind, (), {"block_size": block_size})()


def _config(*groups: tuple[str, list[str]], block_sizes: list[int] | None = None) -> object:
    sizes = block_sizes or [16] * len(groups)
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=names, kv_cache_spec=_spec(kind, size))
            for (kind, names), size in zip(groups, sizes, strict=True)
        ]
    )


def test_one_group_or_none_is_not_hybrid() -> None:
    for cfg in (None, SimpleNamespace(kv_cache_groups=[]), _config(("MambaSpec", ["a"]))):
        groups = KVGroups.of(cfg)  # one group of any kind: vLLM's own single-group path
        assert not groups.hybrid
        assert groups.layer_groups(["a", "b"]) == [0, 0]
        assert groups.block_size == (16 if cfg and cfg.kv_cache_groups else None)
    assert KVGroups.of(_config(("FullAttentionSpec", ["a"]), ("SlidingWindowSpec", ["b"]),
                               block_sizes=[32, 32])).block_size == 32  # fmt: skip


def test_sliding_window_beside_full_attention_maps_each_layer_to_its_group() -> None:
    cfg = _config(
        ("FullAttentionSpec", ["model.layers.1.attn", "model.layers.3.attn"]),
        ("SlidingWindowSpec", ["model.layers.0.attn", "model.layers.2.attn"]),
    )
    groups = KVGroups.of(cfg)
    assert groups.hybrid and groups.count == 2
    names = [f"model.layers.{i}.attn" for i in range(4)]
    assert groups.layer_groups(names) == [1, 0, 1, 0]
    with pytest.raises(ConfigError, match=r"layers in no KV cache group: model\.layers\.9\.attn"):
        groups.layer_groups([*names, "model.layers.9.attn"])


def test_groups_the_connector_cannot_serve_are_refused_by_name() -> None:
    mamba = _config(("FullAttentionSpec", ["l0", "l2"]), ("MambaSpec", ["l1", "l3", "l5", "l7"]))
    with pytest.raises(ConfigError, match=r"group 1 \(l1, l3, l5, \.\.\.\) keeps MambaSpec"):
        KVGroups.of(mamba)
    cross = _config(("SlidingWindowSpec", ["l0"]), ("CrossAttentionSpec", ["x"]))
    with pytest.raises(ConfigError, match=r"group 1 \(x\) keeps CrossAttentionSpec"):
        KVGroups.of(cross)
    sizes = _config(
        ("FullAttentionSpec", ["a"]), ("SlidingWindowSpec", ["b"]), block_sizes=[16, 32]
    )
    with pytest.raises(ConfigError, match=r"different block sizes \(\[16, 32\]\)"):
        KVGroups.of(sizes)


def test_page_blocks_turn_the_null_block_into_not_held() -> None:
    full, window = [5, 6, 7, 8, 9], [0, 0, 0, 3, 4]  # 0: vLLM's null block
    assert page_blocks((full, window), 1, 5, null_id=0) == [
        (6, NOT_HELD),
        (7, NOT_HELD),
        (8, 3),
        (9, 4),
    ]
    assert page_blocks((full,), 0, 3, null_id=0) == [5, 6, 7]  # one group: plain ids
    assert page_blocks((window,), 0, 5, null_id=0) == [NOT_HELD] * 3 + [3, 4]
    # stops where a group's list ends
    assert page_blocks((full, window[:3]), 0, 5, null_id=0) == [(b, NOT_HELD) for b in (5, 6, 7)]
    assert page_blocks((full,), 4, 2, null_id=0) == []
    assert page_blocks((full,), 0, 2, null_id=NOT_HELD) == [5, 6]  # no null block known


def test_saveable_runs_skip_pages_some_group_does_not_hold() -> None:
    blocks = [(1, NOT_HELD), (2, 7), (3, 8), (4, NOT_HELD), (5, 9)]
    assert [held_by_all(b) for b in blocks] == [False, True, True, False, True]
    assert saveable_runs(10, blocks) == [(11, [(2, 7), (3, 8)]), (14, [(5, 9)])]
    assert saveable_runs(0, [3, 4]) == [(0, [3, 4])]
    assert saveable_runs(0, [NOT_HELD, NOT_HELD]) == []
    assert saveable_runs(0, []) == []


def _hybrid_paged(seed: int = 0, device: str = "cpu") -> tuple[list[torch.Tensor], PagedKV]:
    """Four layers over two tensors (vLLM shares each tensor between a layer of each
    group); layers 0 and 2: group 1 (sliding window), layers 1 and 3: group 0."""
    gen = torch.Generator().manual_seed(seed)
    shared = [torch.randn(10, 2, 16, 32, generator=gen).to(device) for _ in range(2)]
    layers = [shared[0], shared[0], shared[1], shared[1]]
    return shared, PagedKV(layers, [1, 0, 1, 0])


def _done(event: object) -> None:
    """Wait for a PagedKV copy: ``None`` on the CPU (done), a CUDA event on a GPU."""
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]


# On a GPU the copies run on PagedKV's side stream from pinned host buffers (vLLM's GPU
# path, which no vLLM run here has covered); on the CPU they are plain copies.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_hybrid_page_holds_each_layer_s_block_of_its_own_group(device: str) -> None:
    _, src = _hybrid_paged(1, device)
    blocks = [(2, 5), (3, 6)]  # page 0: full-attention block 2, sliding-window block 5
    pages = src.host_buffer(2)
    assert pages.device.type == "cpu" and pages.is_pinned() == (device == "cuda")
    _done(src.gather(blocks, pages))
    lb = src.layer_bytes
    for row, (full, window) in enumerate(blocks):
        for layer, block in enumerate([window, full, window, full]):
            want = src.layers[layer][block].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(pages[row, layer * lb : (layer + 1) * lb], want.cpu())

    dst_tensors, dst = _hybrid_paged(2, device)
    before = [t.clone() for t in dst_tensors]
    targets = [(7, NOT_HELD), (8, 1)]  # page 0 outside the window: its window layers skipped
    staged = dst.stage(pages, 2)
    for layer in range(4):
        _done(dst.scatter_layer(layer, targets, staged))
    for layer, tensor in enumerate(dst.layers):
        source = src.layers[layer]
        if dst.layer_groups[layer] == 0:  # full attention: both pages written
            assert torch.equal(tensor[7], source[2]) and torch.equal(tensor[8], source[3])
        else:  # sliding window: only page 1
            assert torch.equal(tensor[1], source[6])
    written = {7, 8, 1}
    for t, old in zip(dst_tensors, before, strict=True):
        for b in range(10):
            if b not in written:
                assert torch.equal(t[b], old[b]), b  # no other block touched


def test_a_page_some_group_does_not_hold_cannot_be_gathered() -> None:
    _, paged = _hybrid_paged()
    with pytest.raises(KVTierUsageError, match="block id -1"):
        paged.gather([(2, NOT_HELD)], paged.host_buffer(1))
    with pytest.raises(KVTierUsageError, match="3 layer groups given for 4 layers"):
        PagedKV(paged.layers, [0, 1, 0])
