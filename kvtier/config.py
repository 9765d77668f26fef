"""Configuration: TOML files, ``KVTIER_*`` environment variables and Python objects.

Every value of a resolved configuration remembers where it came from (``default``,
``file:PATH``, ``python``, ``env:KVTIER_...``) so that ``kvtier inspect config`` can show
it. Layers apply in this order, later ones winning: the embedded default, then the given
source (a TOML file, a dict or a :class:`KVTierConfig`), then the environment.

The file format::

    [model]                   # a preset, optionally with field overrides, or every field
    preset = "llama3-8b"      # or: num_layers, num_kv_heads, head_dim, dtype, page_tokens,
                              #     mla, name
    [namespace]
    model_id = "meta-llama/Llama-3.1-8B"   # default: the model name
    revision = "main"
    rank = 0
    [pipeline]
    write_policy = "write-through"   # write-through | write-back | selective
    admission = "all"                # admission policy for "selective"
    batch_pages = 32                 # pages per transfer batch
    max_inflight_per_link = 4        # batches in flight per link
    [log]
    format = "console"               # console | json
    level = "info"
    [[tiers]]                        # top tier first
    name = "dram"
    backend = "dram"                 # entry-point name or "module:Class"
    capacity = "4GiB"                # bytes, or a size string
    high_watermark = 0.80            # default 0.80 / 0.70 / 0.90 by position
    low_watermark = 0.70             # default high - 0.10
    eviction = "adaptive"            # adaptive (default) | lru | lru-k | arc | s3-fifo | ...
    [tiers.eviction_params]          # e.g. k = 2 for lru-k
    [tiers.options]                  # passed to the backend, e.g. path = "/mnt/nvme/kv"

Environment variables use ``__`` between levels: ``KVTIER_MODEL__PRESET=llama3-70b``,
``KVTIER_PIPELINE__WRITE_POLICY=write-back``, ``KVTIER_TIERS__DRAM__CAPACITY=2GiB``
(a tier by name or by index), ``KVTIER_TIERS__FILE__OPTIONS__PATH=/tmp/kv``. Values are
parsed as TOML literals when they are one (numbers, booleans), else taken as strings.
``KVTIER_CONFIG=PATH`` names a TOML file used when no source is given. Other ``KVTIER_``
variables without ``__`` are left to other parts of kvtier.

Every mistake raises :class:`~kvtier.errors.ConfigError` naming the key (``tiers[1].capacity``)
and the source it came from.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import Namespace
from kvtier.spec import KVSpec, preset

WritePolicy = Literal["write-through", "write-back", "selective"]
WRITE_POLICIES: tuple[str, ...] = ("write-through", "write-back", "selective")

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"

#: Default high watermark of a tier by position: the top 0.80, the next 0.70 (the source
#: article's L1/L2 figures), lower ones 0.90 (stores have no hot working set to protect,
#: and their eviction only drops or hands down pages).
DEFAULT_HIGH_WATERMARKS: tuple[float, ...] = (0.80, 0.70)
DEFAULT_LOWER_HIGH_WATERMARK = 0.90
#: Default low watermark = high - this: evicting 10 % of a tier at a time makes batches
#: large enough to amortise transfers without emptying the tier.
DEFAULT_HYSTERESIS = 0.10

#: Where the embedded default's file store keeps pages (under the working directory).
DEFAULT_STORE_DIR = ".kvtier-cache/file"

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a size string (``"4GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"4096"``).

    ``KiB``/``MiB``/``GiB`` are powers of 1024, ``KB``/``MB``/``GB`` powers of 1000; a bare
    ``K``/``M``/``G`` means the binary unit. Raises :class:`ConfigError` naming ``key``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            number, unit, binary, _b = m.groups()
            base = 1000 if (unit and not binary and _b) else 1024
            result = float(number) * base ** _SIZE_POWERS[unit.lower()]
            if result.is_integer() or unit:
                return int(result)
    raise ConfigError(f"{key}: cannot parse {value!r} as a size (e.g. 4096, '512MiB', '4GiB')")


def format_size(nbytes: int) -> str:
    """Human form of a byte count with binary units (``4.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - loop always returns


def default_watermarks(position: int) -> tuple[float, float]:
    """(high, low) default watermarks of the tier at ``position`` (0 = top)."""
    high = (
        DEFAULT_HIGH_WATERMARKS[position]
        if position < len(DEFAULT_HIGH_WATERMARKS)
        else DEFAULT_LOWER_HIGH_WATERMARK
    )
    return high, round(high - DEFAULT_HYSTERESIS, 6)


@dataclass
class TierConfig:
    """One tier: a backend instance with capacity, watermarks and an eviction policy.

    Attributes:
        name: unique label (``dram``, ``nvme``...), used in metrics and logs.
        backend: entry-point name (``dram``, ``file``, ``nvme``, ``redis``) or ``module:Class``.
        capacity_bytes: bytes of pages this tier may hold (whole pages are used).
        high_watermark: fraction of capacity past which pages are evicted.
        low_watermark: fraction eviction brings the tier down to.
        eviction: eviction policy name (see :mod:`kvtier.policy.eviction`).
        eviction_params: keyword parameters of the policy (``k`` for ``lru-k``).
        options: keyword options of the backend (``path`` for stores).
    """

    name: str
    backend: str
    capacity_bytes: int
    high_watermark: float
    low_watermark: float
    eviction: str = "adaptive"
    eviction_params: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def capacity_pages(self, page_bytes: int) -> int:
        """Whole pages that fit in ``capacity_bytes``."""
        return self.capacity_bytes // page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "capacity": self.capacity_bytes,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "eviction": self.eviction,
            "eviction_params": dict(self.eviction_params),
            "options": dict(self.options),
        }


