"""Resolving a configuration: the embedded default, then a source (a TOML file, a dict
or a :class:`~kvtier.config.model.KVTierConfig`), then the environment."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config.defaults import ENV_CONFIG_FILE, default_raw
from kvtier.config.model import KVTierConfig, ResolvedConfig, to_raw, validate_raw
from kvtier.config.raw import apply_env, check_shape, merge, record
from kvtier.errors import ConfigError

_MAX_CONFIG_BYTES = 16 << 20


def read_file(path: Path | str) -> dict[str, Any]:
    """The TOML table in ``path``; :class:`ConfigError` for an empty path, a file that is
    missing, a directory, unreadable, not UTF-8 text (binary, UTF-16) or not TOML."""
    if "\x00" in str(path):
        raise ConfigError(f"config file path {str(path)!r} contains a NUL byte")
    if str(path) == "":
        raise ConfigError("config file: an empty path was given; name a TOML file")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > _MAX_CONFIG_BYTES:
                raise ConfigError(f"config file {str(path)!r} is larger than 16 MiB")
            data = f.read()
        return tomllib.loads(data.decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (binary, or UTF-16?): cannot decode "
            f"byte {exc.start}; save it as UTF-8 TOML"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except IsADirectoryError:
        # Path("") reads as ".": an empty -c/--config arrives as that
        empty = " (an empty path names the current directory)" if str(path) == "." else ""
        raise ConfigError(
            f"config file {str(path)!r} is a directory, not a TOML file{empty}"
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"config file {str(path)!r} cannot be read: {reason}") from None


def load_config(
    source: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
    env: Mapping[str, str] | None = None,
    origins: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve a configuration from the default, a source and the environment.

    Args:
        source: a TOML file path, a file-shaped dict, a :class:`KVTierConfig`, an already
            resolved config (returned as-is), or ``None`` (then ``$KVTIER_CONFIG`` if set,
            else the embedded default).
        env: environment to read ``KVTIER_*`` overrides from (default ``os.environ``; pass
            ``{}`` to ignore the environment).
        origins: where keys of a dict ``source`` came from (``"tiers[0].capacity"`` ->
            ``"--dram-capacity"``), as messages and :attr:`ResolvedConfig.sources` name
            them; other keys of a dict come from ``"python"``.

    Raises:
        ConfigError: unknown key, bad value, capacity below one page, unreadable file.
    """
    if isinstance(source, ResolvedConfig):
        return source
    env = os.environ if env is None else env
    raw = default_raw()
    sources: dict[str, str] = {}
    record(sources, raw, "default")
    layer: Mapping[str, Any] | None = None
    origin = "python"
    if source is None or isinstance(source, str | Path):
        layer, origin = file_layer(source, env)
    elif isinstance(source, KVTierConfig):
        layer = to_raw(source)
    elif isinstance(source, Mapping):
        layer = source
    elif source is not None:
        raise ConfigError(
            f"config source must be a path, dict or KVTierConfig, got {type(source).__name__}"
        )
    if layer is not None:
        check_shape(layer, origin)
        merge(raw, layer, sources, origin)
        if origins:
            sources.update((k, v) for k, v in origins.items() if k in sources)
    apply_env(raw, env, sources)
    check_shape(raw, "the environment")
    config = validate_raw(raw, sources)
    preset = raw["model"].get("preset") if isinstance(raw.get("model"), dict) else None
    return ResolvedConfig(config, sources, preset if isinstance(preset, str) else None)


def file_layer(
    source: str | Path | None, env: Mapping[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """The TOML table of the file ``source`` names (``None``: ``$KVTIER_CONFIG`` of
    ``env`` when set, else no file: ``(None, "python")``) and its origin as sources name
    it (``file:PATH``, ``env:KVTIER_CONFIG=PATH``); :class:`ConfigError` as
    :func:`read_file`."""
    if source is None:
        if not env.get(ENV_CONFIG_FILE):
            return None, "python"
        path = Path(env[ENV_CONFIG_FILE])
        return read_file(path), f"env:{ENV_CONFIG_FILE}={path}"
    return read_file(source if source == "" else Path(source)), f"file:{Path(source)}"


def default_config() -> KVTierConfig:
    """The embedded default configuration (no file, no environment)."""
    return load_config(None, env={}).config
