"""The connector's own settings, read from ``kv_connector_extra_config``.

Every key the connector reads starts with ``kvtier_``; an unknown key that starts with
``kvtier`` in any case, with ``_`` or ``-`` (``kvtier-config`` too: a typo would otherwise
run the embedded default silently) or a value of the wrong type raises
:class:`~kvtier.errors.ConfigError` naming it, at engine start-up (never at the first
request). Other keys belong to vLLM or to other connectors and are ignored.

* ``kvtier_config`` (default none): a kvtier TOML file path or the same as an inline
  table (dict); none: ``$KVTIER_CONFIG``, else the embedded default.
* ``kvtier_lookup_timeout_s`` (2.0): the scheduler's wait for a worker's lookup answer;
  past it the prompt is a miss.
* ``kvtier_load_timeout_s`` (60.0): a forward's wait for loaded KV; past it the blocks are
  load errors (recomputed).
* ``kvtier_save_backlog_mib`` (1024): bytes of saves waiting for kvtier; past it new saves
  are dropped (counted). One save batch always goes when none is waiting, whatever its
  size, so a backlog below one step's saves slows saving but never stops it.
* ``kvtier_prefetch_on_lookup`` (true): a lookup that finds pages below the top tier
  starts moving them up.
* ``kvtier_load_async`` (``"never"``): which hits load *asynchronously*, across engine
  steps, instead of within the step that needs them: ``"never"``, ``"below-top"`` (hits
  with a page below the top tier: NVMe, remote) or ``"always"``. An asynchronous load
  keeps its request waiting (vLLM's ``WAITING_FOR_REMOTE_KVS``) while the other requests
  run their steps; a synchronous one holds the whole step until its pages are in. A model
  with several KV cache groups (:mod:`.groups`) loads every hit asynchronously.
* ``kvtier_runtime_dir`` (``$KVTIER_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR/kvtier`` or
  ``/tmp/kvtier-<uid>``): where the lookup sockets and the remembered weight digests live
  (0700).
* ``kvtier_metrics_port`` (none): serve kvtier's Prometheus metrics (``GET /metrics``)
  from each worker on this port plus its rank (0: any free port, logged).
* ``kvtier_metrics_host`` (``127.0.0.1``): the address that metrics server binds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

PREFIX = "kvtier_"
#: Values of ``kvtier_load_async``.
LOAD_ASYNC: tuple[str, ...] = ("never", "below-top", "always")


@dataclass(frozen=True)
class ConnectorSettings:
    """Parsed ``kvtier_*`` keys (see the module docstring)."""

    kvtier_config: str | dict[str, Any] | None = None
    lookup_timeout_s: float = 2.0
    load_timeout_s: float = 60.0
    save_backlog_bytes: int = 1024 << 20
    prefetch_on_lookup: bool = True
    load_async: str = "never"
    runtime_dir: Path | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be a finite number > 0, got {value!r}"
        )
    return float(value)


def _int(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(
            f"kv_connector_extra_config.{key} must be an integer in [{lo}, {hi}], got {value!r}"
        )
    return value


def parse_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Read the ``kvtier_*`` keys of ``extra`` (vLLM's ``kv_connector_extra_config``).

    Raises:
        ConfigError: an unknown ``kvtier_*`` key or a bad value, named.
    """
    extra = dict(extra or {})
    known = {
        "kvtier_config",
        "kvtier_lookup_timeout_s",
        "kvtier_load_timeout_s",
        "kvtier_save_backlog_mib",
        "kvtier_prefetch_on_lookup",
        "kvtier_load_async",
        "kvtier_runtime_dir",
        "kvtier_metrics_port",
        "kvtier_metrics_host",
    }
    # a misspelt kvtier key ("kvtier-config", "KVTIER_CONFIG") is ours too: ignored, it
    # would run the embedded default silently
    unknown = sorted(
        str(k)
        for k in extra
        if str(k).lower().replace("-", "_").startswith(PREFIX.rstrip("_")) and k not in known
    )
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    cfg = extra.get("kvtier_config")
    if cfg is not None and not isinstance(cfg, str | dict):
        raise ConfigError(
            "kv_connector_extra_config.kvtier_config must be a path to a kvtier TOML file or "
            f"an inline table (dict), got {type(cfg).__name__}"
        )
    if isinstance(cfg, str) and cfg.lstrip().startswith("{"):
        raise ConfigError(
            "kv_connector_extra_config.kvtier_config is a string holding JSON; give the "
            "inline configuration as a JSON object (no quotes around it), or a path to a "
            f"kvtier TOML file: got {cfg[:60]!r}"
        )
    prefetch = extra.get("kvtier_prefetch_on_lookup", True)
    if not isinstance(prefetch, bool):
        raise ConfigError(
            f"kv_connector_extra_config.kvtier_prefetch_on_lookup must be true or false, "
            f"got {prefetch!r}"
        )
    load_async = extra.get("kvtier_load_async", "never")
    if load_async not in LOAD_ASYNC:
        raise ConfigError(
            f"kv_connector_extra_config.kvtier_load_async must be one of "
            f"{', '.join(LOAD_ASYNC)}, got {load_async!r}"
        )
    runtime = extra.get("kvtier_runtime_dir")
    if runtime is not None and (not isinstance(runtime, str) or not runtime or "\0" in runtime):
        raise ConfigError(
            f"kv_connector_extra_config.kvtier_runtime_dir must be a directory path, "
            f"got {runtime!r}"
        )
    port = extra.get("kvtier_metrics_port")
    host = extra.get("kvtier_metrics_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(
            f"kv_connector_extra_config.kvtier_metrics_host must be an address, got {host!r}"
        )
    return ConnectorSettings(
        kvtier_config=cfg,
        lookup_timeout_s=_positive_float(
            "kvtier_lookup_timeout_s", extra.get("kvtier_lookup_timeout_s", 2.0)
        ),
        load_timeout_s=_positive_float(
            "kvtier_load_timeout_s", extra.get("kvtier_load_timeout_s", 60.0)
        ),
        save_backlog_bytes=_int(
            "kvtier_save_backlog_mib", extra.get("kvtier_save_backlog_mib", 1024), 1, 1 << 30
        )
        << 20,
        prefetch_on_lookup=prefetch,
        load_async=load_async,
        runtime_dir=Path(runtime) if runtime else None,
        metrics_port=None if port is None else _int("kvtier_metrics_port", port, 0, 65535),
        metrics_host=host,
    )


