"""What a vLLM engine's pages are: the :class:`~kvtier.spec.KVSpec`, the namespace and
the kvtier configuration a worker opens.

* **Geometry** comes from the KV tensors vLLM registered (:class:`~.paged.PagedKV`): one
  page = one vLLM block (``page_tokens = block_size``) across every attention layer;
  ``num_kv_heads`` is this rank's share of the heads.
* **Namespace**: ``model_id`` is the kvtier config's ``namespace.model_id`` when set, else
  vLLM's model (name or path); ``revision`` is the config's when set, else vLLM's
  ``--revision``, else, for a local directory, a fingerprint of its weights (config files,
  file names and sizes, and every byte of each weight file, remembered by file identity
  in the runtime directory: :mod:`.weights`; two checkpoints at one path do not share
  pages), else ``main``. Always appended to ``model_id``: the attention
  backend and, on the CPU, its kernel ISA (the byte arrangement inside a block), the KV
  cache dtype as vLLM names it (fp8 variants share one torch dtype), the model dtype, a
  hash of the effective HF config (``hf_overrides`` included, the path it was loaded from
  left out: :func:`kv_variant`) and the
  tensor/pipeline parallel sizes;
  ``rank`` is ``pp_rank * tp_size + tp_rank``. So pages of another model, revision, KV
  dtype, block size, backend, parallel layout or rank never mix.
* **Tiers, pipeline, log** come from the user's kvtier configuration (a file, an inline
  table, ``$KVTIER_CONFIG`` or the embedded default, then ``KVTIER_*`` variables); a
  ``[model]`` section there is ignored (the engine's geometry wins; a warning says so when
  it differs).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtier.config import ENV_CONFIG_FILE, ResolvedConfig, load_config
from kvtier.config.raw import check_shape, record
from kvtier.errors import ConfigError
from kvtier.log import get_logger
from kvtier.spec import KVSpec, canonical_dtype

from .paged import PagedKV
from .settings import ConnectorSettings, runtime_dir
from .weights import weights_fingerprint

_log = get_logger("kvtier.vllm.identity")

#: Where a worker remembers the digests of weight files (in the runtime directory).
WEIGHT_DIGESTS_FILE = "weight-digests.json"


@dataclass(frozen=True)
class ParallelPlace:
    """Where one worker sits in the engine's parallel layout."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size


def parallel_place(vllm_config: Any, worker: bool) -> ParallelPlace:
    """This process's place (ranks are read from vLLM's process groups in a worker)."""
    pc = vllm_config.parallel_config
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    tp_rank = pp_rank = 0
    if worker and tp_size * pp_size > 1:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = int(get_tp_group().rank_in_group)
        pp_rank = int(get_pp_group().rank_in_group)
    return ParallelPlace(tp_size, pp_size, tp_rank, pp_rank, dp_rank)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """kvtier's canonical name for a torch dtype."""
    return canonical_dtype(str(dtype).removeprefix("torch."))


def spec_for(paged: PagedKV, model: str, use_mla: bool = False) -> KVSpec:
    """The page geometry of the registered tensors: content = K and V (2 x head_dim), or
    for an MLA model (``use_mla``, vLLM's ``model_config.use_mla``) one latent of
    ``content`` elements per token (one "head").

    Raises:
        ValueError: tensors with more than one head for an MLA model, without a heads
            dimension for another model, or an odd K/V width.
    """
    shape = (paged.num_blocks, *paged.block_shape)
    if use_mla and paged.heads != 1:
        raise ValueError(
            f"the KV tensors have shape {shape}, {paged.heads} heads, but the model uses MLA "
            f"(multi-head latent attention: one latent per token): the connector cannot "
            f"tell its block layout"
        )
    if not use_mla and paged.headless:
        raise ValueError(
            f"the KV tensors have shape {shape}, no heads dimension, but the model does not "
            f"use MLA (multi-head latent attention): the connector cannot tell its block "
            f"layout"
        )
    if not use_mla and paged.content % 2:
        raise ValueError(f"KV content width {paged.content} is odd: not a K/V pair")
    return KVSpec(
        num_layers=paged.num_layers,
        num_kv_heads=paged.heads,  # 1 for MLA (checked above)
        head_dim=paged.content if use_mla else paged.content // 2,
        dtype=torch_dtype_name(paged.dtype),
        page_tokens=paged.block_tokens,
        mla=use_mla,
        name=model,
    )


