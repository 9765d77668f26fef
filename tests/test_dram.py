"""DramArena specifics: memory kinds, zero-copy views, the skipped copy, split copies,
options, and a state machine against the model of the contract."""

from __future__ import annotations

import asyncio
import logging
import mmap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvtier.backends import dram, dram_memory
from kvtier.backends.dram import DramArena, split_pairs

from kvtier.backend import BackendClosedError
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.health import LogOnce
from kvtier.keys import PageKey
from kvtier.testing.model import backend_state_machine

PAGE = 4096


def _keys(n: int, salt: int = 0) -> list[PageKey]:
    return [PageKey(bytes([salt, i % 256, i // 256]) + bytes(13)) for i in range(n)]


def _pages(n: int, page_bytes: int = PAGE, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(n)]


async def test_memory_kind_is_recorded_and_page_aligned() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=4) as arena:
        stats = arena.stats()
        if torch.cuda.is_available():
            assert stats["memory"] == "pinned"
        else:
            assert stats["memory"] in ("mlocked", "plain")
            assert (stats["memory_note"] is None) == (stats["memory"] == "mlocked")
        assert stats["arena_bytes"] == 4 * PAGE
        assert arena.view(0).ctypes.data % mmap.PAGESIZE == 0
    assert arena.stats()["used_pages"] == 0


async def test_refused_mlock_is_logged_once_and_the_arena_still_works(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available():
        pytest.skip("pinned through CUDA here; mlock is not used")
    monkeypatch.setattr(dram, "try_mlock", lambda addr, n: "mlock refused: EPERM (test)")
    monkeypatch.setattr(dram, "LOGGED", LogOnce())
    caplog.set_level(logging.WARNING, logger="kvtier.backends.dram")
    for _ in range(2):
        async with DramArena(page_bytes=PAGE, capacity_pages=2) as arena:
            assert arena.stats()["memory"] == "plain"
            assert "EPERM" in arena.stats()["memory_note"]
            keys, data = _keys(1), _pages(1)
            assert await arena.put(keys, data) == [True]
    refusals = [r for r in caplog.records if "not locked in memory" in r.getMessage()]
    assert len(refusals) == 1


class _Registrations:
    """Stands in for cudaHostRegister / cudaHostUnregister: records what was asked, and
    what the memory policy of the first page was at the moment of pinning."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int, Any]] = []
        self.unregistered: list[int] = []

    def register(self, addr: int, length: int) -> str | None:
        from kvtier import numa

        start, _ = numa.page_range(addr, length)
        self.registered.append((addr, length, numa.get_mempolicy(start)))
        return self.refuse

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(dram, "cuda_available", lambda: True)
        monkeypatch.setattr(dram, "cuda_host_register", self.register)
        monkeypatch.setattr(dram, "cuda_host_unregister", self.unregistered.append)


async def test_with_cuda_the_bound_buffer_is_registered_then_unregistered_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinning comes after binding (page-locked pages cannot migrate), covers the whole
    buffer, and is undone at close. On a GPU machine test_numa checks the real thing."""
    from kvtier import numa

    calls = _Registrations()
    calls.install(monkeypatch)
    node = numa.memory_nodes()[0]
    arena = DramArena(page_bytes=PAGE, capacity_pages=4, numa_node=node)
    async with arena:
        assert arena.stats()["memory"] == "pinned" and arena.stats()["memory_note"] is None
        ((addr, length, policy),) = calls.registered
        assert addr == arena.view(0).ctypes.data and length == 4 * PAGE
        assert policy == numa.PolicyInfo(numa.MemPolicy.BIND, (node,))
        assert await arena.put(_keys(1), _pages(1)) == [True]
    assert calls.unregistered == [addr]


async def test_refused_cuda_registration_falls_back_to_mlock_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _Registrations(refuse="cudaHostRegister refused: out of memory (test)")
    calls.install(monkeypatch)
    monkeypatch.setattr(dram, "LOGGED", LogOnce())
    caplog.set_level(logging.WARNING, logger="kvtier.backends.dram")
    for _ in range(2):
        async with DramArena(page_bytes=PAGE, capacity_pages=2) as arena:
            stats = arena.stats()
            assert stats["memory"] in ("mlocked", "plain")
            assert "out of memory (test)" in stats["memory_note"]
            keys, data = _keys(1), _pages(1)
            assert await arena.put(keys, data) == [True]
            out = [np.empty(PAGE, np.uint8)]
            assert await arena.get(keys, out) == [True]
            np.testing.assert_array_equal(out[0], data[0])
    assert calls.unregistered == []  # nothing was registered
    refusals = [r for r in caplog.records if "not pinned for CUDA" in r.getMessage()]
    assert len(refusals) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory")
async def test_pinned_slots_are_pinned_for_torch_and_copy_to_the_gpu() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=2) as arena:
        keys, data = _keys(1), _pages(1)
        assert await arena.put(keys, data) == [True]
        slot = arena.slot_of(keys[0])
        assert slot is not None
        t = arena.tensor(slot)
        assert t.is_pinned()
        on_gpu = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), torch.from_numpy(data[0]))


def test_cuda_registration_without_a_cuda_runtime_is_refused_not_raised() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA runtime is present: the registration would succeed")
    buf = np.zeros(PAGE, np.uint8)
    reason = dram_memory.cuda_host_register(buf.ctypes.data, PAGE)
    assert reason is not None and "cudaHostRegister" in reason
    dram_memory.cuda_host_unregister(buf.ctypes.data)  # never raises either


async def test_real_mlock_refusal_is_reported() -> None:
    """mlock of an unmapped range fails (ENOMEM): the helper reports it, never raises."""
    reason = dram.try_mlock(0, mmap.PAGESIZE)
    assert reason is not None and "refused" in reason


async def test_view_and_tensor_share_memory() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=3) as arena:
        view, tensor = arena.view(1), arena.tensor(1)
        assert view.flags.writeable and view.shape == (PAGE,)
        assert tensor.dtype == torch.uint8 and tensor.data_ptr() == view.ctypes.data
        assert np.shares_memory(view, arena.view(1))
        assert not np.shares_memory(arena.view(0), arena.view(1))
        tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert view[:4].tolist() == [1, 2, 3, 4]
        view[4] = 99
        assert int(tensor[4]) == 99


