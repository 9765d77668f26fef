"""Topology parsing against fake sysfs trees, and placement decisions on top of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.errors import KVTierUsageError
from kvtier.placement import plan_placement
from kvtier.topology import (
    format_cpulist,
    normalize_pci_address,
    parse_cpulist,
    path_device,
    read_topology,
)

NVIDIA = "0x10de"


class FakeSysfs:
    """Builds a sysfs-shaped directory tree under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def node(
        self,
        node_id: int,
        cpulist: str | None,
        mem_kb: int | None = 1024,
        distance: str | None = None,
    ) -> None:
        base = f"sys/devices/system/node/node{node_id}"
        (self.root / base).mkdir(parents=True, exist_ok=True)
        if cpulist is not None:
            self._write(f"{base}/cpulist", cpulist + "\n")
        if mem_kb is not None:
            self._write(
                f"{base}/meminfo",
                f"Node {node_id} MemTotal:       {mem_kb} kB\n"
                f"Node {node_id} MemFree:        {mem_kb // 2} kB\n",
            )
        if distance is not None:
            self._write(f"{base}/distance", distance + "\n")

    def pci(self, addr: str, cls: str, node: str | None, vendor: str = NVIDIA) -> Path:
        base = f"sys/devices/pci0000:00/{addr}"
        self._write(f"{base}/class", cls + "\n")
        self._write(f"{base}/vendor", vendor + "\n")
        if node is not None:
            self._write(f"{base}/numa_node", node + "\n")
        link = self.root / "sys/bus/pci/devices" / addr
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(self.root / base, link)
        return self.root / base

    def nvme(self, name: str, addr: str | None, node: str | None, model: str = "Fake SSD") -> None:
        ctrl = self.root / "sys/class/nvme" / name
        ctrl.mkdir(parents=True)
        (ctrl / "model").write_text(model + "   \n")
        (ctrl / f"{name}n1").mkdir()
        if addr is not None:
            dev = self.pci(addr, "0x010802", node, vendor="0x144d")
            os.symlink(dev, ctrl / "device")
        elif node is not None:
            (ctrl / "numa_node").write_text(node + "\n")


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path)