def backend_name(vllm_config: Any, layer: str) -> str:
    """The attention backend of ``layer`` as its block layout's name (``"unknown"`` when
    vLLM does not say); on vLLM-CPU with its kernel ISA, chosen from the machine's CPU
    flags: the AMX kernel packs K and V for its tiles, ``vec`` does not."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    module = ctx.get(layer)
    backend = getattr(module, "attn_backend", None)
    try:
        name = str(backend.get_name()) if backend is not None else "unknown"
    except Exception:
        name = "unknown"
    isa = getattr(module, "isa", None)
    return f"{name}+isa={isa}" if isinstance(isa, str) and isa else name


def kv_variant(vllm_config: Any) -> str:
    """What decides a block's bytes beyond the geometry, the backend and the weight files:
    vLLM's KV cache dtype (``fp8_e4m3`` and ``fp8_e5m2`` are both ``uint8`` tensors), the
    model's dtype (what an fp8 cache is quantized from) and the effective Hugging Face
    config, after ``hf_overrides`` (a rope scaling changes every K)."""
    cc = getattr(vllm_config, "cache_config", None)
    mc = getattr(vllm_config, "model_config", None)
    kv = str(getattr(cc, "cache_dtype", None) or "auto")
    parts = ["kv=" + {"fp8": "fp8_e4m3"}.get(kv, kv)]
    dtype = getattr(mc, "dtype", None)
    if isinstance(dtype, torch.dtype):
        parts.append("dtype=" + torch_dtype_name(dtype))
    hf = getattr(mc, "hf_config", None)
    if hf is not None and callable(getattr(hf, "to_json_string", None)):
        parts.append("cfg=" + config_digest(hf.to_json_string(use_diff=False)))
    return ",".join(parts)


#: Keys of a Hugging Face config that say where it was loaded from, not what the model
#: computes: copies of one checkpoint at two paths have the same KV.
_WHERE_KEYS = frozenset({"_name_or_path", "name_or_path"})


def config_digest(config_json: str) -> str:
    """A hash of a Hugging Face config (its JSON) without the keys that name its path
    (:data:`_WHERE_KEYS`, at any depth: sub-configs carry their own), keys sorted."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _WHERE_KEYS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    canonical = json.dumps(strip(json.loads(config_json)), sort_keys=True)
    return xxhash.xxh3_64_hexdigest(canonical.encode())


def config_origin(settings: ConnectorSettings, env: Mapping[str, str]) -> str:
    """Where the user's kvtier configuration comes from, as error messages name it
    (``kvtier config (<origin>): ...``): ``file:<path>`` for a TOML file (from
    ``kvtier_config`` or ``$KVTIER_CONFIG``), ``kv_connector_extra_config.kvtier_config``
    for an inline table, else the embedded default."""
    source = settings.kvtier_config
    if source is None and env.get(ENV_CONFIG_FILE):
        source = env[ENV_CONFIG_FILE]
    if source is None:
        return "the embedded default"
    if isinstance(source, dict):
        return "kv_connector_extra_config.kvtier_config"
    return f"file:{source}"


