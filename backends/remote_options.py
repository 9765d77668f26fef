"""Options of the Redis-protocol remote store, validated once at construction.

Every option can come from a config file or ``KVTIER_*`` environment variable (as strings)
or from Python. :func:`parse_options` converts and checks them and raises
:class:`~kvtier.errors.ConfigError` naming the option for anything unknown or invalid.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.errors import ConfigError
from kvtier.options import mask_url_password

#: Characters a key prefix may not hold: hash-tag braces (they decide the cluster slot),
#: glob metacharacters (``keys()`` scans with a pattern) and whitespace.
_BAD_PREFIX = re.compile(r"[{}*?\[\]\\\s]")


#: Bytes per pipelined round trip when ``batch_pages`` is 0 (auto).
AUTO_BATCH_BYTES = 16 << 20
#: Upper bound of the automatic pipeline depth.
AUTO_BATCH_MAX_PAGES = 64


def pipeline_pages(batch_pages: int, page_bytes: int) -> int:
    """The pipeline depth in pages: ``batch_pages``, or by bytes when it is 0."""
    if batch_pages > 0:
        return batch_pages
    return max(1, min(AUTO_BATCH_MAX_PAGES, AUTO_BATCH_BYTES // page_bytes))


@dataclass(frozen=True)
class UrlParts:
    """What the data path needs from a ``redis://`` URL (see :func:`url_parts`)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None


def url_parts(url: str) -> UrlParts:
    """Host, port, database number (the path, ``/0`` by default) and credentials of a
    URL already accepted by :func:`parse_options`. Raises :class:`ConfigError` for a
    database that is not a non-negative integer."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"redis option 'url' must end in a database number, got {url!r}")
    return UrlParts(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 6379,
        db=int(path or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


@dataclass(frozen=True)
class RemoteOptions:
    """Validated options of :class:`~kvtier.backends.remote.RedisStore`.

    Attributes:
        url: ``redis://[user:pass@]host:port/db`` or ``rediss://`` for TLS. For a
            cluster, any one node (the client discovers the others).
        cluster: use ``redis.asyncio.RedisCluster`` (cluster mode).
        key_prefix: readable prefix of every key (e.g. a namespace label), so operators can
            tell kvtier pages apart; keys are ``<prefix>:{<32 hex digits>}``.
        ttl_s: expire committed pages after this many seconds; ``None`` keeps them until
            deleted or evicted by the server.
        batch_pages: pages per pipelined round trip (the pipeline depth); ``0`` (the
            default) sizes it by bytes: as many pages as fit in :data:`AUTO_BATCH_BYTES`
            (4 pages of 4 MiB, 64 of 256 KiB). A call with more pages runs several such
            pipelines concurrently (up to ``max_inflight``), so verifying and copying one
            batch overlaps the transfer of the next; small pages gain nothing from the
            split and pay its fixed cost, hence the byte-based default.
        max_inflight: pipelines in flight at once per store (bounded concurrency).
        op_timeout_s: deadline of one pipelined batch; past it the batch is a miss.
        connect_timeout_s: deadline of establishing one connection.
        retry_interval_s: fail fast during an outage: after a failed batch, calls miss at
            once without reaching for the server, except one probe batch per interval
            (the interval doubles after each failed probe, up to 32x). 0 (the default)
            sends every batch, so each call waits up to ``op_timeout_s``.
        username / password: AUTH credentials (ACL user, or ``requirepass`` alone).
        tls: force TLS (also implied by a ``rediss://`` URL).
        tls_ca_certs / tls_certfile / tls_keyfile: CA bundle, client certificate and key.
        tls_verify: verify the server certificate and host name.
    """

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvtier"
    ttl_s: float | None = None
    batch_pages: int = 0
    max_inflight: int = 4
    op_timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    retry_interval_s: float = 0.0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_certs: str | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_verify: bool = True

    def public(self) -> dict[str, Any]:
        """The options as plain data, with the password masked (for ``stats``/logs)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["password"] is not None:
            out["password"] = "***"
        out["url"] = mask_url_password(self.url)
        return out


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_TRUE | _BOOL_FALSE:
        return value.strip().lower() in _BOOL_TRUE
    raise ConfigError(f"redis option {name!r} must be a boolean, got {value!r}")


#: Upper bounds: a deadline or interval past a day, or a batch/concurrency past these,
#: is a mistake (``inf`` would switch a deadline off), not a setting.
MAX_SECONDS = 86400.0
MAX_TTL_SECONDS = 10 * 365 * 86400.0
MAX_BATCH_PAGES = 1 << 16
MAX_INFLIGHT = 1024


def _as_number(
    name: str, value: Any, *, integer: bool, minimum: float, maximum: float = MAX_SECONDS
) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"redis option {name!r} must be a number, got {value!r}")
    try:
        num = int(value) if integer else float(value)
    except (TypeError, ValueError, OverflowError):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"redis option {name!r} must be {kind}, got {value!r}") from None
    if integer and isinstance(value, float) and value != int(value):
        raise ConfigError(f"redis option {name!r} must be an integer, got {value!r}")
    if not minimum <= num <= maximum:  # also refuses nan and inf
        raise ConfigError(
            f"redis option {name!r} must be a finite number in [{minimum:g}, {maximum:g}], "
            f"got {value!r}"
        )
    return num


