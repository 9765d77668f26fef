"""NUMA placement of host arenas and their worker threads (the article's section 6.3).

A pinned host buffer on the wrong NUMA node costs a large share of DMA bandwidth, so each
host arena is bound to the node nearest the GPU it serves, and the threads that copy to
and from it run on that node's CPUs. :func:`plan_placement` is a pure function of a
:class:`~kvtier.topology.Topology`: it returns the decision *and the reason* as data, for
``kvtier inspect topology`` and the logs. :func:`apply_memory` and :func:`pin_current_thread`
carry a decision out through :mod:`kvtier.numa`.

Rules, in order:

1. ``mode="none"``: no binding, no pinning.
2. An explicit ``node`` (the DRAM arena's ``numa_node`` option): bind there.
3. ``mode="interleave"``: interleave pages over every node with memory.
4. GPUs known: one arena per distinct GPU node (GPUs on one node share it). A GPU with no
   affinity (``numa_node`` -1 or missing) gets an unbound arena. A GPU node without memory
   (Grace Hopper's GPU-memory nodes, CXL) uses the nearest node with memory by SLIT
   distance; a node without CPUs pins threads to the nearest node with CPUs.
5. No GPU: one unbound arena (allocation stays local to whoever touches it first).
6. A machine with a single NUMA node: nothing to choose; unbound, unpinned.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier import numa
from kvtier.errors import KVTierUsageError
from kvtier.log import get_logger
from kvtier.topology import NumaNode, Topology

PlacementMode = Literal["auto", "local", "interleave", "none"]
_MODES = ("auto", "local", "interleave", "none")
_log = get_logger("kvtier.placement")


@dataclass(frozen=True)
class HostPlacement:
    """Where one host arena's memory and worker threads go.

    Attributes:
        gpus: indices of the GPUs this arena serves (empty: no GPU).
        memory: ``bind`` (to :attr:`nodes`), ``interleave`` (over :attr:`nodes`) or
            ``none`` (the kernel's default, first touch).
        nodes: memory nodes of the policy (empty when ``memory`` is ``none``).
        cpus: CPUs for the arena's worker threads (empty: not pinned).
        reason: why, in one sentence.
    """

    gpus: tuple[int, ...]
    memory: Literal["bind", "interleave", "none"]
    nodes: tuple[int, ...]
    cpus: tuple[int, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlacementPlan:
    """One :class:`HostPlacement` per host arena, and the mode that produced them."""

    mode: PlacementMode
    arenas: tuple[HostPlacement, ...]

    def for_gpu(self, index: int) -> HostPlacement:
        """The placement of the arena serving GPU ``index`` (the GPU-less one when no
        arena names it); :class:`KVTierUsageError` when neither exists."""
        for arena in self.arenas:
            if index in arena.gpus:
                return arena
        for arena in self.arenas:
            if not arena.gpus:
                return arena
        raise KVTierUsageError(f"no host arena is planned for GPU {index}")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "arenas": [a.to_dict() for a in self.arenas]}


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(os.getpid()))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _nearest(topology: Topology, start: NumaNode, ok: Callable[[NumaNode], bool]) -> NumaNode:
    """``start`` if ``ok``, else the ``ok`` node with the smallest distance from it."""
    if ok(start):
        return start
    candidates = [n for n in topology.nodes if ok(n)]
    if not candidates:
        return start

    def dist(n: NumaNode) -> tuple[int, int]:
        d = start.distance_to(n.id)
        return (d if d is not None else 1 << 30, n.id)

    return min(candidates, key=dist)


def _cpus_for(topology: Topology, node: NumaNode, allowed: set[int]) -> tuple[tuple[int, ...], str]:
    cpu_node = _nearest(topology, node, lambda n: bool(set(n.cpus) & allowed))
    cpus = tuple(sorted(set(cpu_node.cpus) & allowed))
    if not cpus:
        return (), f"no CPU of node {node.id} is available to this process: threads unpinned"
    if cpu_node.id != node.id:
        return cpus, f"threads on node {cpu_node.id}'s CPUs (node {node.id} has none usable)"
    return cpus, f"threads on node {node.id}'s CPUs"


def _bound(topology: Topology, gpus: tuple[int, ...], node_id: int, why: str) -> HostPlacement:
    node = topology.node(node_id)
    mem_node = _nearest(topology, node, lambda n: n.has_memory)
    cpus, cpu_why = _cpus_for(topology, node, _allowed_cpus())
    mem_why = (
        f"memory on node {mem_node.id}, the nearest node with memory"
        if mem_node.id != node.id
        else f"memory bound to node {node.id}"
    )
    return HostPlacement(gpus, "bind", (mem_node.id,), cpus, f"{why}: {mem_why}; {cpu_why}")


def plan_placement(
    topology: Topology,
    mode: PlacementMode = "auto",
    *,
    gpus: Sequence[int] | None = None,
    node: int | None = None,
) -> PlacementPlan:
    """Decide host arena placement.

    Args:
        topology: the machine (:func:`kvtier.topology.read_topology`).
        mode: ``auto`` (the rules in the module docstring), ``local`` (same, but bind even
            on a single-node machine), ``interleave`` or ``none``.
        gpus: indices of the GPUs in use (default: every GPU of the topology).
        node: an explicit node for a single arena (overrides the GPU rule).

    Raises :class:`KVTierUsageError` for an unknown mode, a node or GPU that does not exist.
    """
    if mode not in _MODES:
        raise KVTierUsageError(f"placement mode must be one of {', '.join(_MODES)}, got {mode!r}")
    if gpus is None:
        used = tuple(g.index for g in topology.gpus)
    else:
        used = tuple(dict.fromkeys(topology.gpu(i).index for i in gpus))
    if mode == "none":
        return PlacementPlan(mode, (HostPlacement(used, "none", (), (), "placement disabled"),))
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, int):
            raise KVTierUsageError(f"numa_node must be an integer, got {node!r}")
        topology.node(node)  # raises naming the nodes that exist
        return PlacementPlan(mode, (_bound(topology, used, node, f"configured numa_node={node}"),))
    if not topology.nodes:
        return PlacementPlan(
            mode,
            (HostPlacement(used, "none", (), (), "no NUMA information: nothing has affinity"),),
        )
    if mode == "interleave":
        mem_nodes = tuple(n.id for n in topology.nodes if n.has_memory)
        return PlacementPlan(
            mode,
            (
                HostPlacement(
                    used,
                    "interleave",
                    mem_nodes,
                    (),
                    f"configured interleave over nodes {', '.join(map(str, mem_nodes))}",
                ),
            ),
        )
    if len(topology.nodes) == 1 and mode == "auto":
        only = topology.nodes[0].id
        return PlacementPlan(
            mode,
            (
                HostPlacement(
                    used,
                    "none",
                    (),
                    (),
                    f"single NUMA node {only}: every allocation is already local",
                ),
            ),
        )
    if not used:
        return PlacementPlan(
            mode,
            (
                HostPlacement(
                    (), "none", (), (), "no GPU: nothing to be near; pages land where touched"
                ),
            ),
        )
    by_node: dict[int | None, list[int]] = {}
    for index in used:
        by_node.setdefault(topology.gpu(index).numa_node, []).append(index)
    arenas: list[HostPlacement] = []
    for gpu_node, members in sorted(by_node.items(), key=lambda kv: (kv[0] is None, kv[0])):
        label = "GPU " + ", ".join(f"{i} ({topology.gpu(i).pci_address})" for i in members)
        if gpu_node is None:
            arenas.append(
                HostPlacement(
                    tuple(members),
                    "none",
                    (),
                    (),
                    f"{label} reports no NUMA affinity (numa_node -1): memory unbound",
                )
            )
        else:
            arenas.append(_bound(topology, tuple(members), gpu_node, f"{label} on node {gpu_node}"))
    return PlacementPlan(mode, tuple(arenas))


def apply_memory(placement: HostPlacement, buf: Any) -> int:
    """Apply ``placement``'s memory policy to ``buf`` (before it is touched or pinned).

    Returns the bytes bound (0 for ``none``). Raises as :func:`kvtier.numa.bind_buffer`.
    """
    if placement.memory == "none":
        _log.info("host arena placement", memory="none", reason=placement.reason)
        return 0
    mode = numa.MemPolicy.BIND if placement.memory == "bind" else numa.MemPolicy.INTERLEAVE
    bound = numa.bind_buffer(buf, placement.nodes, mode)
    _log.info(
        "host arena placement",
        memory=placement.memory,
        nodes=list(placement.nodes),
        gpus=list(placement.gpus),
        bytes=bound,
        reason=placement.reason,
    )
    return bound


def pin_current_thread(placement: HostPlacement) -> bool:
    """Pin the calling thread to ``placement``'s CPUs; ``False`` when it names none."""
    if not placement.cpus:
        return False
    numa.pin_thread(placement.cpus)
    _log.debug("worker thread pinned", cpus=list(placement.cpus), reason=placement.reason)
    return True


def thread_initializer(placement: HostPlacement) -> Callable[[], None]:
    """An ``initializer`` for :class:`concurrent.futures.ThreadPoolExecutor` that pins
    each worker thread to ``placement``'s CPUs."""

    def init() -> None:
        pin_current_thread(placement)

    return init