def user_layer(settings: ConnectorSettings, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The user's kvtier configuration as a raw (file-shaped) table, and where it came
    from (:func:`config_origin`): ``kvtier_config`` (a TOML path or an inline table), else
    ``$KVTIER_CONFIG``, else nothing (the embedded default then applies)."""
    source: str | dict[str, Any] | None = settings.kvtier_config
    named_by = "kv_connector_extra_config.kvtier_config"
    if source is None and env.get(ENV_CONFIG_FILE):
        source, named_by = env[ENV_CONFIG_FILE], f"${ENV_CONFIG_FILE}"
    origin = config_origin(settings, env)
    if source is None or isinstance(source, dict):
        return copy.deepcopy(source or {}), origin
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"kvtier config file {source!r} ({named_by}) cannot be read: {exc}"
        ) from None
    try:
        return tomllib.loads(text), origin
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"kvtier config file {source!r} is not valid TOML: {exc}") from None


def resolve(
    settings: ConnectorSettings,
    vllm_config: Any,
    paged: PagedKV,
    backend_name: str,
    place: ParallelPlace,
    env: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """The configuration a worker's :class:`~kvtier.cache.KVCache` opens with: the user's
    tiers, pipeline and log settings (``KVTIER_*`` variables still apply), the engine's
    geometry and namespace."""
    env = dict(os.environ if env is None else env)
    layer, origin = user_layer(settings, env)
    if not isinstance(layer, dict):
        raise ConfigError(f"kvtier config ({origin}) must be a table")
    with config_errors_named(origin):
        check_shape(layer, origin)  # an unknown key is named with its file or table
    mc = vllm_config.model_config
    model = str(mc.model)
    spec = spec_for(paged, model, getattr(mc, "use_mla", False) is True)
    if layer.get("model"):
        _log.warning(
            "the [model] section of the kvtier config is ignored: the engine's KV geometry is used",
            config_model=layer["model"],
            engine_model=spec.to_dict(),
        )
    ns_user = dict(layer.get("namespace") or {})
    for field in ("model_id", "revision"):
        var = f"KVTIER_NAMESPACE__{field.upper()}"
        if var in env:
            ns_user[field] = env[var]
    # the engine decides geometry and rank; the user's variables may not override them
    ignored = sorted(k for k in env if k.startswith("KVTIER_MODEL__"))
    if ignored:
        _log.warning(
            "KVTIER_MODEL__* variables are ignored: the engine's KV geometry is used",
            variables=ignored,
            engine_model=spec.to_dict(),
        )
    env = {
        k: v for k, v in env.items() if not k.startswith(("KVTIER_MODEL__", "KVTIER_NAMESPACE__"))
    }
    env.pop(ENV_CONFIG_FILE, None)
    model_id = str(ns_user.get("model_id") or model)
    revision = ns_user.get("revision") or getattr(mc, "revision", None)
    revision = revision or weights_fingerprint(Path(model), _digests(settings)) or "main"
    origins: dict[str, str] = {}  # an error names the file or table a key came from
    record(origins, {k: v for k, v in layer.items() if k not in ("model", "namespace")}, origin)
    layer["model"] = spec.to_dict()
    layer["namespace"] = {
        "model_id": f"{model_id}#vllm/{backend_name}/{kv_variant(vllm_config)}"
        f"/tp{place.tp_size}pp{place.pp_size}",
        "revision": str(revision),
        "rank": place.rank,
    }
    record(origins, {"model": layer["model"], "namespace": layer["namespace"]}, "the vLLM engine")
    with config_errors_named(origin):
        return load_config(layer, env=env, origins=origins)


def _digests(settings: ConnectorSettings) -> Path | None:
    """The file remembering weight digests, ``None`` when the runtime directory cannot be
    used (the digests are then computed at every start)."""
    try:
        return runtime_dir(settings) / WEIGHT_DIGESTS_FILE
    except (ConfigError, OSError) as exc:
        _log.warning("weight digests will not be remembered", error=str(exc))
        return None


@contextlib.contextmanager
def config_errors_named(origin: str) -> Iterator[None]:
    """Re-raise a :class:`ConfigError` from the block as ``kvtier config (<origin>): ...``,
    so that an engine's start-up error says which configuration is wrong: the config's
    own checks (:func:`resolve`) and a tier's options, checked only as the tier opens."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"kvtier config ({origin}): {exc}") from None


def engine_id(vllm_config: Any) -> str:
    """The id shared by one engine's scheduler and workers (distinct per engine)."""
    eid = getattr(vllm_config.kv_transfer_config, "engine_id", None)
    return str(eid) if eid else f"pid{os.getppid()}"