@dataclass
class KVTierConfig:
    """A whole kvtier configuration (what :class:`~kvtier.cache.KVCache` opens from).

    Attributes:
        spec: the model's KV geometry.
        namespace: keeps this cache's pages apart from other models/revisions/ranks.
        tiers: tiers, top first (at least one).
        write_policy: ``write-through`` (every stored page is copied down at once, in the
            background), ``write-back`` (pages go down only when evicted, and on close),
            ``selective`` (write-through for pages the admission policy admits; the others
            are dropped when evicted).
        admission: admission policy name for ``selective`` (see :func:`register_admission`).
        admission_params: its keyword parameters.
        batch_pages: maximum pages per transfer batch (one executor hop per batch).
        max_inflight_per_link: batches in flight at once per (source, destination) link.
        leaf_first: evict leaves of the prefix tree before their ancestors (a page is
            useless without its prefix); the tier's eviction policy orders the leaves.
        log_format: ``console`` or ``json`` (structlog, on stderr).
        log_level: minimum log level.
    """

    spec: KVSpec
    namespace: Namespace
    tiers: list[TierConfig]
    write_policy: WritePolicy = "write-through"
    admission: str = "all"
    admission_params: dict[str, Any] = field(default_factory=dict)
    batch_pages: int = 32
    max_inflight_per_link: int = 4
    leaf_first: bool = True
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"

    def validate(self) -> KVTierConfig:
        """Check every field; raises :class:`ConfigError` naming the first bad key."""
        _validate(_to_raw(self), {})
        return self

    def to_dict(self) -> dict[str, Any]:
        """The raw (file-shaped) form: what a TOML file with these values would hold."""
        return _to_raw(self)


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated configuration and the source of each of its values.

    ``sources`` maps dotted keys (``model.preset``, ``tiers[0].capacity``,
    ``pipeline.batch_pages``) to ``default``, ``file:PATH``, ``python`` or ``env:NAME``.
    """

    config: KVTierConfig
    sources: dict[str, str]

    def as_rows(self) -> list[tuple[str, Any, str]]:
        """(key, value, source) rows of every leaf value, in file order.

        Model fields that came from a preset carry the preset's source, and the preset
        itself is listed first.
        """
        rows: list[tuple[str, Any, str]] = []
        preset_src = self.sources.get("model.preset")
        if preset_src is not None:
            rows.append(("model.preset", self.config.spec.name, preset_src))
        for key, value in _flatten(self.config.to_dict()):
            fallback = preset_src if key.startswith("model.") and preset_src else "default"
            rows.append((key, value, self.sources.get(key, fallback)))
        return rows


# -- admission policies for the selective write policy ---------------------------------

_ADMISSION: dict[str, Any] = {}


def register_admission(name: str, factory: Any) -> None:
    """Make an :class:`~kvtier.policy.base.AdmissionPolicy` selectable by ``name``."""
    _ADMISSION[name] = factory


def make_admission(name: str, **params: Any) -> Any:
    """Build the admission policy ``name``; :class:`ConfigError` when unknown or misused."""
    from kvtier.policy.base import AdmitAll

    _ADMISSION.setdefault(AdmitAll.name, AdmitAll)
    try:
        factory = _ADMISSION[name]
    except KeyError:
        known = ", ".join(sorted(_ADMISSION))
        raise ConfigError(
            f"pipeline.admission: unknown admission policy {name!r}; known: {known}"
        ) from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(
            f"pipeline.admission_params: bad parameters for {name!r}: {exc}"
        ) from None


def admission_names() -> list[str]:
    from kvtier.policy.base import AdmitAll

    _ADMISSION.setdefault(AdmitAll.name, AdmitAll)
    return sorted(_ADMISSION)


# -- the raw (file-shaped) layer -------------------------------------------------------

_SECTIONS: dict[str, tuple[str, ...]] = {
    "model": (
        "preset", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_tokens", "mla", "name",
    ),
    "namespace": ("model_id", "revision", "rank"),
    "pipeline": (
        "write_policy", "admission", "admission_params", "batch_pages", "max_inflight_per_link",
        "leaf_first",
    ),
    "log": ("format", "level"),
}  # fmt: skip
_TIER_KEYS: tuple[str, ...] = (
    "name",
    "backend",
    "capacity",
    "high_watermark",
    "low_watermark",
    "eviction",
    "eviction_params",
    "options",
)
#: Keys whose values are free-form tables passed through (their inner keys are not checked here).
_OPEN_TABLES = ("admission_params", "eviction_params", "options")


def default_raw() -> dict[str, Any]:
    """The embedded default: no GPU, a DRAM arena over a file store in the working dir."""
    return {
        "model": {"preset": "llama3-8b"},
        "namespace": {"revision": "main", "rank": 0},
        "pipeline": {
            "write_policy": "write-through",
            "admission": "all",
            "admission_params": {},
            "batch_pages": 32,
            "max_inflight_per_link": 4,
            "leaf_first": True,
        },
        "log": {"format": "console", "level": "info"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "512MiB"},
            {
                "name": "file",
                "backend": "file",
                "capacity": "4GiB",
                "options": {"path": DEFAULT_STORE_DIR},
            },
        ],
    }


def _flatten(raw: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else k
        if k == "tiers" and not prefix and isinstance(v, list):
            for i, tier in enumerate(v):
                out.extend(_flatten(tier, f"tiers[{i}]") if isinstance(tier, Mapping) else [])
        elif isinstance(v, Mapping) and v:
            out.extend(_flatten(v, key))
        else:
            out.append((key, v))
    return out


def _record(sources: dict[str, str], raw: Mapping[str, Any], origin: str, prefix: str = "") -> None:
    for key, _ in _flatten(raw, prefix):
        sources[key] = origin


def _check_shape(raw: Any, origin: str) -> None:
    """Reject unknown sections and keys, naming them and where they came from."""
    where = f" (from {origin})"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"configuration must be a table/dict, got {type(raw).__name__}{where}")
    for section, body in raw.items():
        if section == "tiers":
            if not isinstance(body, list):
                raise ConfigError(f"tiers: must be a list of tables{where}")
            for i, tier in enumerate(body):
                if not isinstance(tier, Mapping):
                    raise ConfigError(f"tiers[{i}]: must be a table{where}")
                for k in tier:
                    if k not in _TIER_KEYS:
                        raise ConfigError(
                            f"tiers[{i}].{k}: unknown key{where}; known: {', '.join(_TIER_KEYS)}"
                        )
            continue
        if section not in _SECTIONS:
            known = ", ".join([*_SECTIONS, "tiers"])
            raise ConfigError(f"{section}: unknown section{where}; known: {known}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{section}: must be a table{where}")
        for k in body:
            if k not in _SECTIONS[section]:
                raise ConfigError(
                    f"{section}.{k}: unknown key{where}; known: {', '.join(_SECTIONS[section])}"
                )


def _merge(
    base: dict[str, Any], over: Mapping[str, Any], sources: dict[str, str], origin: str
) -> None:
    """Merge ``over`` into ``base`` (a given tier list replaces the default one)."""
    for section, body in over.items():
        if section == "tiers":
            for key in [k for k in sources if k.startswith("tiers[")]:
                del sources[key]
            base["tiers"] = copy.deepcopy(list(body))
            for i, tier in enumerate(body):
                _record(sources, tier, origin, f"tiers[{i}]")
            continue
        target = base.setdefault(section, {})
        if section == "model" and body:
            # A model given anew replaces the default preset unless it names one itself.
            explicit = "preset" not in body and any(k != "name" for k in body)
            if explicit and sources.get("model.preset", "default") == "default":
                target.pop("preset", None)
                sources.pop("model.preset", None)
        for k, v in body.items():
            target[k] = copy.deepcopy(v)
            if isinstance(v, Mapping) and v:
                _record(sources, v, origin, f"{section}.{k}")
            else:
                sources[f"{section}.{k}"] = origin


def _parse_env_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _env_layer(
    env: Mapping[str, str], tiers: list[dict[str, Any]]
) -> list[tuple[str, list[str], Any]]:
    """(variable, path, value) for each ``KVTIER_A__B`` variable, in sorted order."""
    out: list[tuple[str, list[str], Any]] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if any(not p for p in parts):
            raise ConfigError(f"{name}: malformed variable name (empty level)")
        out.append((name, parts, _parse_env_value(env[name])))
    return out


def _apply_env(raw: dict[str, Any], env: Mapping[str, str], sources: dict[str, str]) -> None:
    for name, parts, value in _env_layer(env, raw.get("tiers", [])):
        origin = f"env:{name}"
        section = parts[0]
        if section == "tiers":
            if len(parts) < 3:
                raise ConfigError(f"{name}: use KVTIER_TIERS__<name or index>__<key>")
            ref, key, rest = parts[1], parts[2], parts[3:]
            tiers = raw.setdefault("tiers", [])
            idx = _tier_index(tiers, ref, name)
            if key not in _TIER_KEYS:
                raise ConfigError(
                    f"{name}: tiers[{idx}].{key} is not a tier key; known: {', '.join(_TIER_KEYS)}"
                )
            if rest and key not in _OPEN_TABLES:
                raise ConfigError(f"{name}: tiers[{idx}].{key} is not a table")
            target = tiers[idx]
            path = [key, *rest]
            dotted = f"tiers[{idx}]." + ".".join(path)
        else:
            if section not in _SECTIONS:
                known = ", ".join([*_SECTIONS, "tiers"])
                raise ConfigError(f"{name}: unknown section {section!r}; known: {known}")
            if len(parts) < 2:
                raise ConfigError(f"{name}: use KVTIER_{section.upper()}__<key>")
            key, rest = parts[1], parts[2:]
            if key not in _SECTIONS[section]:
                raise ConfigError(
                    f"{name}: {section}.{key} is not a key; known: {', '.join(_SECTIONS[section])}"
                )
            if rest and key not in _OPEN_TABLES:
                raise ConfigError(f"{name}: {section}.{key} is not a table")
            target = raw.setdefault(section, {})
            path = [key, *rest]
            dotted = f"{section}." + ".".join(path)
        for p in path[:-1]:
            target = target.setdefault(p, {})
        target[path[-1]] = value
        sources[dotted] = origin


def _tier_index(tiers: list[dict[str, Any]], ref: str, var: str) -> int:
    if ref.isdigit():
        idx = int(ref)
        if idx >= len(tiers):
            raise ConfigError(f"{var}: no tier at index {idx} (there are {len(tiers)})")
        return idx
    for i, tier in enumerate(tiers):
        if str(tier.get("name", "")).lower() == ref:
            return i
    names = ", ".join(str(t.get("name")) for t in tiers) or "none"
    raise ConfigError(f"{var}: no tier named {ref!r}; tiers: {names}")


# -- from raw to typed -----------------------------------------------------------------


def _src(sources: Mapping[str, str], key: str) -> str:
    origin = sources.get(key)
    return f" (from {origin})" if origin and origin != "default" else ""


def _int(value: Any, key: str, sources: Mapping[str, str], minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{key}: must be an integer >= {minimum}, got {value!r}{_src(sources, key)}"
        )
    return value


def _fraction(value: Any, key: str, sources: Mapping[str, str]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{key}: must be a fraction in (0, 1], got {value!r}{_src(sources, key)}")
    return float(value)


def _str(value: Any, key: str, sources: Mapping[str, str]) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty string, got {value!r}{_src(sources, key)}")
    return value


def _table(value: Any, key: str, sources: Mapping[str, str]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: must be a table, got {value!r}{_src(sources, key)}")
    return dict(value)


def _build_spec(model: Mapping[str, Any], sources: Mapping[str, str]) -> KVSpec:
    fields = {k: v for k, v in model.items() if k != "preset"}
    try:
        if "preset" in model:
            base = preset(_str(model["preset"], "model.preset", sources))
            return dataclasses.replace(base, **fields) if fields else base
        missing = [f for f in ("num_layers", "num_kv_heads", "head_dim") if f not in fields]
        if missing:
            raise ConfigError(
                f"model: give a preset or every geometry field; missing {', '.join(missing)}"
            )
        return KVSpec(**fields)
    except ConfigError:
        raise
    except KVTierUsageError as exc:
        key = "model.preset" if "preset" in str(exc) else "model"
        for f in fields:
            if f in str(exc):
                key = f"model.{f}"
        raise ConfigError(f"{key}: {exc}{_src(sources, key)}") from None


def _validate(raw: Mapping[str, Any], sources: Mapping[str, str]) -> KVTierConfig:
    spec = _build_spec(raw.get("model", {}), sources)
    ns_raw = raw.get("namespace", {})
    model_id = ns_raw.get("model_id")
    if model_id is not None and model_id != "":  # absent or empty: the model's name
        model_id = _str(model_id, "namespace.model_id", sources)
    try:
        namespace = Namespace.for_spec(
            spec,
            model_id=model_id or None,
            revision=_str(ns_raw.get("revision", "main"), "namespace.revision", sources),
            rank=_int(ns_raw.get("rank", 0), "namespace.rank", sources, minimum=0),
        )
    except KVTierUsageError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"namespace: {exc}") from None

    pipe = raw.get("pipeline", {})
    wp = pipe.get("write_policy", "write-through")
    if wp not in WRITE_POLICIES:
        raise ConfigError(
            f"pipeline.write_policy: must be one of {', '.join(WRITE_POLICIES)}, got {wp!r}"
            f"{_src(sources, 'pipeline.write_policy')}"
        )
    admission = _str(pipe.get("admission", "all"), "pipeline.admission", sources)
    admission_params = _table(
        pipe.get("admission_params", {}), "pipeline.admission_params", sources
    )
    make_admission(admission, **admission_params)  # fails early on a bad name/params
    batch = _int(pipe.get("batch_pages", 32), "pipeline.batch_pages", sources)
    inflight = _int(pipe.get("max_inflight_per_link", 4), "pipeline.max_inflight_per_link", sources)
    leaf_first = pipe.get("leaf_first", True)
    if not isinstance(leaf_first, bool):
        raise ConfigError(
            f"pipeline.leaf_first: must be true or false, got {leaf_first!r}"
            f"{_src(sources, 'pipeline.leaf_first')}"
        )

    log = raw.get("log", {})
    log_format = log.get("format", "console")
    if log_format not in ("console", "json"):
        raise ConfigError(
            f"log.format: must be 'console' or 'json', got {log_format!r}"
            f"{_src(sources, 'log.format')}"
        )
    from kvtier.log import parse_level

    log_level = str(log.get("level", "info"))
    parse_level(log_level)

    tiers_raw = raw.get("tiers", [])
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: at least one tier is required")
    tiers: list[TierConfig] = []
    seen: set[str] = set()
    for i, t in enumerate(tiers_raw):
        tiers.append(_build_tier(i, t, spec, sources, seen))
    return KVTierConfig(
        spec=spec,
        namespace=namespace,
        tiers=tiers,
        write_policy=wp,
        admission=admission,
        admission_params=admission_params,
        batch_pages=batch,
        max_inflight_per_link=inflight,
        leaf_first=leaf_first,
        log_format=log_format,
        log_level=log_level,
    )


def _build_tier(
    i: int, t: Mapping[str, Any], spec: KVSpec, sources: Mapping[str, str], seen: set[str]
) -> TierConfig:
    from kvtier.policy.eviction import make_policy

    p = f"tiers[{i}]"
    for required in ("backend", "capacity"):
        if required not in t:
            raise ConfigError(
                f"{p}.{required}: missing (every tier needs a backend and a capacity)"
            )
    name = _str(t.get("name", t["backend"]), f"{p}.name", sources)
    if name in seen:
        raise ConfigError(f"{p}.name: duplicate tier name {name!r}{_src(sources, p + '.name')}")
    seen.add(name)
    backend = _str(t["backend"], f"{p}.backend", sources)
    capacity = parse_size(t["capacity"], f"{p}.capacity")
    if capacity < spec.page_bytes:
        raise ConfigError(
            f"{p}.capacity: {capacity} bytes ({format_size(capacity)}) is smaller than one page "
            f"of {spec.name} ({spec.page_bytes} bytes, {format_size(spec.page_bytes)})"
            f"{_src(sources, p + '.capacity')}"
        )
    d_high, d_low = default_watermarks(i)
    high = _fraction(t.get("high_watermark", d_high), f"{p}.high_watermark", sources)
    low_default = d_low if "high_watermark" not in t else round(high - DEFAULT_HYSTERESIS, 6)
    low_value = t.get("low_watermark", low_default)
    if low_value == low_default and low_default <= 0:
        low_value = high / 2
    low = _fraction(low_value, f"{p}.low_watermark", sources)
    if low > high:
        raise ConfigError(
            f"{p}.low_watermark: {low} is above high_watermark {high}"
            f"{_src(sources, p + '.low_watermark')}"
        )
    eviction = _str(t.get("eviction", "adaptive"), f"{p}.eviction", sources)
    params = _table(t.get("eviction_params", {}), f"{p}.eviction_params", sources)
    try:
        make_policy(eviction, **params)
    except ConfigError as exc:
        raise ConfigError(f"{p}.eviction: {exc}{_src(sources, p + '.eviction')}") from None
    options = _table(t.get("options", {}), f"{p}.options", sources)
    return TierConfig(name, backend, capacity, high, low, eviction, params, options)


def _to_raw(cfg: KVTierConfig) -> dict[str, Any]:
    spec = cfg.spec
    return {
        "model": {
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtype,
            "page_tokens": spec.page_tokens,
            "mla": spec.mla,
            "name": spec.name,
        },
        "namespace": {
            "model_id": cfg.namespace.model_id,
            "revision": cfg.namespace.revision,
            "rank": cfg.namespace.rank,
        },
        "pipeline": {
            "write_policy": cfg.write_policy,
            "admission": cfg.admission,
            "admission_params": dict(cfg.admission_params),
            "batch_pages": cfg.batch_pages,
            "max_inflight_per_link": cfg.max_inflight_per_link,
            "leaf_first": cfg.leaf_first,
        },
        "log": {"format": cfg.log_format, "level": cfg.log_level},
        "tiers": [t.to_dict() for t in cfg.tiers],
    }


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None


def load_config(
    source: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve a configuration from the default, a source and the environment.

    Args:
        source: a TOML file path, a file-shaped dict, a :class:`KVTierConfig`, an already
            resolved config (returned as-is), or ``None`` (then ``$KVTIER_CONFIG`` if set,
            else the embedded default).
        env: environment to read ``KVTIER_*`` overrides from (default ``os.environ``; pass
            ``{}`` to ignore the environment).

    Raises:
        ConfigError: unknown key, bad value, capacity below one page, unreadable file.
    """
    if isinstance(source, ResolvedConfig):
        return source
    env = os.environ if env is None else env
    raw = default_raw()
    sources: dict[str, str] = {}
    _record(sources, raw, "default")
    layer: Mapping[str, Any] | None = None
    origin = "python"
    if source is None and env.get(ENV_CONFIG_FILE):
        source = Path(env[ENV_CONFIG_FILE])
        origin = f"env:{ENV_CONFIG_FILE}"
    if isinstance(source, str | Path):
        path = Path(source)
        layer = _read_file(path)
        origin = f"file:{path}" if origin == "python" else f"{origin}={path}"
    elif isinstance(source, KVTierConfig):
        layer = _to_raw(source)
    elif isinstance(source, Mapping):
        layer = source
    elif source is not None:
        raise ConfigError(
            f"config source must be a path, dict or KVTierConfig, got {type(source).__name__}"
        )
    if layer is not None:
        _check_shape(layer, origin)
        _merge(raw, layer, sources, origin)
    _apply_env(raw, env, sources)
    _check_shape(raw, "the environment")
    return ResolvedConfig(_validate(raw, sources), sources)


def default_config() -> KVTierConfig:
    """The embedded default configuration (no file, no environment)."""
    return load_config(None, env={}).config
