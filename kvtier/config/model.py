"""The typed configuration: :class:`TierConfig`, :class:`KVTierConfig`,
:class:`ResolvedConfig`, and the step from a raw (file-shaped) dict to them that checks
every value (:func:`validate_raw`) and back (:func:`to_raw`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.codec import NO_CODEC, make_codec, tier_capacity_pages
from kvtier.config.defaults import (
    DEFAULT_EVICTION,
    DEFAULT_HYSTERESIS,
    MAX_BATCH_PAGES,
    MAX_INFLIGHT_PER_LINK,
    MAX_PAGE_TOKENS,
    MAX_RANK,
    ON_OPEN_ERROR,
    default_watermarks,
)
from kvtier.config.raw import check_store_paths, check_tier_name, flatten
from kvtier.config.raw import codec_source_note as _codec_src  # a codec's and its parameters'
from kvtier.config.raw import source_note as _src  # " (from ORIGIN)" of a key or a table
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import Namespace
from kvtier.log import parse_level
from kvtier.policy.admission import make_admission
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy
from kvtier.policy.prefetch import LIVE_PREDICTORS
from kvtier.policy.write import WRITE_POLICIES, WritePolicy
from kvtier.spec import KVSpec, preset
from kvtier.units import format_size, parse_size


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
        on_open_error: ``fail`` (raise from ``KVCache.start``) or ``skip`` (log an error and
            run without this tier) when the backend cannot open (a damaged or locked store,
            an unreachable directory). Default ``skip`` below the top tier, ``fail`` for
            the top tier (which cannot be skipped).
        codec: page codec of a store tier (:mod:`kvtier.codec`; ``none``: no codec).
        codec_params: keyword parameters of the codec.
    """

    name: str
    backend: str
    capacity_bytes: int
    high_watermark: float
    low_watermark: float
    eviction: str = DEFAULT_EVICTION
    eviction_params: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    on_open_error: str = "fail"
    codec: str = "none"
    codec_params: dict[str, Any] = field(default_factory=dict)

    def capacity_pages(self, page_bytes: int) -> int:
        """Pages of ``page_bytes`` the tier holds (``Backend.capacity_pages_for``); raises
        the registry's errors for a backend that is unknown or unavailable here."""
        from kvtier import registry

        return registry.resolve(self.backend).capacity_pages_for(self.capacity_bytes, page_bytes)

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
            "on_open_error": self.on_open_error,
            "codec": self.codec,
            "codec_params": dict(self.codec_params),
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
        background_eviction: the evict queue writes victims down in the background: a
            batch that still fits in a tier's capacity does not wait for the write-down of
            its victims (the tier goes above its high watermark meanwhile). Off: every batch
            waits until its victims are gone.
        log_format: ``console`` or ``json`` (structlog, on stderr).
        log_level: minimum log level.
        whatif: run what-if sizing in the live cache (``observe.whatif``; see
            :class:`~kvtier.cache.KVCache`).
        predictor: the live prefetch predictor to run (``observe.predictor``; ``None``,
            written ``"none"``, runs none).
    """

    spec: KVSpec
    namespace: Namespace
    tiers: list[TierConfig]
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    admission: str = "all"
    admission_params: dict[str, Any] = field(default_factory=dict)
    batch_pages: int = 32
    max_inflight_per_link: int = 4
    leaf_first: bool = True
    background_eviction: bool = True
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"
    whatif: bool = False
    predictor: str | None = None

    def validate(self) -> KVTierConfig:
        """Check every field; raises :class:`ConfigError` naming the first bad key."""
        validate_raw(to_raw(self), {})
        return self

    def to_dict(self) -> dict[str, Any]:
        """The raw (file-shaped) form: what a TOML file with these values would hold."""
        return to_raw(self)


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated configuration and the source of each of its values.

    ``sources`` maps dotted keys (``model.preset``, ``tiers[0].capacity``,
    ``pipeline.batch_pages``) to ``default``, ``file:PATH``, ``python`` or ``env:NAME``;
    ``preset`` is the model preset the model's fields started from (``None``: none).
    """

    config: KVTierConfig
    sources: dict[str, str]
    preset: str | None = None

    def as_rows(self) -> list[tuple[str, Any, str]]:
        """(key, value, source) rows of every leaf value, in file order.

        Model fields that came from a preset carry the preset's source, and the preset
        itself is listed first.
        """
        rows: list[tuple[str, Any, str]] = []
        preset_src = self.sources.get("model.preset")
        if preset_src is not None:
            rows.append(("model.preset", self.preset or self.config.spec.name, preset_src))
        for key, value in flatten(self.config.to_dict()):
            fallback = preset_src if key.startswith("model.") and preset_src else "default"
            rows.append((key, value, self.sources.get(key, fallback)))
        return rows


