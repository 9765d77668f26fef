"""The NVMe store: two-phase puts, verified reads, reuse, capacity, restart, layout."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_engines import kvikio_unavailable_reason
from kvtier.backends.nvme_index import INDEX_FILE, StoreIndex
from kvtier.backends.nvme_layout import BLOCK, SlotLayout, aligned_empty, is_aligned
from structlog.testing import capture_logs

from kvtier.errors import BackendUnavailableError, ConfigError, KVTierUsageError
from kvtier.keys import PageKey

# An odd page size (not a multiple of 4 KiB) exercises the body/tail split.
PAGE = 3 * BLOCK + 100


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def store(path: Path, capacity: int = 32, **opts: object) -> NvmeStore:
    opts.setdefault("slab_bytes", 8 * (PAGE + BLOCK))
    return NvmeStore(page_bytes=PAGE, capacity_pages=capacity, path=path, engine="posix", **opts)  # type: ignore[arg-type]


@pytest.mark.parametrize("direct_io", ["auto", False])
async def test_put_get_roundtrip(tmp_path: Path, direct_io: object) -> None:
    async with store(tmp_path / "s", direct_io=direct_io) as s:
        keys = [key(i) for i in range(20)]
        assert await s.put(keys, [page(i) for i in range(20)], namespace="ns-a") == [True] * 20
        outs = [np.empty(PAGE, np.uint8) for _ in keys]
        assert await s.get(keys, outs) == [True] * 20
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, page(i))
        # Aligned caller buffers take the zero-copy body path.
        aligned = [aligned_empty(PAGE) for _ in range(3)]
        assert all(is_aligned(a) for a in aligned)
        assert await s.get(keys[:3], aligned) == [True] * 3
        np.testing.assert_array_equal(aligned[2], page(2))
        assert await s.exists([*keys, key(99)]) == 20
        assert sorted(await s.keys()) == sorted(keys)
        st = s.stats()
        assert st["committed_pages"] == 20 and st["engine"] == "posix"
        assert st["direct_io"] is (direct_io == "auto" and s.direct_reason is None)
        # 20 pages, 8 per slab -> 3 slab files.
        assert st["slabs"] == 3


async def test_uncommitted_is_invisible_and_abort_frees(tmp_path: Path) -> None:
    async with store(tmp_path / "s", capacity=4) as s:
        res = await s.reserve([key(1), key(2)])
        assert all(r is not None for r in res)
        reservations = [r for r in res if r is not None]
        assert await s.write(reservations, [page(1), page(2)]) == [True, True]
        assert await s.contains([key(1), key(2)]) == [False, False]
        assert await s.get([key(1)], [np.empty(PAGE, np.uint8)]) == [False]
        assert s.used_pages() == 2
        await s.abort(reservations[1:])
        assert s.used_pages() == 1
        assert await s.commit(reservations) == [True, False]
        assert await s.contains([key(1), key(2)]) == [True, False]


async def test_capacity_is_honoured_and_slots_reused(tmp_path: Path) -> None:
    async with store(tmp_path / "s", capacity=5) as s:
        ok = await s.put([key(i) for i in range(8)], [page(i) for i in range(8)])
        assert ok == [True] * 5 + [False] * 3
        assert s.used_pages() == 5
        assert await s.delete([key(0), key(1), key(42)]) == [True, True, False]
        assert await s.put([key(10), key(11)], [page(10), page(11)]) == [True, True]
        # Reused slots: the store never grew past its capacity.
        rows, _ = StoreIndex(tmp_path / "s" / INDEX_FILE, readonly=True).load()
        assert max(r.slot for r in rows) == 4
        out = np.empty(PAGE, np.uint8)
        assert await s.get([key(10)], [out]) == [True]
        np.testing.assert_array_equal(out, page(10))


async def test_put_of_committed_key_is_noop_and_duplicates_in_batch(tmp_path: Path) -> None:
    async with store(tmp_path / "s", capacity=8) as s:
        assert await s.put([key(1), key(1)], [page(1), page(1)]) == [True, True]
        assert s.used_pages() == 1
        assert await s.put([key(1)], [page(1)]) == [True]
        assert s.used_pages() == 1
    # A key repeated in one batch takes one slot: it fits a store with room for one page.
    async with store(tmp_path / "one", capacity=1) as s:
        assert await s.put([key(5), key(5), key(5)], [page(5)] * 3) == [True] * 3
        assert s.used_pages() == 1
        out = np.empty(PAGE, np.uint8)
        assert await s.get([key(5)], [out]) == [True]
        np.testing.assert_array_equal(out, page(5))


async def test_concurrent_commits_are_grouped(tmp_path: Path) -> None:
    async with store(tmp_path / "s", capacity=64) as s:
        batches = [[key(b * 8 + i) for i in range(8)] for b in range(6)]
        reserved = []
        for ks in batches:  # written first, so all six commits are queued at once
            rs = await s.reserve(ks)
            assert all(r is not None for r in rs)
            await s.write(rs, [page(int.from_bytes(k, "little")) for k in ks])
            reserved.append(rs)
        res = await asyncio.gather(*(s.commit(rs) for rs in reserved))
        assert all(all(r) for r in res)
        st = s.stats()
        assert st["pages_committed"] == 48
        # Six commit calls queued in the same loop step share one fsync+transaction round.
        assert st["group_commits"] == 1


async def test_reopen_recovers_committed_pages(tmp_path: Path) -> None:
    async with store(tmp_path / "s") as s:
        await s.put([key(i) for i in range(10)], [page(i) for i in range(10)], namespace="n1")
        await s.delete([key(3)])
        res = await s.reserve([key(50)])
        r = res[0]
        assert r is not None
        await s.write([r], [page(50)])  # written, never committed
    async with store(tmp_path / "s") as s:
        assert s.stats()["recovered_pages"] == 9
        assert s.stats()["recovery_seconds"] > 0
        present = await s.contains([key(i) for i in range(10)] + [key(50)])
        assert present == [i != 3 for i in range(10)] + [False]
        outs = [np.empty(PAGE, np.uint8) for _ in range(10)]
        assert await s.get([key(i) for i in range(10)], outs) == [i != 3 for i in range(10)]
        for i in (0, 9):
            np.testing.assert_array_equal(outs[i], page(i))


async def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="path"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4)
    with pytest.raises(ConfigError, match="engine"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path, engine="spdk")
    with pytest.raises(ConfigError, match="direct_io"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path, direct_io="yes")
    with pytest.raises(ConfigError, match="unknown option"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path, colour="red")  # type: ignore[call-arg]
    async with store(tmp_path / "s") as s:
        with pytest.raises(KVTierUsageError, match="key 0 must be 16 bytes"):
            await s.contains([b"short"])  # type: ignore[list-item]
        with pytest.raises(KVTierUsageError, match="must hold"):
            await s.put([key(1)], [np.zeros(PAGE + 1, np.uint8)])
        with pytest.raises(KVTierUsageError, match="dtype uint8"):
            await s.put([key(1)], [np.zeros(PAGE, np.float32)])
    # Reopening a store that holds pages with another page size names both sizes.
    async with store(tmp_path / "s") as s:
        assert await s.put([key(1)], [page(1)]) == [True]
    with pytest.raises(ConfigError, match=f"holds pages of {PAGE} bytes, not {PAGE * 2}"):
        async with NvmeStore(page_bytes=PAGE * 2, capacity_pages=4, path=tmp_path / "s"):
            pass


async def test_an_empty_store_is_reinitialised_for_another_page_size(tmp_path: Path) -> None:
    """A store that holds no page (a check or an earlier run created it for another
    model; its pages were all deleted) opens with another page size: nothing can be lost.
    Before: the open failed, and a tier below the top was silently skipped."""
    async with store(tmp_path / "s") as s:
        assert await s.put([key(1), key(2)], [page(1), page(2)]) == [True, True]
        assert await s.delete([key(1), key(2)]) == [True, True]
    bigger = 2 * PAGE + 7
    s = NvmeStore(page_bytes=bigger, capacity_pages=4, path=tmp_path / "s", engine="posix")
    with capture_logs() as logs:
        await s.open()
    async with s:
        assert s.stats()["page_bytes"] == bigger
        assert await s.put([key(3)], [page(3, bigger)]) == [True]
    reset = [e for e in logs if e["event"] == "nvme.page_size_reset"]
    assert [(e["log_level"], e["old_page_bytes"], e["page_bytes"]) for e in reset] == [
        ("warning", PAGE, bigger)
    ]
    index = StoreIndex(tmp_path / "s" / INDEX_FILE, readonly=True)
    try:
        assert int(index.meta()["page_bytes"]) == bigger
    finally:
        index.close()
    # reopened with its new size, the page is there; the old size is now refused
    async with NvmeStore(page_bytes=bigger, capacity_pages=4, path=tmp_path / "s") as s:
        out = np.empty(bigger, np.uint8)
        assert await s.get([key(3)], [out]) == [True]
        np.testing.assert_array_equal(out, page(3, bigger))
    with pytest.raises(ConfigError, match=f"holds pages of {bigger} bytes, not {PAGE}"):
        async with store(tmp_path / "s"):
            pass


def test_kvikio_engine_reports_why_it_cannot_run(tmp_path: Path) -> None:
    reason = kvikio_unavailable_reason()
    if reason is None:
        pytest.skip("kvikio can run here; the engine is covered by the conformance test")
    with pytest.raises(BackendUnavailableError, match="kvikio"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path, engine="kvikio")
    # "auto" falls back to posix with the reason on record.
    s = NvmeStore(page_bytes=PAGE, capacity_pages=4, path=tmp_path)
    assert s.engine_name == "posix"


def test_layout_alignment() -> None:
    for page_bytes in (1, 100, BLOCK, BLOCK + 1, 4 << 20, (4 << 20) - 64):
        lay = SlotLayout.for_page(page_bytes, 1 << 30)
        assert lay.slot_bytes % BLOCK == 0
        assert lay.slot_bytes >= page_bytes + 64
        assert lay.slot_bytes - (page_bytes + 64) < BLOCK
        for slot in (0, 1, lay.slots_per_slab + 3):
            assert lay.locate(slot)[1] % BLOCK == 0


async def test_inspect_store_cli_on_a_healthy_store(tmp_path: Path) -> None:
    from kvtier.cli.app import get_app
    from typer.testing import CliRunner

    root = tmp_path / "s"
    async with store(root, capacity=10) as s:
        await s.put([key(i) for i in range(3)], [page(i) for i in range(3)], namespace="m@r/x")
        await s.put([key(9)], [page(9)], namespace="other")
    runner = CliRunner()
    result = runner.invoke(get_app(), ["inspect", "store", str(root), "--verify", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["pages"] == 4 and data["bytes"] == 4 * PAGE
    assert data["fill"] == 0.4 and data["capacity_pages"] == 10
    assert data["namespaces"] == {
        "m@r/x": {"pages": 3, "bytes": 3 * PAGE},
        "other": {"pages": 1, "bytes": PAGE},
    }
    assert data["format_version"] == 1 and data["verified"] == 4 and data["bad"] == []
    assert data["slabs"] == 1
    human = runner.invoke(get_app(), ["inspect", "store", str(root)])
    assert human.exit_code == 0
    assert "m@r/x" in human.stdout and "format version" in human.stdout


async def test_small_store_preallocates_only_its_capacity(tmp_path: Path) -> None:
    async with NvmeStore(page_bytes=PAGE, capacity_pages=3, path=tmp_path / "s") as s:
        assert await s.put([key(1)], [page(1)]) == [True]
        assert s.layout is not None
        slabs = list((tmp_path / "s" / "slabs").iterdir())
        assert [p.stat().st_size for p in slabs] == [3 * s.layout.slot_bytes]


async def test_close_waits_for_calls_in_flight(tmp_path: Path) -> None:
    from kvtier.backend import BackendClosedError

    s = store(tmp_path / "s", capacity=32)
    await s.open()
    keys = [key(i) for i in range(24)]
    assert all(await s.put(keys, [page(i) for i in range(24)]))
    outs = [np.empty(PAGE, np.uint8) for _ in keys]
    reading = asyncio.ensure_future(s.get(keys, outs))
    writing = asyncio.ensure_future(s.put([key(100)], [page(100)]))
    await asyncio.sleep(0)  # both calls have started
    await s.close()
    assert reading.done() and writing.done()
    assert reading.result() == [True] * 24  # nothing was torn down under them
    assert writing.result() == [True]
    assert all(np.array_equal(o, page(i)) for i, o in enumerate(outs))
    with pytest.raises(BackendClosedError):
        await s.get(keys[:1], outs[:1])
    async with store(tmp_path / "s", capacity=32) as s2:
        assert s2.stats()["recovered_pages"] == 25