async def test_write_of_the_reserved_view_skips_the_copy() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=2) as arena:
        keys, data = _keys(2), _pages(2)
        r1, r2 = await arena.reserve(keys)
        assert r1 is not None and r2 is not None and r1.view is not None
        assert r1.view.ctypes.data == arena.view(r1.handle).ctypes.data
        r1.view[:] = data[0]
        assert await arena.write([r1, r2], [r1.view, data[1]]) == [True, True]
        stats = arena.stats()
        assert stats["skipped_copies"] == 1 and stats["copies"] == 1
        assert await arena.commit([r1, r2]) == [True, True]
        out = [np.empty(PAGE, np.uint8) for _ in range(2)]
        assert await arena.get(keys, out) == [True, True]
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))


async def test_one_executor_hop_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=8) as arena:
        hops: list[int] = []  # one executor job per copy_pairs call
        real = dram.copy_pairs

        def counting(pairs: Any) -> None:
            hops.append(len(pairs))
            real(pairs)

        monkeypatch.setattr(dram, "copy_pairs", counting)
        keys, data = _keys(6), _pages(6)
        assert await arena.put(keys, data) == [True] * 6
        assert len(hops) == 1
        out = [np.empty(PAGE, np.uint8) for _ in keys]
        assert await arena.get(keys, out) == [True] * 6
        assert len(hops) == 2
        assert await arena.contains(keys) == [True] * 6 and len(hops) == 2


async def test_large_batches_are_split_across_threads_and_stay_correct() -> None:
    page = 1 << 20
    n = dram.PARALLEL_COPY_MIN_BYTES // page + 4
    async with DramArena(page_bytes=page, capacity_pages=n, io_threads=4) as arena:
        keys, data = _keys(n), _pages(n, page)
        assert await arena.put(keys, data) == [True] * n
        out = [np.empty(page, np.uint8) for _ in range(n)]
        assert await arena.get(keys, out) == [True] * n
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))


