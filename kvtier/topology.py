"""The machine's NUMA topology: nodes, GPUs and NVMe devices, and which node each sits on.

Everything comes from sysfs (``/sys/devices/system/node``, ``/sys/bus/pci/devices``,
``/sys/class/nvme``), read under a configurable root so that tests can point it at a fake
tree. When the NVIDIA management library (``libnvidia-ml.so.1``) loads, GPU indices, names
and PCI addresses come from NVML (through ctypes) and sysfs supplies each GPU's node.

A device whose node is missing or ``-1`` has *no affinity* (``numa_node is None``): that is
normal on single-socket machines and in VMs, never an error. Reading never raises for a
missing or unreadable file; what could not be read is recorded in :attr:`Topology.notes`.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import KVTierUsageError

#: PCI class codes (upper 16 bits of the 24-bit class) of display and 3D controllers.
_GPU_CLASSES = {0x0300, 0x0302}
#: PCI vendor ids with a name kvtier prints.
_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}
_NODE_DIR = re.compile(r"^node(\d+)$")
_PCI_ADDR = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):"
    r"(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$"
)


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node.

    Attributes:
        id: node number.
        cpus: CPUs of the node (may be empty: memory-only nodes, e.g. GPU memory on
            Grace Hopper or CXL memory).
        mem_total_bytes: memory of the node, ``None`` when meminfo was unreadable.
        mem_free_bytes: free memory of the node, ``None`` when unreadable.
        distances: the ACPI SLIT row: distance to node ``i`` at index ``i`` (empty when
            unknown). 10 means local.
    """

    id: int
    cpus: tuple[int, ...]
    mem_total_bytes: int | None = None
    mem_free_bytes: int | None = None
    distances: tuple[int, ...] = ()

    @property
    def has_memory(self) -> bool:
        """Whether the node has memory to allocate from (unknown counts as yes)."""
        return self.mem_total_bytes is None or self.mem_total_bytes > 0

    def distance_to(self, other: int) -> int | None:
        """SLIT distance to node ``other``, ``None`` when unknown."""
        if 0 <= other < len(self.distances):
            return self.distances[other]
        return None


@dataclass(frozen=True)
class GpuDevice:
    """One GPU.

    Attributes:
        index: position in PCI-bus order (the NVML index; equal to the CUDA index when
            ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        pci_address: normalised ``dddd:bb:dd.f`` (lower case).
        numa_node: the node the GPU attaches to, ``None`` for no affinity.
        vendor: ``nvidia``, ``amd``, ... or the hex vendor id.
        name: the product name when NVML knows it.
        source: where the GPU was found: ``sysfs`` or ``nvml``.
    """

    index: int
    pci_address: str
    numa_node: int | None
    vendor: str
    name: str | None = None
    source: Literal["sysfs", "nvml"] = "sysfs"


