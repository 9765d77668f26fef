"""An nvme tier never takes more disk than its configured capacity.

A page on disk is a slot: its payload, a 64-byte header and the padding to 4 KiB
(:class:`~kvtier.backends.nvme_layout.SlotLayout`). The tier's capacity is counted in
those slots (``NvmeStore.page_footprint``), and the last slab file the capacity reaches
holds only the slots left (growing when a reopen brings more capacity).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_layout import BLOCK, SlotLayout

from kvtier.codec import slot_bytes
from kvtier.codec.registry import make_codec
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.keys import PageKey
from kvtier.spec import preset
from kvtier.tier_check import create_backend

TINY = preset("tiny")  # 512-byte pages


def _key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def _page(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def _disk(root: Path) -> tuple[int, int]:
    """``(apparent bytes, allocated bytes)`` of the store's slab files."""
    files = [p for p in (root / "slabs").iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


def _config(path: Path, capacity: int, **tier: Any) -> dict[str, Any]:
    nvme = {"name": "nvme", "backend": "nvme", "capacity": capacity,
            "options": {"path": str(path), "engine": "posix"}}  # fmt: skip
    nvme.update(tier)
    return {
        "model": {"preset": "tiny"},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": 8 * TINY.page_bytes}, nvme],
    }


async def test_a_full_tier_of_small_pages_takes_at_most_its_capacity(tmp_path: Path) -> None:
    # 512-byte pages take 4 KiB slots: 64 KiB of capacity hold 16 of them, not 128.
    root = tmp_path / "nvme"
    config = load_config(_config(root, 64 * 1024), env={}).config
    backend = create_backend(config, 1)
    assert backend.capacity_pages == 16 == 64 * 1024 // BLOCK
    assert isinstance(backend, NvmeStore)
    async with backend:
        keys = [_key(i) for i in range(17)]
        done = await backend.put(keys, [_page(i, 512) for i in range(17)])
        assert done == [True] * 16 + [False]  # the 17th finds the tier full
        apparent, allocated = _disk(root)
        assert apparent <= 64 * 1024 and allocated <= 64 * 1024
        outs = [np.empty(512, np.uint8) for _ in range(16)]
        assert await backend.get(keys[:16], outs) == [True] * 16
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, _page(i, 512))


async def test_the_last_slab_holds_only_the_slots_left_and_grows_with_the_capacity(
    tmp_path: Path,
) -> None:
    page = 3 * BLOCK + 100  # a 16 KiB slot
    slot = SlotLayout(page, 1).slot_bytes
    root = tmp_path / "s"

    def store(capacity_pages: int) -> NvmeStore:
        return NvmeStore(page_bytes=page, capacity_pages=capacity_pages, path=root,
                         engine="posix", slab_bytes=3 * slot)  # fmt: skip

    assert NvmeStore.capacity_pages_for(10 * slot + 5000, page) == 10
    # 10 slots: slabs of 3, 3, 3 and a last one of 1 slot, not 3.
    async with store(10) as first:
        assert await first.put([_key(i) for i in range(10)], [_page(i, page) for i in range(10)])
        assert _disk(root)[0] == 10 * slot
        assert first.stats()["slabs"] == 4
    # Reopened with room for 14: the short slab grows to 3 slots, the next one has 2.
    async with store(14) as grown:
        new = [_key(i) for i in range(10, 14)]
        assert await grown.put(new, [_page(i, page) for i in range(10, 14)]) == [True] * 4
        assert _disk(root)[0] == 14 * slot
        outs = [np.empty(page, np.uint8) for _ in range(14)]
        assert await grown.get([_key(i) for i in range(14)], outs) == [True] * 14
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, _page(i, page))
    # Reopened with room for 5: nothing committed is lost, nothing more is taken.
    async with store(5) as shrunk:
        outs = [np.empty(page, np.uint8) for _ in range(14)]
        assert await shrunk.get([_key(i) for i in range(14)], outs) == [True] * 14
        assert await shrunk.put([_key(99)], [_page(99, page)]) == [False]
        assert _disk(root)[0] == 14 * slot


def test_a_capacity_below_one_slot_is_named_with_what_a_page_takes(tmp_path: Path) -> None:
    # 1 KiB is two 512-byte pages, but not one 4 KiB slot.
    config = load_config(_config(tmp_path / "n", 1024), env={}).config
    with pytest.raises(
        ConfigError,
        match=r"tiers\[1\]\.capacity \(nvme\): capacity 1024 bytes holds no page of 512 "
        r"bytes \(on 'nvme' one takes 4096 bytes\)",
    ):
        create_backend(config, 1)


def test_memory_and_coded_tiers_count_their_own_footprint(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path / "n", 64 * 1024), env={}).config
    assert create_backend(config, 0).capacity_pages == 8  # dram: a slot is the page
    assert config.tiers[0].capacity_pages(TINY.page_bytes) == 8
    assert config.tiers[1].capacity_pages(TINY.page_bytes) == 16
    coded = load_config(_config(tmp_path / "z", 64 * 1024, codec="zstd"), env={}).config
    slot = slot_bytes(make_codec("zstd", TINY))  # the frame and a raw page, over 512
    on_disk = SlotLayout(slot, 1).slot_bytes
    assert on_disk == BLOCK  # still one 4 KiB slot with its header
    assert create_backend(coded, 1).capacity_pages == 64 * 1024 // on_disk


def test_a_plugin_footprint_below_the_page_is_named_as_its_bug() -> None:
    class Broken(NvmeStore):
        @classmethod
        def page_footprint(cls, page_bytes: int) -> int:
            return 0

    with pytest.raises(KVTierError, match=r"Broken\.page_footprint\(512\) gave 0: a backend bug"):
        Broken.capacity_pages_for(1 << 20, 512)