def runtime_dir(settings: ConnectorSettings, env: Mapping[str, str] | None = None) -> Path:
    """The private directory of the lookup sockets and the remembered weight digests
    (created 0700 if missing).

    Raises :class:`ConfigError` when the path is a symlink, not a directory, or owned by
    another user (a socket there could be answered by someone else)."""
    env = os.environ if env is None else env
    if settings.runtime_dir is not None:
        path = settings.runtime_dir
    elif env.get("KVTIER_RUNTIME_DIR"):
        path = Path(env["KVTIER_RUNTIME_DIR"])
    elif env.get("XDG_RUNTIME_DIR"):
        path = Path(env["XDG_RUNTIME_DIR"]) / "kvtier"
    else:
        path = Path("/tmp") / f"kvtier-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # something else is there: named below
    except OSError as exc:
        raise ConfigError(f"kvtier runtime directory {str(path)!r} cannot be made: {exc}") from None
    st = path.lstat()
    import stat

    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"kvtier runtime directory {str(path)!r} is a symlink (to {os.readlink(path)!r}): "
            "its sockets could be redirected; give the directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"kvtier runtime directory {str(path)!r} is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"kvtier runtime directory {str(path)!r} belongs to uid {st.st_uid}, not to this "
            f"user ({os.getuid()}); set kvtier_runtime_dir to a private directory"
        )
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path