def _int(
    value: Any, key: str, sources: Mapping[str, str], minimum: int = 1, maximum: int | None = None
) -> int:
    bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{key}: must be an integer {bounds}, got {value!r}{_src(sources, key)}")
    return int(value)


def _fraction(value: Any, key: str, sources: Mapping[str, str]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{key}: must be a fraction in (0, 1], got {value!r}{_src(sources, key)}")
    return float(value)


def _bool(value: Any, key: str, sources: Mapping[str, str]) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {value!r}{_src(sources, key)}")
    return value


def _str(value: Any, key: str, sources: Mapping[str, str]) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty string, got {value!r}{_src(sources, key)}")
    return value


def _table(value: Any, key: str, sources: Mapping[str, str]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: must be a table, got {value!r}{_src(sources, key)}")
    return dict(value)


_GEOMETRY = ("num_layers", "num_kv_heads", "head_dim", "mla")


def _geometry_name(base: str, spec: KVSpec) -> str:
    """``base`` with the geometry written out: the name of a model whose shape a config
    gave without naming it (dtype and page size are in the namespace already)."""
    mla = "-mla" if spec.mla else ""
    return f"{base}-L{spec.num_layers}H{spec.num_kv_heads}D{spec.head_dim}{mla}"


def _build_spec(model: Mapping[str, Any], sources: Mapping[str, str]) -> KVSpec:
    """The model of a ``[model]`` section: a preset, with the fields given replacing its
    own, or every geometry field. Without a ``name``, a geometry that is not the preset's
    is named after it (``llama3-8b-L2H8D128``, ``custom-L4H2D64``): the name is the
    namespace's default model id, so two shapes never share pages."""
    fields = {k: v for k, v in model.items() if k != "preset"}
    if "page_tokens" in fields:
        _int(fields["page_tokens"], "model.page_tokens", sources, maximum=MAX_PAGE_TOKENS)
    try:
        if "preset" in model:
            base = preset(_str(model["preset"], "model.preset", sources))
            spec = dataclasses.replace(base, **fields) if fields else base
            if "name" in fields or all(getattr(spec, f) == getattr(base, f) for f in _GEOMETRY):
                return spec
            return dataclasses.replace(spec, name=_geometry_name(base.name, spec))
        missing = [f for f in ("num_layers", "num_kv_heads", "head_dim") if f not in fields]
        if missing:
            raise ConfigError(
                f"model: give a preset or every geometry field; missing {', '.join(missing)}"
            )
        spec = KVSpec(**fields)
        if "name" in fields:
            return spec
        return dataclasses.replace(spec, name=_geometry_name(spec.name, spec))
    except ConfigError:
        raise
    except KVTierUsageError as exc:
        key = "model.preset" if "preset" in str(exc) else "model"
        for f in fields:
            if f in str(exc):
                key = f"model.{f}"
        raise ConfigError(f"{key}: {exc}{_src(sources, key)}") from None


def validate_raw(raw: Mapping[str, Any], sources: Mapping[str, str]) -> KVTierConfig:
    """The typed configuration of a merged raw dict; :class:`ConfigError` names the
    first bad key and, from ``sources``, where its value came from."""
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
            rank=_int(ns_raw.get("rank", 0), "namespace.rank", sources, 0, MAX_RANK),
        )
    except KVTierUsageError as exc:
        if isinstance(exc, ConfigError):
            raise
        key = next((f"namespace.{k}" for k in ns_raw if f".{k} " in str(exc)), "namespace")
        raise ConfigError(f"{key}: {exc}{_src(sources, key)}") from None

    pipe = raw.get("pipeline", {})
    wp_raw = pipe.get("write_policy", "write-through")
    if wp_raw not in WRITE_POLICIES:
        raise ConfigError(
            f"pipeline.write_policy: must be one of {', '.join(WRITE_POLICIES)}, got {wp_raw!r}"
            f"{_src(sources, 'pipeline.write_policy')}"
        )
    wp = WritePolicy(wp_raw)
    admission = _str(pipe.get("admission", "all"), "pipeline.admission", sources)
    admission_params = _table(
        pipe.get("admission_params", {}), "pipeline.admission_params", sources
    )
    make_admission(admission, **admission_params)  # fails early on a bad name/params
    batch = _int(
        pipe.get("batch_pages", 32), "pipeline.batch_pages", sources, maximum=MAX_BATCH_PAGES
    )
    inflight = _int(
        pipe.get("max_inflight_per_link", 4),
        "pipeline.max_inflight_per_link",
        sources,
        maximum=MAX_INFLIGHT_PER_LINK,
    )
    leaf_first = _bool(pipe.get("leaf_first", True), "pipeline.leaf_first", sources)
    background = _bool(
        pipe.get("background_eviction", True), "pipeline.background_eviction", sources
    )

    log = raw.get("log", {})
    log_format = log.get("format", "console")
    if log_format not in ("console", "json"):
        raise ConfigError(
            f"log.format: must be 'console' or 'json', got {log_format!r}"
            f"{_src(sources, 'log.format')}"
        )
    log_level = str(log.get("level", "info"))
    try:
        parse_level(log_level)
    except ConfigError as exc:  # it names log.level; add where the value came from
        raise ConfigError(f"{exc}{_src(sources, 'log.level')}") from None

    observe = raw.get("observe", {})
    whatif = _bool(observe.get("whatif", False), "observe.whatif", sources)
    predictor = observe.get("predictor", "none")
    if predictor not in ("none", *LIVE_PREDICTORS):
        raise ConfigError(
            f"observe.predictor: must be one of none, {', '.join(LIVE_PREDICTORS)}, got "
            f"{predictor!r}{_src(sources, 'observe.predictor')}"
        )

    tiers_raw = raw.get("tiers", [])
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: at least one tier is required")
    seen: dict[str, tuple[str, str]] = {}
    n = len(tiers_raw)
    tiers = [_build_tier(i, t, spec, sources, seen, n) for i, t in enumerate(tiers_raw)]
    check_store_paths(tiers, sources)
    namespace = _with_codec_representation(namespace, tiers, spec)
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
        background_eviction=background,
        log_format=log_format,
        log_level=log_level,
        whatif=whatif,
        predictor=None if predictor == "none" else predictor,
    )