def test_cpulist_parsing_round_trips() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("0-6:2") == (0, 2, 4, 6)
    assert parse_cpulist("") == ()
    assert format_cpulist((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    for bad in ("a-b", "3-1", "1,,2"):
        with pytest.raises(KVTierUsageError, match="malformed CPU list"):
            parse_cpulist(bad)


def test_pci_address_normalisation() -> None:
    assert normalize_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_address("3b:00.1") == "0000:3b:00.1"
    with pytest.raises(KVTierUsageError, match="not a PCI address"):
        normalize_pci_address("gpu0")


def test_one_node_tree(fake: FakeSysfs) -> None:
    fake.node(0, "0-7", mem_kb=2048, distance="10")
    fake.pci("0000:00:02.0", "0x030000", "-1")
    topo = read_topology(fake.root)
    assert [n.id for n in topo.nodes] == [0]
    node = topo.nodes[0]
    assert node.cpus == tuple(range(8))
    assert node.mem_total_bytes == 2048 * 1024
    assert node.mem_free_bytes == 1024 * 1024
    assert node.distances == (10,)
    assert len(topo.gpus) == 1
    assert topo.gpus[0].numa_node is None  # -1: no affinity, not an error
    assert topo.gpus[0].vendor == "nvidia"
    assert topo.node_of_cpu(5) == 0
    assert topo.node_of_cpu(99) is None
    assert topo.notes == ()


def test_two_node_tree_with_gpus_and_nvme(fake: FakeSysfs) -> None:
    fake.node(0, "0-3", distance="10 21")
    fake.node(1, "4-7", distance="21 10")
    fake.pci("0000:81:00.0", "0x030200", "1")
    fake.pci("0000:3b:00.0", "0x030200", "0")
    fake.pci("0000:00:1f.0", "0x060100", "0")  # an ISA bridge: not a GPU
    fake.nvme("nvme0", "0000:5e:00.0", "1")
    fake.nvme("nvme1", None, None)  # over fabrics: no PCI function, no affinity
    topo = read_topology(fake.root)
    assert [(g.index, g.pci_address, g.numa_node) for g in topo.gpus] == [
        (0, "0000:3b:00.0", 0),
        (1, "0000:81:00.0", 1),
    ]
    assert topo.nodes[1].distance_to(0) == 21
    nv = {d.name: d for d in topo.nvme}
    assert nv["nvme0"].pci_address == "0000:5e:00.0"
    assert nv["nvme0"].numa_node == 1
    assert nv["nvme0"].model == "Fake SSD"
    assert nv["nvme0"].namespaces == ("nvme0n1",)
    assert nv["nvme1"].pci_address is None and nv["nvme1"].numa_node is None
    assert topo.gpu("3b:00.0").index == 0
    with pytest.raises(KVTierUsageError, match="no GPU 7"):
        topo.gpu(7)
    data = topo.to_dict()
    assert data["gpus"][1]["numa_node"] == 1


def test_missing_files_are_notes_not_errors(fake: FakeSysfs) -> None:
    fake.node(0, None, mem_kb=None)  # neither cpulist nor meminfo
    fake.pci("0000:3b:00.0", "0x030200", None)  # no numa_node file
    topo = read_topology(fake.root)
    assert topo.nodes[0].cpus == ()
    assert topo.nodes[0].mem_total_bytes is None
    assert topo.gpus[0].numa_node is None
    assert any("cpulist" in n for n in topo.notes)


def test_empty_root_has_no_affinity(tmp_path: Path) -> None:
    topo = read_topology(tmp_path)
    assert topo.nodes == () and topo.gpus == () and topo.nvme == ()
    assert any("no NUMA information" in n for n in topo.notes)
    with pytest.raises(KVTierUsageError, match="NUMA node 0 does not exist"):
        topo.node(0)


def test_live_machine_topology_matches_proc() -> None:
    topo = read_topology()
    online = Path("/sys/devices/system/node/online")
    if not online.exists():
        pytest.skip("this kernel exposes no NUMA nodes in sysfs")
    assert [n.id for n in topo.nodes] == list(parse_cpulist(online.read_text()))
    listed = {c for n in topo.nodes for c in n.cpus}
    assert set(os.sched_getaffinity(0)) <= listed


def test_path_device_walks_up_to_the_pci_function(fake: FakeSysfs, tmp_path: Path) -> None:
    fake.nvme("nvme0", "0000:5e:00.0", "1")
    part = fake.root / "sys/devices/pci0000:00/0000:5e:00.0/nvme/nvme0/nvme0n1/nvme0n1p2"
    part.mkdir(parents=True)
    (fake.root / "sys/dev/block").mkdir(parents=True)
    os.symlink(part, fake.root / "sys/dev/block/259:2")
    found = path_device(tmp_path, fake.root, dev=os.makedev(259, 2))
    assert (found.device, found.pci_address, found.numa_node) == ("nvme0n1p2", "0000:5e:00.0", 1)
    assert "node 1" in found.note

    virtual = fake.root / "sys/devices/virtual/block/zram0"
    virtual.mkdir(parents=True)
    os.symlink(virtual, fake.root / "sys/dev/block/253:0")
    ram = path_device(tmp_path, fake.root, dev=os.makedev(253, 0))
    assert ram.device == "zram0" and ram.pci_address is None and ram.numa_node is None

    nothing = path_device(tmp_path, fake.root, dev=os.makedev(0, 44))
    assert nothing.device is None and "not a block device" in nothing.note
    with pytest.raises(KVTierUsageError, match="cannot stat"):
        path_device(tmp_path / "missing")


def test_path_device_on_the_live_machine(tmp_path: Path) -> None:
    found = path_device(tmp_path)
    st = os.stat(tmp_path).st_dev
    block = Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}")
    assert (found.device is not None) == block.exists()
    if found.device is not None:
        assert found.device == Path(os.path.realpath(block)).name


# -- placement --------------------------------------------------------------------------


def two_socket(fake: FakeSysfs, gpu_nodes: list[str]) -> None:
    fake.node(0, "0-1", distance="10 21")
    fake.node(1, "2-3", distance="21 10")
    for i, node in enumerate(gpu_nodes):
        fake.pci(f"0000:{0x10 + i:02x}:00.0", "0x030200", node)


def test_multi_gpu_gets_one_arena_per_gpu_node(fake: FakeSysfs, monkeypatch) -> None:
    monkeypatch.setattr("kvtier.placement._allowed_cpus", lambda: {0, 1, 2, 3})
    two_socket(fake, ["0", "0", "1", "1"])
    plan = plan_placement(read_topology(fake.root))
    assert [(a.gpus, a.memory, a.nodes, a.cpus) for a in plan.arenas] == [
        ((0, 1), "bind", (0,), (0, 1)),
        ((2, 3), "bind", (1,), (2, 3)),
    ]
    assert "node 1" in plan.for_gpu(3).reason
    assert plan.to_dict()["arenas"][0]["gpus"] == (0, 1)


def test_gpu_without_affinity_is_unbound(fake: FakeSysfs) -> None:
    two_socket(fake, ["-1"])
    (arena,) = plan_placement(read_topology(fake.root)).arenas
    assert arena.memory == "none" and arena.nodes == ()
    assert "no NUMA affinity" in arena.reason


def test_memory_only_gpu_node_uses_nearest_memory_and_cpus(fake: FakeSysfs, monkeypatch) -> None:
    monkeypatch.setattr("kvtier.placement._allowed_cpus", lambda: {0, 1, 2, 3})
    fake.node(0, "0-1", distance="10 40 20")
    fake.node(1, "2-3", distance="40 10 30")
    fake.node(2, "", mem_kb=0, distance="20 30 10")  # no CPUs, no memory
    fake.pci("0000:09:00.0", "0x030200", "2")
    (arena,) = plan_placement(read_topology(fake.root)).arenas
    assert arena.nodes == (0,)  # distance 20 beats 30
    assert arena.cpus == (0, 1)
    assert "nearest node with memory" in arena.reason


def test_interleave_none_and_explicit_node(fake: FakeSysfs) -> None:
    two_socket(fake, ["1"])
    topo = read_topology(fake.root)
    (inter,) = plan_placement(topo, "interleave").arenas
    assert (inter.memory, inter.nodes) == ("interleave", (0, 1))
    (off,) = plan_placement(topo, "none").arenas
    assert off.memory == "none"
    (explicit,) = plan_placement(topo, node=0).arenas
    assert (explicit.memory, explicit.nodes) == ("bind", (0,))
    with pytest.raises(KVTierUsageError, match="NUMA node 5 does not exist"):
        plan_placement(topo, node=5)
    with pytest.raises(KVTierUsageError, match="placement mode"):
        plan_placement(topo, "nearest")  # type: ignore[arg-type]


def test_single_node_and_no_gpu(fake: FakeSysfs) -> None:
    fake.node(0, "0-3")
    (arena,) = plan_placement(read_topology(fake.root)).arenas
    assert arena.memory == "none" and "single NUMA node" in arena.reason
    (local,) = plan_placement(read_topology(fake.root), "local").arenas
    assert local.memory == "none" and "no GPU" in local.reason


# -- the CLI ----------------------------------------------------------------------------


def test_cli_inspect_topology_json_and_errors(fake: FakeSysfs, monkeypatch) -> None:
    import json

    from kvtier.cli.app import get_app
    from typer.testing import CliRunner

    monkeypatch.setattr("kvtier.placement._allowed_cpus", lambda: {0, 1, 2, 3})
    two_socket(fake, ["1"])
    fake.nvme("nvme0", "0000:5e:00.0", "0")
    runner = CliRunner()
    args = ["inspect", "topology", "--root", str(fake.root), "--no-nvml"]
    result = runner.invoke(get_app(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [n["id"] for n in data["topology"]["nodes"]] == [0, 1]
    assert data["topology"]["gpus"][0]["numa_node"] == 1
    assert data["topology"]["nvme"][0]["numa_node"] == 0
    (arena,) = data["placement"]["arenas"]
    assert (arena["memory"], arena["nodes"], arena["cpus"]) == ("bind", [1], [2, 3])
    assert "node 1" in arena["reason"]

    human = runner.invoke(get_app(), args)
    assert human.exit_code == 0
    assert "host arena placement" in human.stdout and "0000:10:00.0" in human.stdout

    bad = runner.invoke(get_app(), [*args, "--numa-node", "9"])
    assert bad.exit_code == 2
    assert "NUMA node 9 does not exist" in bad.output
    with_path = runner.invoke(get_app(), [*args, "--json", "--path", str(fake.root)])
    assert with_path.exit_code == 0
    assert json.loads(with_path.stdout)["paths"][0]["path"] == str(fake.root)

    bad_mode = runner.invoke(get_app(), [*args, "--placement", "nearest"])
    assert bad_mode.exit_code == 2
    assert "--placement must be auto, local, interleave or none" in bad_mode.output
