"""Hardware profiles and model compute figures for the cost model.

A :class:`HardwareProfile` gives the effective compute rate of one serving node, its HBM
bandwidth and size, and per tier the bandwidth and latency of bringing KV up to the
compute device. Figures are nominal datasheet values derated by the stated efficiency;
they are assumptions, listed here so every modeled number can be traced to them.

The ``cpu`` profile stands for this CI machine class; ``load_profile`` reads a JSON file
(e.g. written from ``kvtier bench io`` measurements) with the same fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierUsageError

GB = 1e9


@dataclass(frozen=True)
class LinkProfile:
    """Moving KV from a tier to the compute device: bytes/s and a per-transfer latency."""

    bandwidth: float
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` (0 bytes cost nothing)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class HardwareProfile:
    """One serving node.

    Attributes:
        name: profile name.
        gpus: accelerators in the node (tensor parallel across all of them).
        flops: effective dense compute of the node for prefill, FLOP/s (peak x MFU).
        mem_bw: memory bandwidth of the node's accelerators, bytes/s (decode reads).
        mem_bytes: accelerator memory of the node, bytes.
        links: per tier name, the path from that tier to the compute memory.
        tier_bytes: per tier name, the capacity the node offers there.
        description: where the figures come from.
    """

    name: str
    gpus: int
    flops: float
    mem_bw: float
    mem_bytes: float
    links: dict[str, LinkProfile]
    tier_bytes: dict[str, float] = field(default_factory=dict)
    description: str = ""

    def link(self, tier: str) -> LinkProfile:
        """The link of ``tier``; :class:`KVTierUsageError` naming known tiers otherwise."""
        try:
            return self.links[tier]
        except KeyError:
            known = ", ".join(self.links)
            raise KVTierUsageError(
                f"hardware profile {self.name!r} has no tier {tier!r}; known: {known}"
            ) from None


# PCIe Gen5 x16: 64 GB/s per direction nominal, ~55 GB/s achieved by pinned DMA.
_PCIE5 = LinkProfile(55 * GB, 10e-6)
_PCIE4 = LinkProfile(26 * GB, 10e-6)

#: Built-in profiles. H200: 989 TFLOP/s dense bf16 per GPU at 40 % MFU for prefill,
#: 4.8 TB/s HBM3e, 141 GB; Gen5 NVMe ~14 GB/s, Gen4 ~7 GB/s per drive (4 drives per node);
#: network as named, ~90 % of line rate, 20 us latency.
PROFILES: dict[str, HardwareProfile] = {
    "h200-gen5": HardwareProfile(
        "h200-gen5",
        gpus=8,
        flops=8 * 989e12 * 0.4,
        mem_bw=8 * 4.8e12,
        mem_bytes=8 * 141 * GB,
        links={
            "hbm": LinkProfile(8 * 4.8e12),
            "dram": LinkProfile(8 * _PCIE5.bandwidth, _PCIE5.latency_s),
            "nvme": LinkProfile(4 * 14 * GB, 80e-6),
            "remote": LinkProfile(8 * 400e9 / 8 * 0.9, 20e-6),
        },
        tier_bytes={"hbm": 8 * 141 * GB, "dram": 2048 * GB, "nvme": 30_000 * GB},
        description="8x H200 (HBM3e), PCIe Gen5 x16 per GPU, 4x Gen5 NVMe, 400 Gb/s NIC per GPU",
    ),
    "h200-gen4": HardwareProfile(
        "h200-gen4",
        gpus=8,
        flops=8 * 989e12 * 0.4,
        mem_bw=8 * 4.8e12,
        mem_bytes=8 * 141 * GB,
        links={
            "hbm": LinkProfile(8 * 4.8e12),
            "dram": LinkProfile(8 * _PCIE4.bandwidth, _PCIE4.latency_s),
            "nvme": LinkProfile(4 * 7 * GB, 100e-6),
            "remote": LinkProfile(8 * 100e9 / 8 * 0.9, 20e-6),
        },
        tier_bytes={"hbm": 8 * 141 * GB, "dram": 2048 * GB, "nvme": 30_000 * GB},
        description="8x H200 on PCIe Gen4 x16, 4x Gen4 NVMe, 100 Gb/s NIC per GPU",
    ),
    "cpu": HardwareProfile(
        "cpu",
        gpus=0,
        flops=0.2e12,
        mem_bw=20 * GB,
        mem_bytes=16 * GB,
        links={
            "dram": LinkProfile(10 * GB, 1e-6),
            "nvme": LinkProfile(1.5 * GB, 150e-6),
            "remote": LinkProfile(1.1 * GB, 100e-6),
        },
        tier_bytes={"dram": 16 * GB, "nvme": 200 * GB},
        description="2-core CPU server, no GPU: DRAM is the top tier (assumed figures; "
        "replace with a profile written from `kvtier bench io`)",
    ),
}


def profile(name: str) -> HardwareProfile:
    """The built-in profile ``name``, or a JSON file path; clear error otherwise."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        return load_profile(name)
    known = ", ".join(sorted(PROFILES))
    raise KVTierUsageError(f"unknown hardware profile {name!r}; known: {known} or a .json file")