def _build_tier(
    i: int,
    t: Mapping[str, Any],
    spec: KVSpec,
    sources: Mapping[str, str],
    seen: dict[str, tuple[str, str]],
    count: int | None = None,
) -> TierConfig:
    p = f"tiers[{i}]"
    for required in ("backend", "capacity"):
        if required not in t:
            raise ConfigError(
                f"{p}.{required}: missing (every tier needs a backend and a capacity)"
            )
    name = _str(t.get("name", t["backend"]), f"{p}.name", sources)
    check_tier_name(p, name, "name" in t, seen, sources)
    backend = _str(t["backend"], f"{p}.backend", sources)
    try:
        capacity = parse_size(t["capacity"], f"{p}.capacity")
    except ConfigError as exc:  # name the source (file, env variable) as other keys do
        raise ConfigError(f"{exc}{_src(sources, p + '.capacity')}") from None
    if capacity < spec.page_bytes:
        raise ConfigError(
            f"{p}.capacity: {capacity} bytes ({format_size(capacity)}) is smaller than one page "
            f"of {spec.name} ({spec.page_bytes} bytes, {format_size(spec.page_bytes)})"
            f"{_src(sources, p + '.capacity')}"
        )
    d_high, d_low = default_watermarks(i, count)
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
    eviction = _str(t.get("eviction", DEFAULT_EVICTION), f"{p}.eviction", sources)
    params = _table(t.get("eviction_params", {}), f"{p}.eviction_params", sources)
    try:
        make_policy(eviction, **params)
    except ConfigError as exc:
        # a known policy refusing its parameters: the parameters are what to fix
        where = f"{p}.eviction_params" if eviction in EVICTION_POLICIES else f"{p}.eviction"
        raise ConfigError(f"{where}: {exc}{_src(sources, where)}") from None
    options = _table(t.get("options", {}), f"{p}.options", sources)
    codec = _str(t.get("codec", "none"), f"{p}.codec", sources)
    codec_params = _table(t.get("codec_params", {}), f"{p}.codec_params", sources)
    _check_codec(p, codec, codec_params, capacity, spec, sources)
    on_error = t.get("on_open_error", "fail" if i == 0 else "skip")
    if on_error not in ON_OPEN_ERROR or (i == 0 and on_error != "fail"):
        allowed = "fail (the top tier cannot be skipped)" if i == 0 else "skip or fail"
        raise ConfigError(
            f"{p}.on_open_error: must be {allowed}, got {on_error!r}"
            f"{_src(sources, p + '.on_open_error')}"
        )
    return TierConfig(
        name, backend, capacity, high, low, eviction, params, options, on_error, codec, codec_params
    )


