"""The raw (file-shaped) layer of the configuration: which sections and keys exist,
merging a layer into another while recording where each value came from, and the
``KVTIER_*`` environment layer. Everything here works on plain dicts; typing and
validation happen in :mod:`kvtier.config.model`.
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.config.defaults import ENV_PREFIX
from kvtier.errors import ConfigError

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": (
        "preset", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_tokens", "mla", "name",
    ),
    "namespace": ("model_id", "revision", "rank"),
    "pipeline": (
        "write_policy", "admission", "admission_params", "batch_pages", "max_inflight_per_link",
        "leaf_first", "background_eviction",
    ),
    "log": ("format", "level"),
    "observe": ("whatif", "predictor"),
}  # fmt: skip
TIER_KEYS: tuple[str, ...] = (
    "name",
    "backend",
    "capacity",
    "high_watermark",
    "low_watermark",
    "eviction",
    "eviction_params",
    "options",
    "on_open_error",
    "codec",
    "codec_params",
)
#: Keys whose values are free-form tables passed through (their inner keys are not checked here).
OPEN_TABLES = ("admission_params", "eviction_params", "options", "codec_params")


def flatten(raw: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of ``raw`` (``tiers[i].key`` for tier tables)."""
    out: list[tuple[str, Any]] = []
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else k
        if k == "tiers" and not prefix and isinstance(v, list):
            for i, tier in enumerate(v):
                out.extend(flatten(tier, f"tiers[{i}]") if isinstance(tier, Mapping) else [])
        elif isinstance(v, Mapping) and v:
            out.extend(flatten(v, key))
        else:
            out.append((key, v))
    return out


def record(sources: dict[str, str], raw: Mapping[str, Any], origin: str, prefix: str = "") -> None:
    """Note ``origin`` as the source of every leaf of ``raw``."""
    for key, _ in flatten(raw, prefix):
        sources[key] = origin


def source_note(sources: Mapping[str, str], key: str) -> str:
    """`` (from ORIGIN)`` for the value at ``key``, or for a table, for the first of its
    leaves (``tiers[0].codec_params.level``) with a source other than the default; ``""``
    when there is none."""
    origin = sources.get(key)
    if origin is None:
        inner = [v for k, v in sources.items() if k.startswith((f"{key}.", f"{key}["))]
        origin = next((v for v in inner if v != "default"), None)
    return f" (from {origin})" if origin and origin != "default" else ""


def codec_source_note(sources: Mapping[str, str], p: str) -> str:
    """`` (from A, B)`` for tier ``p``'s codec and its parameters, each origin other than the
    default once, the codec's first: a codec error may come from either."""
    origins = [sources.get(f"{p}.codec", "default")]
    origins += [v for k, v in sources.items() if k.startswith(f"{p}.codec_params.")]
    named = list(dict.fromkeys(o for o in origins if o != "default"))
    return f" (from {', '.join(named)})" if named else ""


#: What a tier name may not be, and why: ``KVTIER_TIERS__<name>__<key>`` variables find a
#: tier by its name, ignoring case, or by its index (see :func:`check_tier_name`).
_NAME_RULE = (
    "KVTIER_TIERS__<name or index>__<key> variables find a tier by its name (ignoring "
    "case) or its index"
)


def check_tier_name(
    p: str,
    name: str,
    given: bool,
    seen: dict[str, tuple[str, str]],
    sources: Mapping[str, str],
) -> None:
    """Refuse a tier name (``name`` of tier ``p``, e.g. ``tiers[1]``; ``given``: written
    in the config, else the backend's name) that an environment variable could not reach
    or would confuse with another tier's: only digits (an index), ``__`` inside or ``_``
    at an end (the level separator), ``->`` (the link separator of metrics), the name of
    a tier in ``seen`` (lower-cased name -> (tier, name)) ignoring case. Records it in
    ``seen``. :class:`ConfigError` names the key and its source."""
    key = f"{p}.name"
    where = source_note(sources, key)
    if name.isdigit():
        raise ConfigError(
            f"{key}: {name!r} is only digits, which would read as an index ({_NAME_RULE}){where}"
        )
    if "__" in name or name.startswith("_") or name.endswith("_"):
        raise ConfigError(
            f"{key}: {name!r} holds '__' or starts or ends with '_', which would be read "
            f"as the separator of levels ({_NAME_RULE}){where}"
        )
    if "->" in name:
        raise ConfigError(
            f"{key}: {name!r} holds '->', which names the link between two tiers in metrics "
            f"(tiers 'a' and 'b->c' would share the link series 'a->b->c'){where}"
        )
    other = seen.get(name.lower())
    if other is not None and not given:
        raise ConfigError(
            f"{key}: duplicate tier name {name!r}: no name is given, so the tier is named "
            f"after its backend, and {other[0]} is named {other[1]!r}; give each tier a "
            f"name{where}"
        )
    if other is not None:
        case = "" if other[1] == name else "; names must differ in more than case, as "
        raise ConfigError(
            f"{key}: duplicate tier name {name!r} ({other[0]} is named {other[1]!r}{case}"
            f"{_NAME_RULE if case else ''}){where}"
        )
    seen[name.lower()] = (p, name)


