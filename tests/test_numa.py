"""The ctypes NUMA module against the real kernel: policies set and read back, pages
located, threads pinned. Runs on any Linux machine (one node is enough)."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import threading

import numpy as np
import pytest

from kvtier import numa
from kvtier.errors import KVTierUsageError
from kvtier.placement import HostPlacement, apply_memory, thread_initializer

pytestmark = pytest.mark.skipif(
    numa.unavailable_reason() is not None, reason=f"NUMA calls: {numa.unavailable_reason()}"
)

MIB = 1 << 20


def _addr(buf: mmap.mmap) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


@pytest.fixture
def region():
    buf = mmap.mmap(-1, 2 * MIB)
    yield buf
    buf.close()


def test_bind_is_observable_with_get_mempolicy(region: mmap.mmap) -> None:
    node = numa.memory_nodes()[0]
    bound = numa.bind_buffer(region, [node])
    assert bound == 2 * MIB
    policy = numa.get_mempolicy(_addr(region))
    assert policy.mode is numa.MemPolicy.BIND
    assert policy.nodes == (node,)
    region[:] = b"\x01" * len(region)  # touch: pages are placed now
    assert set(numa.buffer_page_nodes(region)) == {node}
    assert numa.node_of_address(_addr(region) + MIB) == node


def test_untouched_pages_report_enoent(region: mmap.mmap) -> None:
    statuses = numa.buffer_page_nodes(region)
    assert len(statuses) == 2 * MIB // numa.PAGE_SIZE
    assert set(statuses) == {-errno.ENOENT}


def test_interleave_policy_reads_back(region: mmap.mmap) -> None:
    nodes = numa.memory_nodes()
    numa.bind_buffer(region, nodes, numa.MemPolicy.INTERLEAVE)
    policy = numa.get_mempolicy(_addr(region))
    assert policy.mode is numa.MemPolicy.INTERLEAVE
    assert policy.nodes == tuple(nodes)


def test_nonexistent_node_is_a_clear_error(region: mmap.mmap) -> None:
    missing = max(numa.online_nodes()) + 1
    with pytest.raises(numa.NumaNodeError, match=rf"NUMA node {missing} does not exist"):
        numa.bind_buffer(region, [missing])
    with pytest.raises(numa.NumaNodeError, match="integer >= 0"):
        numa.bind_buffer(region, [-1])
    with pytest.raises(numa.NumaNodeError, match="no NUMA node given"):
        numa.bind_buffer(region, [])
    # the policy is untouched by the failed calls
    assert numa.get_mempolicy(_addr(region)).mode is numa.MemPolicy.DEFAULT


def test_bad_ranges_and_buffers() -> None:
    with pytest.raises(KVTierUsageError, match=r"is not \d+-byte aligned"):
        numa.mbind(numa.PAGE_SIZE + 1, numa.PAGE_SIZE, [0])
    with pytest.raises(KVTierUsageError, match="writable"):
        numa.bind_buffer(b"read-only bytes", [0])
    with pytest.raises(KVTierUsageError, match="cannot bind a int"):
        numa.bind_buffer(7, [0])


def test_unmapped_range_is_a_numa_error() -> None:
    buf = mmap.mmap(-1, MIB)
    addr = _addr(buf)
    buf.close()  # the range is unmapped now
    with pytest.raises(numa.NumaError, match=r"mbind failed: .*EFAULT"):
        numa.mbind(addr, MIB, [numa.memory_nodes()[0]])


def test_malloc_array_binds_its_whole_pages() -> None:
    arr = np.zeros(MIB + 100, dtype=np.uint8)
    start, length = numa.page_range(arr.ctypes.data, arr.nbytes)
    assert numa.bind_buffer(arr, [numa.memory_nodes()[0]]) == length
    assert start >= arr.ctypes.data and start + length <= arr.ctypes.data + arr.nbytes
    assert numa.get_mempolicy(start).mode is numa.MemPolicy.BIND


def test_move_pages_moves_to_the_asked_node(region: mmap.mmap) -> None:
    node = numa.memory_nodes()[0]
    region[:4096] = b"x" * 4096
    assert numa.move_pages([_addr(region)], [node]) == [node]
    with pytest.raises(KVTierUsageError, match="1 nodes for 2 pages"):
        numa.move_pages([_addr(region), _addr(region) + 4096], [node])


def test_thread_policy_is_thread_local() -> None:
    node = numa.memory_nodes()[0]
    seen: list[numa.PolicyInfo] = []

    def worker() -> None:
        numa.set_mempolicy(numa.MemPolicy.PREFERRED, [node])
        seen.append(numa.get_mempolicy())
        numa.set_mempolicy(numa.MemPolicy.DEFAULT)
        seen.append(numa.get_mempolicy())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen[0] == numa.PolicyInfo(numa.MemPolicy.PREFERRED, (node,))
    assert seen[1].mode is numa.MemPolicy.DEFAULT
    assert numa.get_mempolicy().mode is numa.MemPolicy.DEFAULT  # this thread untouched


def test_thread_policy_applies_to_allocations_and_restores() -> None:
    node = numa.memory_nodes()[0]
    seen: list[object] = []

    def worker() -> None:
        numa.set_mempolicy(numa.MemPolicy.PREFERRED, [node])
        with numa.thread_policy(numa.MemPolicy.BIND, [node]) as before:
            seen.append(before)
            seen.append(numa.get_mempolicy())
            buf = mmap.mmap(-1, MIB)
            buf[:] = b"\x02" * MIB  # faulted in under the thread's policy
            seen.append(set(numa.buffer_page_nodes(buf)))
        seen.append(numa.get_mempolicy())
        numa.set_mempolicy(numa.MemPolicy.DEFAULT)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    preferred = numa.PolicyInfo(numa.MemPolicy.PREFERRED, (node,))
    assert seen == [preferred, numa.PolicyInfo(numa.MemPolicy.BIND, (node,)), {node}, preferred]


def test_pin_thread_affects_only_that_thread() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    target = allowed[-1]
    seen: list[tuple[int, ...]] = []
    t = threading.Thread(
        target=lambda: (numa.pin_thread([target]), seen.append(numa.thread_affinity()))
    )
    t.start()
    t.join()
    assert seen == [(target,)]
    assert numa.thread_affinity() == tuple(allowed)


def test_pin_thread_rejects_unavailable_cpus() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(KVTierUsageError, match=f"CPU {outside} is not available"):
        numa.pin_thread([outside])
    with pytest.raises(KVTierUsageError, match="empty CPU set"):
        numa.pin_thread([])


def test_placement_applies_binding_and_pins_executor_threads(region: mmap.mmap) -> None:
    node = numa.memory_nodes()[0]
    cpu = sorted(os.sched_getaffinity(0))[0]
    placement = HostPlacement((), "bind", (node,), (cpu,), "test")
    assert apply_memory(placement, region) == 2 * MIB
    assert numa.get_mempolicy(_addr(region)).nodes == (node,)
    with concurrent.futures.ThreadPoolExecutor(2, initializer=thread_initializer(placement)) as ex:
        affinities = set(ex.map(lambda _: numa.thread_affinity(), range(4)))
    assert affinities == {(cpu,)}
    unbound = HostPlacement((), "none", (), (), "test")
    assert apply_memory(unbound, region) == 0


async def test_dram_arena_numa_node_binds_its_buffer() -> None:
    from kvtier.backends.dram import DramArena

    node = numa.memory_nodes()[0]
    arena = DramArena(page_bytes=256 * 1024, capacity_pages=8, numa_node=node)
    async with arena:
        start, _ = numa.page_range(arena.view(0).ctypes.data, arena.nbytes)
        assert numa.get_mempolicy(start) == numa.PolicyInfo(numa.MemPolicy.BIND, (node,))
        assert set(numa.buffer_page_nodes(arena.view(7))) == {node}
    missing = max(numa.online_nodes()) + 1
    with pytest.raises(numa.NumaNodeError, match=f"NUMA node {missing} does not exist"):
        await DramArena(page_bytes=4096, capacity_pages=1, numa_node=missing).open()


async def test_dram_arena_placement_binds_memory_and_pins_copy_threads() -> None:
    """A placed arena (here: ``placement="local"`` with an explicit node, since this
    machine has no GPU to be near) is bound to the node the plan chose and runs its copy
    threads on that node's CPUs; the decision and reason are in stats."""
    import os

    from kvtier.backends.dram import DramArena

    node0 = numa.memory_nodes()[0]
    arena = DramArena(
        page_bytes=64 * 1024, capacity_pages=4, placement="local", numa_node=node0, io_threads=2
    )
    async with arena:
        placement = arena.stats()["placement"]
        assert placement["memory"] == "bind" and placement["reason"]
        (node,) = placement["nodes"]
        start, _ = numa.page_range(arena.view(0).ctypes.data, arena.nbytes)
        assert numa.get_mempolicy(start) == numa.PolicyInfo(numa.MemPolicy.BIND, (node,))
        assert set(numa.buffer_page_nodes(arena.view(3))) == {node}
        assert placement["cpus"]  # node 0 has CPUs on every machine we run on
        affinity = await arena.run_blocking(os.sched_getaffinity, 0)
        assert affinity == set(placement["cpus"])


async def test_dram_arena_placement_interleave_auto_and_bad_values() -> None:
    from kvtier.backends.dram import DramArena

    from kvtier.errors import KVTierUsageError

    nodes = tuple(numa.memory_nodes())
    async with DramArena(page_bytes=64 * 1024, capacity_pages=4, placement="interleave") as a:
        assert a.stats()["placement"]["memory"] == "interleave"
        start, _ = numa.page_range(a.view(0).ctypes.data, a.nbytes)
        assert numa.get_mempolicy(start) == numa.PolicyInfo(numa.MemPolicy.INTERLEAVE, nodes)
    async with DramArena(page_bytes=64 * 1024, capacity_pages=4, placement="auto") as a:
        assert a.stats()["placement"]["reason"]  # the decision says why, whatever it is
        assert await a.put([bytes(16)], [bytes(64 * 1024)]) == [True]  # type: ignore[list-item]
    with pytest.raises(KVTierUsageError, match="placement"):
        DramArena(page_bytes=4096, capacity_pages=1, placement="nearby")
    with pytest.raises(KVTierUsageError, match="gpu"):
        DramArena(page_bytes=4096, capacity_pages=1, gpu=-1)
