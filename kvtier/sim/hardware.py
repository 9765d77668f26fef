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


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile from JSON (same fields as :class:`HardwareProfile`; links as
    ``{"tier": {"bandwidth": B/s, "latency_s": s}}``)."""
    p = Path(path)
    try:
        raw: dict[str, Any] = json.loads(p.read_text())
        if not isinstance(raw, dict):
            raise KVTierUsageError(
                f"hardware profile {p}: must be a JSON object of fields "
                f"(flops, mem_bw, mem_bytes, links, ...), got a {type(raw).__name__}"
            )
        links = {
            k: LinkProfile(float(v["bandwidth"]), float(v.get("latency_s", 0.0)))
            for k, v in raw["links"].items()
        }
        hw = HardwareProfile(
            name=str(raw.get("name", p.stem)),
            gpus=int(raw.get("gpus", 0)),
            flops=float(raw["flops"]),
            mem_bw=float(raw["mem_bw"]),
            mem_bytes=float(raw["mem_bytes"]),
            links=links,
            tier_bytes={k: float(v) for k, v in raw.get("tier_bytes", {}).items()},
            description=str(raw.get("description", "")),
        )
    except FileNotFoundError:
        raise KVTierUsageError(f"hardware profile file not found: {p}") from None
    except KeyError as exc:
        raise KVTierUsageError(f"hardware profile {p}: missing field {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise KVTierUsageError(f"hardware profile {p}: bad field: {exc}") from None
    except OSError as exc:  # a directory, no permission
        raise KVTierUsageError(f"hardware profile {p} cannot be read: {exc.strerror}") from None
    _check_profile(hw, p)
    return hw


def _check_profile(hw: HardwareProfile, p: Path) -> None:
    """Rates and sizes are finite and > 0, latencies finite and >= 0: the cost model
    divides by them (a 0 flops profile raised ZeroDivisionError; a negative bandwidth
    gave negative transfer times)."""
    fields = {"flops": hw.flops, "mem_bw": hw.mem_bw, "mem_bytes": hw.mem_bytes}
    fields.update({f"links.{k}.bandwidth": v.bandwidth for k, v in hw.links.items()})
    for name, value in fields.items():
        if not (math.isfinite(value) and value > 0):
            raise KVTierUsageError(
                f"hardware profile {p}: {name} must be a finite number > 0, got {value!r}"
            )
    lat = {f"links.{k}.latency_s": v.latency_s for k, v in hw.links.items()}
    lat.update({f"tier_bytes.{k}": v for k, v in hw.tier_bytes.items()})
    for name, value in lat.items():
        if not (math.isfinite(value) and value >= 0):
            raise KVTierUsageError(
                f"hardware profile {p}: {name} must be a finite number >= 0, got {value!r}"
            )


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