def check_shape(raw: Any, origin: str) -> None:
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
                    if k not in TIER_KEYS:
                        raise ConfigError(
                            f"tiers[{i}].{k}: unknown key{where}; known: {', '.join(TIER_KEYS)}"
                        )
            continue
        if section not in SECTIONS:
            known = ", ".join([*SECTIONS, "tiers"])
            raise ConfigError(f"{section}: unknown section{where}; known: {known}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{section}: must be a table{where}")
        for k in body:
            if k not in SECTIONS[section]:
                raise ConfigError(
                    f"{section}.{k}: unknown key{where}; known: {', '.join(SECTIONS[section])}"
                )


def merge(
    base: dict[str, Any], over: Mapping[str, Any], sources: dict[str, str], origin: str
) -> None:
    """Merge ``over`` into ``base`` (a given tier list replaces the default one)."""
    for section, body in over.items():
        if section == "tiers":
            for key in [k for k in sources if k.startswith("tiers[")]:
                del sources[key]
            base["tiers"] = copy.deepcopy(list(body))
            for i, tier in enumerate(body):
                record(sources, tier, origin, f"tiers[{i}]")
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
                record(sources, v, origin, f"{section}.{k}")
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
        if name.startswith(ENV_PREFIX) and "__" not in name:
            _refuse_single_underscores(name)
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if any(not p for p in parts):
            raise ConfigError(f"{name}: malformed variable name (empty level)")
        out.append((name, parts, _parse_env_value(env[name])))
    return out


def _refuse_single_underscores(name: str) -> None:
    """A ``KVTIER_`` variable without ``__`` is left to other parts of kvtier, unless it
    is a config section (``KVTIER_TIERS``) or starts with one: ``KVTIER_PIPELINE_BATCH_PAGES``
    is a setting misspelt with single underscores, which would otherwise be dropped without
    a word."""
    rest = name[len(ENV_PREFIX) :]
    if rest.lower() in (*SECTIONS, "tiers"):
        hint = "TIERS__<name or index>__<key>" if rest.lower() == "tiers" else f"{rest}__<key>"
        raise ConfigError(
            f"{name}: a section is not set as a whole; set its keys, one variable each, "
            f"with double underscores between levels (KVTIER_{hint})"
        )
    for section in (*SECTIONS, "tiers"):
        head = section.upper() + "_"
        if rest.startswith(head) and len(rest) > len(head):
            hint = (
                "KVTIER_TIERS__<name or index>__<key>"
                if section == "tiers"
                else f"KVTIER_{section.upper()}__{rest[len(head) :]}"
            )
            raise ConfigError(
                f"{name}: levels of a kvtier setting are separated by double underscores "
                f"(did you mean {hint}?)"
            )


def apply_env(raw: dict[str, Any], env: Mapping[str, str], sources: dict[str, str]) -> None:
    """Apply every ``KVTIER_A__B`` variable of ``env`` to ``raw``, recording its source."""
    for name, parts, value in _env_layer(env, raw.get("tiers", [])):
        origin = f"env:{name}"
        section = parts[0]
        if section == "tiers":
            if len(parts) < 3:
                raise ConfigError(f"{name}: use KVTIER_TIERS__<name or index>__<key>")
            ref, key, rest = parts[1], parts[2], parts[3:]
            tiers = raw.setdefault("tiers", [])
            idx = _tier_index(tiers, ref, name)
            if key not in TIER_KEYS:
                raise ConfigError(
                    f"{name}: tiers[{idx}].{key} is not a tier key; known: {', '.join(TIER_KEYS)}"
                )
            if rest and key not in OPEN_TABLES:
                raise ConfigError(f"{name}: tiers[{idx}].{key} is not a table")
            target = tiers[idx]
            path = [key, *rest]
            dotted = f"tiers[{idx}]." + ".".join(path)
        else:
            if section not in SECTIONS:
                known = ", ".join([*SECTIONS, "tiers"])
                raise ConfigError(f"{name}: unknown section {section!r}; known: {known}")
            if len(parts) < 2:
                raise ConfigError(f"{name}: use KVTIER_{section.upper()}__<key>")
            key, rest = parts[1], parts[2:]
            if key not in SECTIONS[section]:
                raise ConfigError(
                    f"{name}: {section}.{key} is not a key; known: {', '.join(SECTIONS[section])}"
                )
            if rest and key not in OPEN_TABLES:
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


def check_store_paths(tiers: Sequence[Any], sources: Mapping[str, str]) -> None:
    """Refuse two tiers whose ``options.path`` name one directory (after ``~`` and
    symlinks): a store directory is locked by the tier that opens it, so the second tier
    was skipped at start with "already open ... (holder pid <its own pid>)", while
    ``inspect config --check``, which opens one tier at a time, passed both.
    :class:`ConfigError` names both tiers and the key's source."""
    seen: dict[Path, tuple[int, str]] = {}
    for i, tier in enumerate(tiers):
        path = tier.options.get("path")
        if not isinstance(path, str | os.PathLike) or not str(path):
            continue
        if "\x00" in str(os.fspath(path)):
            key = f"tiers[{i}].options.path"
            raise ConfigError(
                f"{key}: tier {tier.name!r}: the path {str(path)!r} holds a NUL byte, which "
                f"no file name may{source_note(sources, key)}"
            )
        where = Path(os.path.expanduser(os.fspath(path))).resolve(strict=False)
        other = seen.get(where)
        if other is not None:
            key = f"tiers[{i}].options.path"
            raise ConfigError(
                f"{key}: tier {tier.name!r} uses the directory {str(where)!r} of tier "
                f"{other[1]!r} (tiers[{other[0]}]); give each tier its own directory"
                f"{source_note(sources, key)}"
            )
        seen[where] = (i, tier.name)