def _as_opt_str(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"redis option {name!r} must be a string, got {value!r}")
    return value


def _as_file(name: str, value: Any, what: str) -> str | None:
    """A TLS file option: a path to a readable file (``what`` it holds, for the error)."""
    path = _as_opt_str(name, value)
    if path is not None and not os.path.isfile(path):
        why = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"redis option {name!r} ({what}): {path!r} {why}")
    return path


def parse_options(raw: dict[str, Any]) -> RemoteOptions:
    """Validate ``raw`` (strings allowed for every value) into :class:`RemoteOptions`.

    Raises :class:`ConfigError` naming the first unknown or invalid option.
    """
    known = {f.name for f in fields(RemoteOptions)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"redis: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    d = RemoteOptions()
    url = raw.get("url", d.url)
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss"):
        raise ConfigError(f"redis option 'url' must be a redis:// or rediss:// URL, got {url!r}")
    try:
        port = urlsplit(url).port
    except ValueError:
        raise ConfigError(f"redis option 'url' has a bad port: {url!r}") from None
    if not urlsplit(url).hostname or port is None:
        raise ConfigError(f"redis option 'url' must name a host and a port, got {url!r}")
    url_parts(url)  # the database number
    prefix = raw.get("key_prefix", d.key_prefix)
    if not isinstance(prefix, str) or not prefix or _BAD_PREFIX.search(prefix):
        raise ConfigError(
            "redis option 'key_prefix' must be a non-empty string without braces, "
            f"glob characters (*?[]\\) or whitespace, got {prefix!r}"
        )
    ttl_raw = raw.get("ttl_s", d.ttl_s)
    ttl = (
        None
        if ttl_raw in (None, "", "none", 0, "0")
        else _as_number("ttl_s", ttl_raw, integer=False, minimum=0.001, maximum=MAX_TTL_SECONDS)
    )
    return RemoteOptions(
        url=url,
        cluster=_as_bool("cluster", raw.get("cluster", d.cluster)),
        key_prefix=prefix,
        ttl_s=ttl,
        batch_pages=int(
            _as_number(
                "batch_pages",
                raw.get("batch_pages", d.batch_pages),
                integer=True,
                minimum=0,
                maximum=MAX_BATCH_PAGES,
            )
        ),
        max_inflight=int(
            _as_number(
                "max_inflight",
                raw.get("max_inflight", d.max_inflight),
                integer=True,
                minimum=1,
                maximum=MAX_INFLIGHT,
            )
        ),
        op_timeout_s=_as_number(
            "op_timeout_s", raw.get("op_timeout_s", d.op_timeout_s), integer=False, minimum=0.001
        ),
        connect_timeout_s=_as_number(
            "connect_timeout_s",
            raw.get("connect_timeout_s", d.connect_timeout_s),
            integer=False,
            minimum=0.001,
        ),
        retry_interval_s=_as_number(
            "retry_interval_s",
            raw.get("retry_interval_s", d.retry_interval_s),
            integer=False,
            minimum=0.0,
        ),
        username=_as_opt_str("username", raw.get("username")),
        password=_as_opt_str("password", raw.get("password")),
        tls=_as_bool("tls", raw.get("tls", d.tls)) or urlsplit(url).scheme == "rediss",
        tls_ca_certs=_as_file("tls_ca_certs", raw.get("tls_ca_certs"), "the CA bundle"),
        tls_certfile=_as_file("tls_certfile", raw.get("tls_certfile"), "the client certificate"),
        tls_keyfile=_as_file("tls_keyfile", raw.get("tls_keyfile"), "the client key"),
        tls_verify=_as_bool("tls_verify", raw.get("tls_verify", d.tls_verify)),
    )