# -- codecs (kvtier.codec): checked here, applied where tiers are built -----------------


def _check_codec(
    p: str,
    codec: str,
    params: dict[str, Any],
    capacity: int,
    spec: KVSpec,
    sources: Mapping[str, str],
) -> None:
    """Fail early, naming the key, on an unknown codec, bad parameters or a capacity that
    holds no encoded page."""
    if codec == NO_CODEC and not params:
        return
    if codec == NO_CODEC:
        key = f"{p}.codec_params"
        raise ConfigError(
            f"{key}: parameters given without a codec (set {p}.codec, e.g. 'zstd', or "
            f"remove them){_src(sources, key)}"
        )
    try:
        made = make_codec(codec, spec, **params)
    except ConfigError as exc:
        raise ConfigError(f"{p}.codec: {exc}{_codec_src(sources, p)}") from None
    if tier_capacity_pages(capacity, made) < 1:
        raise ConfigError(
            f"{p}.capacity: {capacity} bytes hold no page encoded with {codec!r}"
            f"{_src(sources, p + '.capacity')}"
        )


def _with_codec_representation(
    namespace: Namespace, tiers: list[TierConfig], spec: KVSpec
) -> Namespace:
    """The namespace, its KV dtype marked with the lossy codecs any tier uses
    (``float16~fp8-e4m3:head``), so that pages which may have passed through a lossy
    codec never share keys with exact KV (see :mod:`kvtier.codec.base`)."""
    lossy = sorted(
        {
            made.representation
            for t in tiers
            if t.codec != "none" and (made := make_codec(t.codec, spec, **t.codec_params)).lossy
        }
    )
    if not lossy:
        return namespace
    return dataclasses.replace(namespace, kv_dtype=f"{namespace.kv_dtype}~{'+'.join(lossy)}")


def to_raw(cfg: KVTierConfig) -> dict[str, Any]:
    """The raw (file-shaped) form of ``cfg``."""
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
            "write_policy": (
                cfg.write_policy.value
                if isinstance(cfg.write_policy, WritePolicy)
                else cfg.write_policy
            ),
            "admission": cfg.admission,
            "admission_params": dict(cfg.admission_params),
            "batch_pages": cfg.batch_pages,
            "max_inflight_per_link": cfg.max_inflight_per_link,
            "leaf_first": cfg.leaf_first,
            "background_eviction": cfg.background_eviction,
        },
        "log": {"format": cfg.log_format, "level": cfg.log_level},
        "observe": {"whatif": cfg.whatif, "predictor": cfg.predictor or "none"},
        "tiers": [t.to_dict() for t in cfg.tiers],
    }