#: The smallest rate a profile may give (FLOP/s, bytes/s): slower is no hardware, and a
#: rate like 5e-324 made the cost model's times infinite (then NaN).
MIN_RATE = 1.0
#: The longest per-transfer latency a profile may give, seconds (an hour): beyond it the
#: cost model's sums overflow to infinity.
MAX_LATENCY_S = 3600.0
#: The most accelerators a node of a profile may have.
MAX_GPUS = 1 << 20


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile from JSON (same fields as :class:`HardwareProfile`; links as
    ``{"tier": {"bandwidth": B/s, "latency_s": s}}``).

    Every figure must be a JSON number (not a string, a boolean or null) within its range:
    ``flops``, ``mem_bw`` and each link's ``bandwidth`` finite and at least
    :data:`MIN_RATE` per second; ``mem_bytes`` finite and > 0; each ``latency_s``
    (default 0) finite, from 0 to :data:`MAX_LATENCY_S`; each ``tier_bytes`` finite and
    >= 0; ``gpus`` (default 0) an integer from 0 to :data:`MAX_GPUS`; ``links`` an object
    of at least one tier. Anything else raises :class:`KVTierUsageError` naming the
    file, the field and the value (never an ``OverflowError`` or ``RecursionError``)."""
    p = Path(path)
    raw = _read_object(p)
    links_raw = _field(raw, "links", p)
    if not isinstance(links_raw, dict) or not links_raw:
        raise KVTierUsageError(
            f"hardware profile {p}: links must be a JSON object of at least one tier, e.g. "
            f'{{"dram": {{"bandwidth": 1e10, "latency_s": 1e-6}}}}, got {_shown(links_raw)}'
        )
    tier_raw = raw.get("tier_bytes", {})
    if not isinstance(tier_raw, dict):
        raise KVTierUsageError(
            f"hardware profile {p}: tier_bytes must be a JSON object of tier sizes in bytes, "
            f"got {_shown(tier_raw)}"
        )
    return HardwareProfile(
        name=str(raw.get("name", p.stem)),
        gpus=_gpus(raw.get("gpus", 0), p),
        flops=_rate(_field(raw, "flops", p), "flops", p),
        mem_bw=_rate(_field(raw, "mem_bw", p), "mem_bw", p),
        mem_bytes=_size(_field(raw, "mem_bytes", p), "mem_bytes", p, positive=True),
        links={str(k): _link(v, f"links.{k}", p) for k, v in links_raw.items()},
        tier_bytes={str(k): _size(v, f"tier_bytes.{k}", p) for k, v in tier_raw.items()},
        description=str(raw.get("description", "")),
    )


def _read_object(p: Path) -> dict[str, Any]:
    """The JSON object in file ``p``; :class:`KVTierUsageError` naming the file when it
    cannot be read, is not JSON (or nests too deeply to parse) or is not an object."""
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise KVTierUsageError(f"hardware profile file not found: {p}") from None
    except OSError as exc:  # a directory, no permission
        raise KVTierUsageError(f"hardware profile {p} cannot be read: {exc.strerror}") from None
    except RecursionError:
        raise KVTierUsageError(f"hardware profile {p}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of too many digits
        raise KVTierUsageError(f"hardware profile {p}: invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KVTierUsageError(
            f"hardware profile {p}: must be a JSON object of fields "
            f"(flops, mem_bw, mem_bytes, links, ...), got a {type(raw).__name__}"
        )
    return raw


def _field(raw: dict[str, Any], name: str, p: Path) -> Any:
    """``raw[name]``; :class:`KVTierUsageError` naming the missing field otherwise."""
    if name not in raw:
        raise KVTierUsageError(f"hardware profile {p}: missing field {name!r}")
    return raw[name]


def _shown(value: Any) -> str:
    """A JSON value as the message shows it: numbers as floats (``0.0``; ``inf`` beyond
    the float range; the digit count of an integer too long for a float); anything else
    as its JSON text and kind (``nan (a string)``, ``true (a boolean)``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{json.dumps(value)} (a boolean)"
    if isinstance(value, int):
        try:
            return repr(float(value))
        except OverflowError:
            return f"a {len(str(abs(value)))}-digit integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f"{value} (a string: write a JSON number, without quotes)"
    return f"{json.dumps(value)[:60]} ({'a list' if isinstance(value, list) else 'an object'})"


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number within the float range; ``None`` for
    anything else (a string, a boolean, null, a list, an integer of 400 digits)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _rate(value: Any, name: str, p: Path) -> float:
    """A rate (FLOP/s, bytes/s): a finite JSON number of at least :data:`MIN_RATE`."""
    number = _number(value)
    if number is None or number <= 0:
        raise KVTierUsageError(
            f"hardware profile {p}: {name} must be a finite number > 0, got {_shown(value)}"
        )
    if number < MIN_RATE:
        raise KVTierUsageError(
            f"hardware profile {p}: {name} must be at least {MIN_RATE:g} per second, got {number!r}"
        )
    return number


def _size(value: Any, name: str, p: Path, positive: bool = False) -> float:
    """A size in bytes: a finite JSON number, > 0 when ``positive``, else >= 0."""
    number = _number(value)
    if number is None or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise KVTierUsageError(
            f"hardware profile {p}: {name} must be a finite number {bound}, got {_shown(value)}"
        )
    return number


def _latency(value: Any, name: str, p: Path) -> float:
    """A latency in seconds: a finite JSON number from 0 to :data:`MAX_LATENCY_S`."""
    number = _size(value, name, p)
    if number > MAX_LATENCY_S:
        raise KVTierUsageError(
            f"hardware profile {p}: {name} must be at most {MAX_LATENCY_S:g} s (an hour), "
            f"got {number!r}"
        )
    return number


def _link(value: Any, name: str, p: Path) -> LinkProfile:
    """A link: an object with ``bandwidth`` (:func:`_rate`) and optional ``latency_s``
    (:func:`_latency`, default 0)."""
    if not isinstance(value, dict):
        raise KVTierUsageError(
            f"hardware profile {p}: {name} must be a JSON object "
            f'{{"bandwidth": B/s, "latency_s": s}}, got {_shown(value)}'
        )
    if "bandwidth" not in value:
        raise KVTierUsageError(f"hardware profile {p}: missing field '{name}.bandwidth'")
    return LinkProfile(
        _rate(value["bandwidth"], f"{name}.bandwidth", p),
        _latency(value.get("latency_s", 0.0), f"{name}.latency_s", p),
    )


def _gpus(value: Any, p: Path) -> int:
    """The accelerator count: a JSON integer from 0 (a CPU node) to :data:`MAX_GPUS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPUS:
        small = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**18
        raise KVTierUsageError(
            f"hardware profile {p}: gpus must be an integer from 0 to {MAX_GPUS}, "
            f"got {value if small else _shown(value)}"
        )
    return value


@dataclass(frozen=True)
class ModelCompute:
    """What prefill and decode cost for a model: parameters and attention width."""

    params: float
    q_width: int  # query heads x head dim (attention FLOPs per token and context token)
    weight_bytes_per_param: float = 2.0


#: Compute figures for the KVSpec presets (active parameters for MoE).
MODEL_COMPUTE: dict[str, ModelCompute] = {
    "llama3-8b": ModelCompute(8.0e9, 32 * 128),
    "llama3-70b": ModelCompute(70.6e9, 64 * 128),
    "qwen3-32b": ModelCompute(32.8e9, 64 * 128),
    "deepseek-v3": ModelCompute(37e9, 128 * 192),
    "article-example": ModelCompute(1.0e9, 128 * 512),
    "tiny": ModelCompute(1.0e6, 2 * 8),
}
