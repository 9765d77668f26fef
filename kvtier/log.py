"""Structured logging for kvtier: structlog, to stderr, as console text or JSON lines.

kvtier logs events, never prints (only the CLI prints). Call :func:`configure_logging`
once at start-up (``KVCache`` does it from its config unless told not to); library code
gets loggers with :func:`get_logger`. Logs always go to stderr so that ``--json`` output
on stdout stays one clean object.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO, cast

import structlog

from kvtier.errors import ConfigError

LogFormat = Literal["console", "json"]

LOG_FORMATS: tuple[str, ...] = ("console", "json")
LOG_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def parse_level(level: str | int) -> int:
    """A logging level from a name (``"info"``) or number; :class:`ConfigError` if unknown."""
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    try:
        return LOG_LEVELS[str(level).lower()]
    except KeyError:
        known = ", ".join(LOG_LEVELS)
        raise ConfigError(f"log.level: unknown level {level!r}; known: {known}") from None


def configure_logging(
    format: str = "console",
    level: str | int = "info",
    stream: TextIO | None = None,
    *,
    stdlib: bool = True,
) -> None:
    """Configure structlog for the whole process.

    Args:
        format: ``"console"`` (human-readable, one line per event) or ``"json"`` (one JSON
            object per line).
        level: minimum level, by name or number.
        stream: where to write (default: ``sys.stderr``, looked up at each write so that
            test harnesses that swap stderr see the output).
        stdlib: also render the lines kvtier logs through :mod:`logging` (see
            :data:`STDLIB_LOGGERS`) this way.

    Raises:
        ConfigError: unknown format or level.
    """
    if format not in LOG_FORMATS:
        raise ConfigError(f"log.format: unknown format {format!r}; known: console, json")
    lvl = parse_level(level)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    out = stream if stream is not None else cast(TextIO, _StderrProxy())
    factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    if stdlib:
        _route_stdlib_logging(renderer, lvl, out)


#: The stdlib loggers whose lines :func:`configure_logging` renders as kvtier's own
#: (built-in backends, the registry and codecs log through :mod:`logging`, under these).
STDLIB_LOGGERS: tuple[str, ...] = ("kvtier",)


class _KvtierHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure_logging` puts on :data:`STDLIB_LOGGERS` (replaced,
    not added to, when it is called again)."""


def _component_from_logger(
    _: Any, __: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    record = event.get("_record")
    if record is not None:
        event.setdefault("component", record.name)
    return event


def _route_stdlib_logging(renderer: Any, level: int, stream: TextIO) -> None:
    """Render kvtier's stdlib log lines (a remote store's outage and recovery lines, a
    file store's failed write, ...) with the same renderer, level and stream as its
    structlog events: before, they went to Python's last-resort handler as bare text
    (breaking JSON-lines output) whatever ``[log]`` said. The records still propagate:
    an application that handles the root logger sees them too (it may also pass
    ``configure_log=False`` to ``KVCache`` and configure both itself)."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _component_from_logger,
            structlog.processors.format_exc_info,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = _KvtierHandler(stream)
    handler.setFormatter(formatter)
    handler.setLevel(level)  # the handler's, not the loggers': others' handlers keep theirs
    for name in STDLIB_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _KvtierHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)


class _StderrProxy:
    """A file-like object that writes to whatever ``sys.stderr`` is at write time."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger carrying ``component=name`` and any extra context.

    The logger is lazy: it follows the configuration in force when it logs, so module-level
    loggers created at import honour a later :func:`configure_logging`.
    """
    return structlog.get_logger(component=name, **context)


# Until an application configures structlog, kvtier's events go to stderr (structlog's own
# default is stdout, which would corrupt ``--json`` output). The stdlib lines are left to
# the application until kvtier is asked to configure logging (KVCache, the CLI).
if not structlog.is_configured():
    configure_logging(stdlib=False)