@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    parts=st.integers(1, 8),
)
def test_split_pairs_covers_every_byte_once(sizes: list[int], parts: int) -> None:
    src = [np.arange(s, dtype=np.uint32).astype(np.uint8) for s in sizes]
    dst = [np.zeros(s, dtype=np.uint8) for s in sizes]
    groups = split_pairs(list(zip(dst, src, strict=True)), parts)
    for group in groups:
        for d, s in group:
            assert d.nbytes == s.nbytes and not d.any()  # no byte copied twice
            d[:] = s
    assert all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True))
    total = sum(sizes)
    assert len(groups) <= max(1, -(-total // dram_memory.MIN_PIECE_BYTES), parts) + 1


async def test_slot_is_stable_while_committed_and_reused_after_delete() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=2) as arena:
        k = _keys(3)
        d = _pages(3)
        assert await arena.put(k[:2], d[:2]) == [True, True]
        slot0 = arena.slot_of(k[0])
        assert await arena.delete(k[1:2]) == [True]
        assert await arena.put(k[2:], d[2:]) == [True]
        assert arena.slot_of(k[0]) == slot0
        assert np.array_equal(arena.view(slot0 or 0), d[0])
        assert {arena.slot_of(k[0]), arena.slot_of(k[2])} == {0, 1}


async def test_a_slot_being_read_is_not_reused_until_the_read_ends() -> None:
    page = 4 << 20
    async with DramArena(page_bytes=page, capacity_pages=1) as arena:
        a, b = _keys(2)
        data = _pages(2, page)
        assert await arena.put([a], data[:1]) == [True]
        out = np.zeros(page, np.uint8)
        reading = asyncio.create_task(arena.get([a], [out]))
        await asyncio.sleep(0)  # the get is now copying on a worker thread
        assert not reading.done()
        assert await arena.delete([a]) == [True]
        assert arena.used_pages() == 1 and arena.stats()["draining_pages"] == 1
        assert await arena.reserve([b]) == [None]
        assert await reading == [True]
        assert np.array_equal(out, data[0])
        assert arena.used_pages() == 0
        assert await arena.put([b], data[1:]) == [True]


async def test_reopen_starts_empty() -> None:
    arena = DramArena(page_bytes=PAGE, capacity_pages=2)
    await arena.open()
    assert await arena.put(_keys(1), _pages(1)) == [True]
    await arena.close()
    with pytest.raises(BackendClosedError):
        arena.view(0)
    await arena.open()
    assert await arena.keys() == [] and arena.used_pages() == 0
    await arena.close()


async def test_bad_slots_and_options() -> None:
    async with DramArena(page_bytes=PAGE, capacity_pages=2, numa_node=0) as arena:
        assert arena.numa_node == 0 and arena.stats()["numa_node"] == 0
        for bad in (-1, 2, 1.0, True):
            with pytest.raises(KVTierUsageError, match="slot"):
                arena.view(bad)  # type: ignore[arg-type]
    for numa in (-1, "0", True):
        with pytest.raises(KVTierUsageError, match="numa_node"):
            DramArena(page_bytes=PAGE, capacity_pages=2, numa_node=numa)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pinned"):
        DramArena(page_bytes=PAGE, capacity_pages=2, pinned=True)
    with pytest.raises(KVTierUsageError, match="page_bytes"):
        DramArena(page_bytes=0, capacity_pages=2)
    with pytest.raises(KVTierUsageError, match="io_threads"):
        DramArena(page_bytes=PAGE, capacity_pages=2, io_threads=0)


TestDramStateMachine = backend_state_machine(
    lambda: DramArena(page_bytes=64, capacity_pages=4, io_threads=2)
).TestCase


async def test_a_cancelled_write_raises_only_once_its_copy_thread_returned(monkeypatch) -> None:
    """Worker threads cannot be stopped: a cancelled write raises only once the copy thread
    really returned, so the caller may reuse its buffer, and the slot it aborts then is
    free for the next page (no late copy can overwrite it). Before, the write raised at
    once and only the slot book kept the slot taken ("draining") until the thread ended."""
    import threading

    from kvtier.backends import dram as dram_module

    gate = threading.Event()
    real = dram_module.copy_pairs

    def held_copy(pairs):  # the first copy blocks until the test lets it go
        gate.wait(10)
        real(pairs)

    big = dram_module.INLINE_COPY_MAX_BYTES  # a batch this large goes to a worker thread
    async with DramArena(page_bytes=big, capacity_pages=1) as arena:
        a, b = _keys(2)
        data = _pages(2, big)
        (res,) = await arena.reserve([a])
        assert res is not None
        monkeypatch.setattr(dram_module, "copy_pairs", held_copy)
        writing = asyncio.create_task(arena.write([res], [data[0]]))
        await asyncio.sleep(0.05)  # the copy thread is now inside held_copy
        writing.cancel()
        await asyncio.sleep(0.1)
        assert not writing.done()  # it waits for the copy thread
        monkeypatch.setattr(dram_module, "copy_pairs", real)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await writing
        assert arena.stats()["draining_pages"] == 0
        await arena.abort([res])
        assert arena.used_pages() == 0
        assert await arena.put([b], data[1:]) == [True]
        out = np.zeros(big, np.uint8)
        assert await arena.get([b], [out]) == [True]
        assert np.array_equal(out, data[1])


async def test_a_cancelled_put_gives_its_slots_back_once_the_copy_ends(monkeypatch) -> None:
    import threading

    from kvtier.backends import dram as dram_module

    gate = threading.Event()
    real = dram_module.copy_pairs

    def held_copy(pairs):
        gate.wait(10)
        real(pairs)

    big = dram_module.INLINE_COPY_MAX_BYTES
    async with DramArena(page_bytes=big, capacity_pages=2) as arena:
        monkeypatch.setattr(dram_module, "copy_pairs", held_copy)
        putting = asyncio.create_task(arena.put(_keys(2), _pages(2, big)))
        await asyncio.sleep(0.05)
        putting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await putting
        gate.set()
        for _ in range(200):
            if arena.used_pages() == 0:
                break
            await asyncio.sleep(0.01)
        assert arena.used_pages() == 0  # no reservation leaked
        assert await arena.keys() == []


async def test_small_batches_copy_on_the_loop_and_large_ones_on_worker_threads(
    monkeypatch,
) -> None:
    """A batch under INLINE_COPY_MAX_BYTES is copied without an executor hop; a larger one
    goes to the copy threads. Both land byte-exact."""
    import threading

    from kvtier.backends import dram as dram_module

    threads: list[str] = []
    real = dram_module.copy_pairs

    def recording_copy(pairs):
        threads.append(threading.current_thread().name)
        real(pairs)

    monkeypatch.setattr(dram_module, "copy_pairs", recording_copy)
    small = dram_module.INLINE_COPY_MAX_BYTES // 4
    async with DramArena(page_bytes=small, capacity_pages=8, io_threads=2) as arena:
        keys, data = _keys(8), _pages(8, small)
        assert await arena.put(keys[:3], data[:3]) == [True] * 3  # 3/4 of the limit: inline
        assert threads == [threading.current_thread().name]
        assert arena.stats()["inline_copies"] == 3
        assert await arena.put(keys[3:], data[3:]) == [True] * 5  # 5/4 of it: a worker
        assert len(threads) == 2 and threads[1] != threading.current_thread().name
        out = [np.zeros(small, np.uint8) for _ in keys]
        assert await arena.get(keys, out) == [True] * 8
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))


def test_an_allocation_refused_under_an_address_space_limit_names_the_limit(tmp_path) -> None:
    """Under ``ulimit -v`` an arena that fits the machine's memory cannot be mapped; the
    error said only how much memory was available (20 GiB, say), which does not explain
    the refusal. It now names the limit. A child process: limits are per process."""
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(
        """
        import asyncio, resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))
        from kvtier.backends.dram import DramArena

        async def main():
            try:
                await DramArena(page_bytes=1 << 20, capacity_pages=4096).open()
            except Exception as exc:
                print(type(exc).__name__, exc)

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert "ArenaAllocationError cannot allocate a DRAM arena of 4.0 GiB" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "the process's address-space limit (ulimit -v) is 3.0 GiB" in done.stdout
