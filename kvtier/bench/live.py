"""``kvtier bench run``: the chat workload on real tiers through :class:`~kvtier.cache.KVCache`.

:func:`run_config` turns a resolved configuration plus the command's overrides into the
configuration the run opens (model preset, top-tier capacity, the disk tier's backend and
directory); :func:`run_live` opens the cache, plays the workload and gathers the report:
the workload's own counts (hits per tier, checked pages, mismatches, fetch latency) and
the cache's metrics (pages, bytes and GB/s per link).
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier import registry
from kvtier.backend import ArenaBackend
from kvtier.bench.workload import ChatParams, ChatWorkload, footprint
from kvtier.config import (
    ENV_PREFIX,
    KVTierConfig,
    ResolvedConfig,
    format_size,
    load_config,
)
from kvtier.config.load import file_layer
from kvtier.config.raw import check_shape, record
from kvtier.errors import ConfigError, KVTierError, KVTierUsageError

#: Backends that keep pages in a local directory (option ``path``).
DISK_BACKENDS = ("nvme", "file")
#: A run whose configuration leaves the top tier's capacity at the embedded default sizes
#: it to this share of the workload's working set (so pages spill and come back), or to
#: what one wave of concurrent turns holds plus a transfer batch, whichever is larger.
DEFAULT_TOP_SHARE = 1 / 3


def default_top_pages(params: ChatParams, page_tokens: int, batch_pages: int) -> int:
    """Top-tier pages for a run that spills: see :data:`DEFAULT_TOP_SHARE`."""
    fp = footprint(params, page_tokens)
    share = math.ceil(fp.working_set_pages * DEFAULT_TOP_SHARE)
    return max(share, fp.max_wave_pages + batch_pages)


def disk_backend() -> str:
    """``nvme`` when it is registered and available here, else ``file``."""
    return "nvme" if registry.describe("nvme").available else "file"


def _section_of(name: str) -> str | None:
    """The config section a ``KVTIER_A__B`` variable sets (``"model"``), else ``None``."""
    if not name.startswith(ENV_PREFIX) or "__" not in name:
        return None
    return name[len(ENV_PREFIX) :].split("__")[0].lower()


def _replaced_model_name(model: Any, env: Mapping[str, str]) -> str | None:
    """The name of the model ``--model`` replaces (the file's ``[model]`` table and the
    ``KVTIER_MODEL__*`` variables), or ``None`` when that model does not resolve."""
    try:
        return load_config({"model": model}, env=env).config.spec.name
    except KVTierError:
        return None


def load_base(
    source: Path | None, model: str | None = None, env: Mapping[str, str] | None = None
) -> ResolvedConfig:
    """The configuration ``bench run`` starts from, resolved as
    :func:`~kvtier.config.load_config` resolves ``source`` (a TOML file; ``None``:
    ``$KVTIER_CONFIG`` if set, else the embedded default) and the ``KVTIER_*`` variables
    of ``env`` (default ``os.environ``), but with the preset ``model``, when given, in
    place of the model *before* anything is validated: capacities are checked against a
    page of the model the run uses, not of the one it replaces.

    As in :func:`run_config`, ``model`` replaces the whole model (the file's ``[model]``
    keys and ``KVTIER_MODEL__*`` are dropped) and a namespace model id equal to the
    replaced model's name. Raises :class:`~kvtier.errors.ConfigError` as ``load_config``.
    """
    env = os.environ if env is None else env
    if model is None:
        return load_config(source, env=env)
    found, origin = file_layer(source, env)
    layer: dict[str, Any] = found or {}
    check_shape(layer, origin)
    model_env = {k: v for k, v in env.items() if _section_of(k) == "model"}
    old_name = _replaced_model_name(layer.get("model", {}), model_env)
    keep = {k: v for k, v in env.items() if k not in model_env}
    if old_name is not None:
        keep = {
            k: v
            for k, v in keep.items()
            if not (k.upper() == "KVTIER_NAMESPACE__MODEL_ID" and v == old_name)
        }
        if layer.get("namespace", {}).get("model_id") == old_name:
            del layer["namespace"]["model_id"]
    layer["model"] = {"preset": model}
    origins: dict[str, str] = {}
    record(origins, layer, origin)
    origins["model.preset"] = "--model"
    return load_config(layer, env=keep, origins=origins)


def run_config(
    base: ResolvedConfig,
    *,
    model: str | None = None,
    top_capacity: int | None = None,
    disk_dir: Path | None = None,
    disk_required: bool = True,
) -> KVTierConfig:
    """The configuration ``bench run`` opens.

    Args:
        base: the resolved configuration (file, environment, default).
        model: a :data:`~kvtier.spec.PRESETS` name replacing the model (and the namespace's
            model id when it was the old model's name).
        top_capacity: bytes of the top tier.
        disk_dir: directory of the disk tier (the first ``file`` or ``nvme`` tier below
            the top): its ``path`` becomes this directory, and its backend
            :func:`disk_backend` unless the configuration chose the backend itself
            (options of another backend are dropped).
        disk_required: whether a configuration without a disk tier is an error (else
            ``disk_dir`` is ignored for it).

    Raises :class:`~kvtier.errors.ConfigError` naming what is wrong (unknown preset,
    capacity below one page, no disk tier to put ``disk_dir`` on).
    """
    raw = copy.deepcopy(base.config.to_dict())
    origins = dict(base.sources)
    if model is not None:
        if raw["namespace"].get("model_id") == raw["model"].get("name"):
            raw["namespace"].pop("model_id", None)
        raw["model"] = {"preset": model}
        origins.update((k, "--model") for k in list(origins) if k.startswith("model."))
    if top_capacity is not None:
        raw["tiers"][0]["capacity"] = top_capacity
        origins["tiers[0].capacity"] = "--dram-capacity"
    if disk_dir is not None:
        idx = next(
            (i for i, t in enumerate(raw["tiers"]) if t["backend"] in DISK_BACKENDS and i > 0),
            None,
        )
        if idx is None and disk_required:
            backends = ", ".join(t["backend"] for t in raw["tiers"])
            raise ConfigError(
                f"--nvme-dir: the configuration has no disk tier below the top "
                f"(backends: {backends}); add a tier with backend 'file' or 'nvme'"
            )
        if idx is not None:
            tier = raw["tiers"][idx]
            chosen = base.sources.get(f"tiers[{idx}].backend", "default") != "default"
            backend = tier["backend"] if chosen else disk_backend()
            if tier["backend"] != backend:
                tier["options"] = {}
                if tier.get("name") == tier["backend"]:
                    tier["name"] = backend
            tier["backend"] = backend
            tier["options"]["path"] = str(disk_dir)
    for tier in raw["tiers"]:  # a benchmark measures the tiers it was given, all of them
        tier["on_open_error"] = "fail"
    return load_config(raw, env={}, origins=origins).config


def check_top_capacity(config: KVTierConfig, params: ChatParams) -> None:
    """Refuse, before anything runs, a top tier smaller than what one wave of concurrent
    turns pins at once (:attr:`~kvtier.bench.workload.Footprint.min_top_pages`), saying
    the minimum. Raises :class:`KVTierUsageError`."""
    spec = config.spec
    top = config.tiers[0]
    have = top.capacity_pages(spec.page_bytes)
    need = footprint(params, spec.page_tokens).min_top_pages
    if have < need:
        raise KVTierUsageError(
            f"top tier {top.name!r}: {format_size(top.capacity_bytes)} holds {have} pages of "
            f"{format_size(spec.page_bytes)} ({spec.name}), but this workload loads up to "
            f"{need} pages at once ({params.concurrency} concurrent turns): give it at least "
            f"{format_size(need * spec.page_bytes)} (--dram-capacity), or lower --sessions, "
            "--turns, --turn-tokens or --concurrency"
        )


def unwritten_pages(cache: Any, planner: Any) -> dict[str, int]:
    """Per tier below a memory tier of a closed cache: pages the memory tier still holds
    that its close-time flush should have written down there and could not (the count of
    the log line "flush could not write every dirty page down"). ``planner`` is the
    cache's, taken while it was open (``cache.pipeline.planner``). Tiers with none are
    left out."""
    out: dict[str, int] = {}
    tiers = cache.tiers
    for tier in tiers[:-1]:
        if tier.is_arena:
            n = len(planner.dirty(tier.index, cache.directory.keys_in(tier.name)))
            if n:
                below = tiers[tier.index + 1].name
                out[below] = out.get(below, 0) + n
    return out


def tier_health(cache: Any, planner: Any = None) -> dict[str, dict[str, Any]]:
    """Per tier of an opened (or closed) cache: whether it ended healthy, the backend's
    own outage record when it keeps one (``down``, ``down_reason``, ``failed_batches``)
    and, given the cache's ``planner`` after the cache closed, ``unwritten_pages``
    (:func:`unwritten_pages`)."""
    unwritten = unwritten_pages(cache, planner) if planner is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for tier in cache.tiers:
        try:
            stats = tier.backend.stats()
        except Exception:  # stats are best effort
            stats = {}
        out[tier.name] = {
            "healthy": tier.healthy,
            "down": bool(stats.get("down")),
            "down_reason": stats.get("down_reason"),
            "failed_batches": int(stats.get("failed_batches", 0) or 0),
            "unwritten_pages": unwritten.get(tier.name, 0),
        }
    return out


def failed_tiers(
    metrics: dict[str, Any], tiers: list[str], health: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The tiers below the top that were unreachable for the whole run: each failed
    (pages, batches, or it ended unhealthy) and never stored a page.

    One entry per such tier: ``tier``; ``error``, a message naming it, what failed and,
    when known, why; ``reason`` (the backend's, or ``None``); and the counts the message
    gives: ``unwritten_pages`` (pages the tier above could not write down to it when the
    cache closed), ``failed_pages`` (page operations the cache saw fail there) and
    ``failed_batches`` (the backend's own count, for stores that keep one).
    """
    out: list[dict[str, Any]] = []
    for name in tiers[1:]:
        t = metrics.get("tiers", {}).get(name, {})
        h = (health or {}).get(name, {})
        failed = int(t.get("failed_pages", 0) or 0)
        batches = int(h.get("failed_batches", 0) or 0)
        unwritten = int(h.get("unwritten_pages", 0) or 0)
        broken = failed or batches or not h.get("healthy", True) or h.get("down")
        if not broken or t.get("stored_pages"):
            continue
        counts = [
            f"{n} {what}"
            for n, what in (
                (unwritten, "pages could not be written down to it"),
                (failed, "page operations failed"),
                (batches, "batches failed"),
            )
            if n
        ]
        detail = f" ({', '.join(counts)})" if counts else ""
        reason = h.get("down_reason") or None
        why = f": {reason}" if reason else " (see the log)"
        out.append(
            {
                "tier": name,
                "error": f"tier {name!r} was unreachable for the whole run: no page was "
                f"stored there{detail}{why}",
                "reason": reason,
                "unwritten_pages": unwritten,
                "failed_pages": failed,
                "failed_batches": batches,
            }
        )
    return out


@dataclass(frozen=True)
class RunResult:
    """A finished run: the workload report, the cache's metrics and the layout used."""

    workload: dict[str, Any]
    metrics: dict[str, Any]
    config: dict[str, Any]
    disk_dir: str | None
    disk_kept: bool
    #: :func:`failed_tiers` of the run (``bench run`` exits 1 after its report when any)
    failed_tiers: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        links = {
            name: {k: v for k, v in link.items() if k != "batches"}
            for name, link in self.metrics.get("links", {}).items()
        }
        cache_metrics = {k: v for k, v in self.metrics.items() if k != "raw"}
        return {
            **self.workload,
            "links": links,
            "metrics": cache_metrics,
            "config": self.config,
            "disk_dir": self.disk_dir,
            "disk_kept": self.disk_kept,
            "failed_tiers": self.failed_tiers,
        }


async def run_live(
    config: KVTierConfig,
    params: ChatParams,
    on_turn: Callable[[], None] | None = None,
    predictor: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Open a :class:`~kvtier.cache.KVCache` on ``config`` (with the live prefetch
    ``predictor``, if any; ``None`` runs none, whatever the config's
    ``observe.predictor``: the option decides, so two runs differ only by it), play the
    workload, close.

    Returns (workload report, metrics snapshot taken after the cache closed, so pending
    write-downs are counted, with ``tier_health``: :func:`tier_health` after the close).
    With a predictor the report has its ``predictor`` stats.
    """
    from kvtier.cache import KVCache

    cache = KVCache(config, predictor=predictor or "none")
    async with cache:
        planner = cache.pipeline.planner
        top = cache.tiers[0].backend
        # Loaded pages are checked in place when the top tier has host views; an arena in
        # device memory (hbm) is checked through cache.read, a copy to the host.
        view = top.view if isinstance(top, ArenaBackend) and top.host_addressable else None
        workload = ChatWorkload(
            cache, params, config.spec.page_bytes, config.spec.page_tokens, view
        )
        report = await workload.run(on_turn)
        out = report.to_dict()
        if predictor is not None:
            out["predictor"] = cache.stats()["predictor"]
    metrics = cache.metrics.snapshot()
    metrics["tier_health"] = tier_health(cache, planner)
    return out, metrics


async def bench_run(
    base: ResolvedConfig,
    params: ChatParams,
    *,
    model: str | None = None,
    top_capacity: int | None = None,
    disk_dir: Path | None = None,
    on_turn: Callable[[], None] | None = None,
    predictor: str | None = None,
) -> RunResult:
    """Run the chat workload (see :func:`run_config` for the overrides).

    With ``disk_dir`` the disk tier's directory is kept (a second run finds its pages);
    without it a temporary directory is used and removed afterwards. ``predictor`` runs
    a live prefetch predictor (:mod:`kvtier.prefetcher`). When neither
    ``top_capacity`` nor the configuration sets the top tier's capacity (it is the
    embedded default's), the run sizes it with :func:`default_top_pages`, so that the
    workload spills whatever the model. A tier unreachable for the whole run does not
    raise: the result lists it in ``failed_tiers`` (:func:`failed_tiers`).
    """
    if top_capacity is None and base.sources.get("tiers[0].capacity", "default") == "default":
        cfg = run_config(base, model=model, disk_dir=None)
        pages = default_top_pages(params, cfg.spec.page_tokens, cfg.batch_pages)
        top_capacity = pages * cfg.spec.page_bytes
    kept = disk_dir is not None
    check_top_capacity(
        run_config(base, model=model, top_capacity=top_capacity, disk_dir=None), params
    )
    tmp = None if kept else Path(tempfile.mkdtemp(prefix="kvtier-bench-run-"))
    directory = disk_dir if disk_dir is not None else tmp
    try:
        config = run_config(
            base, model=model, top_capacity=top_capacity, disk_dir=directory, disk_required=kept
        )
        workload, metrics = await run_live(config, params, on_turn, predictor)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    failures = failed_tiers(metrics, [t.name for t in config.tiers], metrics.pop("tier_health"))
    opened = config.to_dict()
    # a configuration without a file/nvme tier below the top (a plugin's store, say) puts
    # nothing in the directory: report none rather than a directory no tier used
    used = any(str(t.get("options", {}).get("path")) == str(directory) for t in opened["tiers"])
    return RunResult(
        workload, metrics, opened, str(directory) if used else None, kept and used, failures
    )
