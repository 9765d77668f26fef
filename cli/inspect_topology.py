"""``kvtier inspect topology``: NUMA nodes, GPUs, NVMe devices, and where host arenas go."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import console, emit, err_console, run_guarded, table

from kvtier.errors import KVTierUsageError
from kvtier.placement import PlacementMode, plan_placement
from kvtier.topology import format_cpulist, path_device, read_topology


def topology_report(
    root: Path = Path("/"),
    mode: PlacementMode = "auto",
    gpus: list[int] | None = None,
    node: int | None = None,
    use_nvml: bool = True,
    paths: list[Path] | None = None,
) -> dict[str, Any]:
    """``{"topology": {...}, "placement": {...}, "paths": [...]}`` for ``root`` (``/``:
    this machine); ``paths`` lists the block device and node of each store directory."""
    topo = read_topology(root, use_nvml=use_nvml)
    plan = plan_placement(topo, mode, gpus=gpus or None, node=node)
    return {
        "root": str(root),
        "topology": topo.to_dict(),
        "placement": plan.to_dict(),
        "paths": [path_device(p, root).to_dict() for p in paths or []],
    }


def _gib(value: int | None) -> str | None:
    return None if value is None else f"{value / (1 << 30):.1f} GiB"


def _node(value: int | None) -> str:
    return "no affinity" if value is None else str(value)


def _render(data: dict[str, Any]) -> None:
    topo = data["topology"]
    node_rows = [
        (
            n["id"],
            format_cpulist(n["cpus"]) or "-",
            _gib(n["mem_total_bytes"]),
            _gib(n["mem_free_bytes"]),
            " ".join(map(str, n["distances"])) or None,
        )
        for n in topo["nodes"]
    ]
    console.print(table("NUMA nodes", ["node", "cpus", "memory", "free", "distances"], node_rows))
    if not node_rows:
        console.print("no NUMA nodes exposed: nothing has affinity")
    gpu_rows = [
        (g["index"], g["pci_address"], _node(g["numa_node"]), g["vendor"], g["name"], g["source"])
        for g in topo["gpus"]
    ]
    console.print(table("GPUs", ["index", "pci", "node", "vendor", "name", "source"], gpu_rows))
    nvme_rows = [
        (d["name"], d["pci_address"], _node(d["numa_node"]), d["model"], " ".join(d["namespaces"]))
        for d in topo["nvme"]
    ]
    console.print(table("NVMe", ["device", "pci", "node", "model", "namespaces"], nvme_rows))
    plan = data["placement"]
    arena_rows = [
        (
            ", ".join(map(str, a["gpus"])) or "-",
            a["memory"],
            ", ".join(map(str, a["nodes"])) or "-",
            format_cpulist(a["cpus"]) or "unpinned",
            a["reason"],
        )
        for a in plan["arenas"]
    ]
    console.print(
        table(
            f"host arena placement (mode {plan['mode']})",
            ["gpus", "memory", "nodes", "threads on cpus", "reason"],
            arena_rows,
        )
    )
    if data["paths"]:
        path_rows = [
            (p["path"], p["device"], p["pci_address"], _node(p["numa_node"]), p["note"])
            for p in data["paths"]
        ]
        console.print(table("paths", ["path", "device", "pci", "node", "note"], path_rows))
    for note in topo["notes"]:
        err_console.print(f"note: {note}", highlight=False, markup=False)


def _check_root_and_node(root: Path, mode: str, numa_node: int | None) -> None:
    """Refuse a ``--root`` that is not an existing directory (a typo would otherwise read
    as a machine with no NUMA, GPU or NVMe information), and ``--numa-node`` with
    ``--placement none`` (which binds nothing, so the node would be ignored). Raises
    :class:`KVTierUsageError` naming the option and value."""
    if "\x00" in str(root):
        raise KVTierUsageError(f"--root {str(root)!r} contains a NUL byte")
    if not root.exists():
        raise KVTierUsageError(f"--root {root}: no such directory")
    if not root.is_dir():
        raise KVTierUsageError(f"--root {root} is not a directory")
    if mode == "none" and numa_node is not None:
        raise KVTierUsageError(
            f"--numa-node {numa_node} with --placement none: placement none binds no memory "
            "to any node; drop --numa-node, or use --placement auto or local"
        )


@inspect_app.command("topology")
def inspect_topology(
    mode: Annotated[
        str,
        typer.Option("--placement", help="Placement mode: auto, local, interleave or none."),
    ] = "auto",
    gpu: Annotated[
        list[int] | None, typer.Option("--gpu", help="GPU index in use (repeatable).")
    ] = None,
    numa_node: Annotated[
        int | None, typer.Option("--numa-node", help="Bind the host arena to this node.")
    ] = None,
    root: Annotated[
        Path, typer.Option("--root", help="Read sysfs under this directory (for testing).")
    ] = Path("/"),
    no_nvml: Annotated[bool, typer.Option("--no-nvml", help="Do not ask NVML.")] = False,
    path: Annotated[
        list[Path] | None,
        typer.Option("--path", help="Show the block device and node of a directory."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show NUMA nodes (CPUs, memory, distances), each GPU's and NVMe device's node, the
    host arena placement kvtier would choose with the reason, and (--path) which device
    and node a store directory is on."""

    def body() -> None:
        modes = get_args(PlacementMode)
        if mode not in modes:
            raise KVTierUsageError(
                f"--placement must be {', '.join(modes[:-1])} or {modes[-1]}, got {mode!r}"
            )
        _check_root_and_node(root, mode, numa_node)
        for p in path or []:
            if not p.exists():
                raise KVTierUsageError(f"--path {p}: no such file or directory")
        data = topology_report(
            root,
            mode,  # type: ignore[arg-type]  # checked above
            gpu,
            numa_node,
            use_nvml=not no_nvml,
            paths=path,
        )
        emit(data, as_json, _render)

    run_guarded(body, as_json)