@dataclass(frozen=True)
class NvmeDevice:
    """One NVMe controller.

    Attributes:
        name: controller name (``nvme0``).
        pci_address: its PCI address, ``None`` for non-PCI transports (fabrics).
        numa_node: the node it attaches to, ``None`` for no affinity.
        model: the model string, when readable.
        namespaces: block devices of the controller (``nvme0n1``, ...).
    """

    name: str
    pci_address: str | None
    numa_node: int | None
    model: str | None = None
    namespaces: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    """What :func:`read_topology` found.

    Attributes:
        nodes: NUMA nodes, by id; empty when the kernel exposes none (no NUMA support or
            sysfs not mounted): then nothing has affinity.
        gpus: GPUs in PCI-bus order.
        nvme: NVMe controllers, by name.
        notes: what could not be read, in words (never fatal).
    """

    nodes: tuple[NumaNode, ...] = ()
    gpus: tuple[GpuDevice, ...] = ()
    nvme: tuple[NvmeDevice, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def node(self, node_id: int) -> NumaNode:
        """The node ``node_id``; :class:`KVTierUsageError` naming the known ones if absent."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        known = ", ".join(str(n.id) for n in self.nodes) or "none"
        raise KVTierUsageError(f"NUMA node {node_id} does not exist (nodes here: {known})")

    def node_of_cpu(self, cpu: int) -> int | None:
        """The node holding ``cpu``, ``None`` when no node lists it."""
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        return None

    def gpu(self, ref: int | str) -> GpuDevice:
        """A GPU by index or PCI address; :class:`KVTierUsageError` when there is none."""
        if isinstance(ref, str):
            addr = normalize_pci_address(ref)
            for g in self.gpus:
                if g.pci_address == addr:
                    return g
        else:
            for g in self.gpus:
                if g.index == ref:
                    return g
        known = ", ".join(f"{g.index} ({g.pci_address})" for g in self.gpus) or "none"
        raise KVTierUsageError(f"no GPU {ref!r} on this machine (GPUs: {known})")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON)."""
        return asdict(self)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a sysfs CPU list such as ``0-3,8,10-11`` (or ``0-7:2`` strides).

    An empty string is an empty list. Raises :class:`KVTierUsageError` on malformed text.
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                rng, _, stride_s = part.partition(":")
                lo_s, hi_s = rng.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                stride = int(stride_s) if stride_s else 1
                if lo > hi or stride < 1:
                    raise ValueError(part)
                cpus.update(range(lo, hi + 1, stride))
            else:
                cpus.add(int(part))
        except ValueError:
            raise KVTierUsageError(f"malformed CPU list {text!r} (at {part!r})") from None
    if any(c < 0 for c in cpus):
        raise KVTierUsageError(f"malformed CPU list {text!r}: negative CPU")
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact sysfs form of a CPU set: ``(0, 1, 2, 5)`` -> ``0-2,5``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def normalize_pci_address(addr: str) -> str:
    """``0000:3B:00.0``, ``00000000:3b:00.0`` (NVML) or ``3b:00.0`` -> ``0000:3b:00.0``.

    Raises :class:`KVTierUsageError` when ``addr`` is not a PCI address.
    """
    m = _PCI_ADDR.match(addr.strip())
    if m is None:
        raise KVTierUsageError(f"{addr!r} is not a PCI address (expected dddd:bb:dd.f)")
    domain = int(m["domain"] or "0", 16)
    return f"{domain:04x}:{m['bus'].lower()}:{m['dev'].lower()}.{m['fn']}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _node_value(text: str | None) -> int | None:
    """A sysfs ``numa_node`` value: ``-1``, missing or junk all mean no affinity."""
    if text is None:
        return None
    try:
        node = int(text.strip())
    except ValueError:
        return None
    return node if node >= 0 else None


def _meminfo(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    total = free = None
    for line in text.splitlines():
        m = re.match(r"Node\s+\d+\s+(MemTotal|MemFree):\s+(\d+)\s*kB", line)
        if m:
            value = int(m.group(2)) * 1024
            if m.group(1) == "MemTotal":
                total = value
            else:
                free = value
    return total, free


def _read_nodes(root: Path, notes: list[str]) -> list[NumaNode]:
    base = root / "sys/devices/system/node"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        notes.append(f"no NUMA information ({base} unreadable): nothing has affinity")
        return []
    nodes: list[NumaNode] = []
    for entry in entries:
        m = _NODE_DIR.match(entry)
        if not m:
            continue
        node_dir = base / entry
        cpulist = _read(node_dir / "cpulist")
        try:
            cpus = parse_cpulist(cpulist) if cpulist is not None else ()
        except KVTierUsageError as exc:
            notes.append(f"{node_dir / 'cpulist'}: {exc}")
            cpus = ()
        if cpulist is None:
            notes.append(f"{node_dir / 'cpulist'} unreadable: node {m.group(1)} has no CPUs")
        total, free = _meminfo(_read(node_dir / "meminfo"))
        dist_text = _read(node_dir / "distance")
        try:
            distances = tuple(int(x) for x in dist_text.split()) if dist_text else ()
        except ValueError:
            notes.append(f"{node_dir / 'distance'} malformed: distances unknown")
            distances = ()
        nodes.append(NumaNode(int(m.group(1)), cpus, total, free, distances))
    nodes.sort(key=lambda n: n.id)
    if not nodes:
        notes.append(f"no node directories in {base}: nothing has affinity")
    return nodes


def _hex(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


def _read_sysfs_gpus(root: Path, notes: list[str]) -> list[GpuDevice]:
    base = root / "sys/bus/pci/devices"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        notes.append(f"no PCI information ({base} unreadable): GPUs unknown")
        return []
    gpus: list[GpuDevice] = []
    for entry in entries:
        dev = base / entry
        cls = _hex(_read(dev / "class"))
        if cls is None or (cls >> 8) not in _GPU_CLASSES:
            continue
        try:
            addr = normalize_pci_address(entry)
        except KVTierUsageError:
            continue
        vendor_id = _hex(_read(dev / "vendor"))
        vendor = _VENDORS.get(vendor_id or -1, f"{vendor_id:#06x}" if vendor_id else "unknown")
        gpus.append(GpuDevice(0, addr, _node_value(_read(dev / "numa_node")), vendor))
    gpus.sort(key=lambda g: g.pci_address)
    return [GpuDevice(i, g.pci_address, g.numa_node, g.vendor) for i, g in enumerate(gpus)]


class _NvmlPciInfo(ctypes.Structure):
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


def _nvml_gpus(notes: list[str]) -> list[tuple[str, str | None]] | None:
    """(PCI address, name) of every GPU NVML reports, in NVML order; ``None`` without NVML."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle_t = ctypes.c_void_p
    try:
        lib.nvmlInit_v2.argtypes = []
        lib.nvmlInit_v2.restype = ctypes.c_int
        lib.nvmlShutdown.argtypes = []
        lib.nvmlShutdown.restype = ctypes.c_int
        lib.nvmlDeviceGetCount_v2.argtypes = [ctypes.POINTER(ctypes.c_uint)]
        lib.nvmlDeviceGetCount_v2.restype = ctypes.c_int
        lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(handle_t)]
        lib.nvmlDeviceGetHandleByIndex_v2.restype = ctypes.c_int
        lib.nvmlDeviceGetPciInfo_v3.argtypes = [handle_t, ctypes.POINTER(_NvmlPciInfo)]
        lib.nvmlDeviceGetPciInfo_v3.restype = ctypes.c_int
        lib.nvmlDeviceGetName.argtypes = [handle_t, ctypes.c_char_p, ctypes.c_uint]
        lib.nvmlDeviceGetName.restype = ctypes.c_int
    except AttributeError as exc:
        notes.append(f"NVML too old ({exc}): GPUs from sysfs only")
        return None
    rc = lib.nvmlInit_v2()
    if rc != 0:
        notes.append(f"NVML present but nvmlInit failed (code {rc}): GPUs from sysfs only")
        return None
    out: list[tuple[str, str | None]] = []
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            notes.append("NVML could not count devices: GPUs from sysfs only")
            return None
        for i in range(count.value):
            handle = handle_t()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                notes.append(f"NVML could not open GPU {i}")
                continue
            pci = _NvmlPciInfo()
            if lib.nvmlDeviceGetPciInfo_v3(handle, ctypes.byref(pci)) != 0:
                notes.append(f"NVML could not read the PCI address of GPU {i}")
                continue
            name_buf = ctypes.create_string_buffer(96)
            name = None
            if lib.nvmlDeviceGetName(handle, name_buf, 96) == 0:
                name = name_buf.value.decode(errors="replace")
            try:
                out.append((normalize_pci_address(pci.busId.decode()), name))
            except KVTierUsageError:
                notes.append(f"NVML gave GPU {i} an unparsable PCI address {pci.busId!r}")
    finally:
        lib.nvmlShutdown()
    return out


def _read_nvme(root: Path, notes: list[str]) -> list[NvmeDevice]:
    base = root / "sys/class/nvme"
    try:
        entries = sorted(e for e in os.listdir(base) if re.fullmatch(r"nvme\d+", e))
    except OSError:
        return []  # no NVMe driver loaded: nothing to report
    devices: list[NvmeDevice] = []
    for entry in entries:
        ctrl = base / entry
        device = ctrl / "device"
        pci: str | None
        try:
            pci = normalize_pci_address(os.path.basename(os.path.realpath(device)))
        except KVTierUsageError:
            pci = None  # NVMe over fabrics: no PCI function
        node_text = _read(device / "numa_node")
        if node_text is None:
            node_text = _read(ctrl / "numa_node")
        model = _read(ctrl / "model")
        try:
            namespaces = tuple(
                sorted(e for e in os.listdir(ctrl) if re.fullmatch(rf"{entry}(c\d+)?n\d+", e))
            )
        except OSError:
            namespaces = ()
        devices.append(
            NvmeDevice(
                entry,
                pci,
                _node_value(node_text),
                model.strip() if model else None,
                namespaces,
            )
        )
    return devices


@dataclass(frozen=True)
class PathDevice:
    """The block device a path lives on, and that device's NUMA node.

    Attributes:
        path: the path asked about.
        device: the block device (``nvme0n1p1``, ``vda``), ``None`` when the path is on no
            block device (tmpfs, overlay, network file systems).
        pci_address: the PCI function serving it, when there is one.
        numa_node: that function's node, ``None`` for no affinity or unknown.
        note: how this was found, or why nothing was.
    """

    path: str
    device: str | None
    pci_address: str | None
    numa_node: int | None
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def path_device(
    path: str | os.PathLike[str], root: str | os.PathLike[str] = "/", dev: int | None = None
) -> PathDevice:
    """Which block device ``path`` is on and that device's NUMA node (where to run the
    store's I/O threads). Never raises for sysfs problems; ``dev`` overrides the device
    number (for tests). Raises :class:`KVTierUsageError` when ``path`` does not exist.
    """
    try:
        st_dev = os.stat(path).st_dev if dev is None else dev
    except OSError as exc:
        raise KVTierUsageError(f"cannot stat {os.fspath(path)!r}: {exc.strerror}") from None
    major, minor = os.major(st_dev), os.minor(st_dev)
    name = os.fspath(path)
    link = Path(root) / f"sys/dev/block/{major}:{minor}"
    if not link.exists():
        why = f"device {major}:{minor} is not a block device (tmpfs, overlay, network)"
        return PathDevice(name, None, None, None, f"{why}: no affinity")
    real = Path(os.path.realpath(link))
    device = real.name
    pci: str | None = None
    node: int | None = None
    for parent in [real, *real.parents]:
        try:
            addr = normalize_pci_address(parent.name)
        except KVTierUsageError:
            continue
        pci = addr
        node = _node_value(_read(parent / "numa_node"))
        break
    if pci is None:
        return PathDevice(name, device, None, None, f"{device} has no PCI function: no affinity")
    where = "no affinity (numa_node -1)" if node is None else f"node {node}"
    return PathDevice(name, device, pci, node, f"{device} on PCI {pci}: {where}")


def read_topology(root: str | os.PathLike[str] = "/", use_nvml: bool = True) -> Topology:
    """Read the topology under ``root`` (``/`` on a live machine). Never raises for
    missing or unreadable sysfs files: see :attr:`Topology.notes`.

    With ``use_nvml`` (and only when ``root`` is ``/``), GPUs are listed in NVML order with
    their names; sysfs supplies their nodes. Without NVML, GPUs are the PCI display/3D
    controllers in bus order.
    """
    base = Path(root)
    notes: list[str] = []
    nodes = _read_nodes(base, notes)
    gpus = _read_sysfs_gpus(base, notes)
    if use_nvml and base == Path("/"):
        nv = _nvml_gpus(notes)
        if nv is not None:
            by_addr = {g.pci_address: g for g in gpus}
            gpus = []
            for i, (addr, name) in enumerate(nv):
                known = by_addr.get(addr)
                node = known.numa_node if known else None
                gpus.append(GpuDevice(i, addr, node, "nvidia", name, "nvml"))
    nvme = _read_nvme(base, notes)
    return Topology(tuple(nodes), tuple(gpus), tuple(nvme), tuple(notes))
