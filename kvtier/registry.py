"""Finding backends: the ``kvtier.backends`` entry-point group and ``module:Class`` paths.

Built-in backends register through the same entry-point group as third-party plugins
(see ``pyproject.toml``). Discovery never raises: a backend whose module fails to import
(missing package, no GPU) or whose :meth:`~kvtier.backend.Backend.unavailable_reason`
says it cannot run is listed as unavailable, with the reason.

When two distributions register the same name, kvtier's own (built-in) registration wins,
else the first in distribution-name order, and a warning names both (once per name and
process): a plugin can never silently replace a built-in tier.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.backend import Backend
from kvtier.errors import BackendUnavailableError, KVTierError, UnknownBackendError

ENTRY_POINT_GROUP = "kvtier.backends"
#: The distribution whose registrations are the built-ins.
BUILTIN_DISTRIBUTION = "kvtier"

_log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class BackendInfo:
    """What discovery knows of one backend.

    Attributes:
        name: the name to use in config (entry-point name, or the ``module:Class`` path).
        target: ``module:Class`` the name resolves to.
        origin: where it came from: ``entry point (distribution X.Y)`` or ``path``.
        kind: ``arena`` or ``store``; ``None`` when the class could not be loaded.
        available: whether it can run here.
        reason: why not, when ``available`` is false.
    """

    name: str
    target: str
    origin: str
    kind: str | None
    available: bool
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return str(dist.metadata["Name"]) if dist is not None else ""


def unique_entry_points(group: str, what: str = "backend") -> list[importlib.metadata.EntryPoint]:
    """One entry point of ``group`` per name, sorted by name: for a name registered
    twice, the built-in (or else the first distribution by name), with one warning per
    name naming the others (``what`` names the kind in it: ``backend``, ``codec``). A
    plugin never silently shadows a built-in: a plugin's ``zstd`` codec took the place of
    kvtier's, and a tier served its decoding as the page."""
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=group):
        by_name.setdefault(ep.name, []).append(ep)
    chosen: list[importlib.metadata.EntryPoint] = []
    for name, eps in sorted(by_name.items()):
        distinct = {(ep.value, _dist_name(ep)) for ep in eps}
        ranked = sorted(eps, key=lambda e: (_dist_name(e) != BUILTIN_DISTRIBUTION, _dist_name(e)))
        chosen.append(ranked[0])
        if len(distinct) > 1 and (group, name) not in _warned:
            _warned.add((group, name))
            others = ", ".join(
                f"{e.value} ({_dist_name(e) or 'unknown distribution'})" for e in ranked[1:]
            )
            _log.warning(
                "%s name %r is registered more than once: using %s (%s), ignoring %s; "
                "a plugin must register a name of its own",
                what,
                name,
                ranked[0].value,
                _dist_name(ranked[0]) or "unknown distribution",
                others,
            )
    return chosen


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return unique_entry_points(ENTRY_POINT_GROUP)


def _load_target(target: str) -> type[Backend]:
    """Import ``module:Class`` and check it is a backend. Raises on any failure."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownBackendError(f"backend path {target!r} is not of the form 'module:Class'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise UnknownBackendError(f"{target!r} is not a kvtier Backend subclass")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise UnknownBackendError(
            f"{target!r} is an abstract class: it does not implement {missing} (a bug of "
            "the package that registers it)"
        )
    return obj


def _describe(name: str, target: str, origin: str) -> BackendInfo:
    try:
        cls = _load_target(target)
    except Exception as exc:  # discovery must survive any plugin failure
        return BackendInfo(name, target, origin, None, False, f"cannot load: {exc!r}")
    try:
        reason = cls.unavailable_reason()
    except Exception as exc:
        reason = f"availability check failed: {exc!r}"
    return BackendInfo(name, target, origin, str(cls.kind), reason is None, reason)


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    if dist is None:
        return "entry point"
    return f"entry point ({dist.metadata['Name']} {dist.version})"


def discover() -> list[BackendInfo]:
    """Every backend registered in the entry-point group, sorted by name. Never raises."""
    infos: dict[str, BackendInfo] = {}
    try:
        eps = _entry_points()
    except Exception:  # a broken metadata file must not break discovery
        return []
    for ep in eps:  # one per name: duplicates were resolved (and warned about) there
        infos[ep.name] = _describe(ep.name, ep.value, _origin(ep))
    return list(infos.values())


def describe(name: str) -> BackendInfo:
    """Discovery information for one name or ``module:Class`` path. Never raises."""
    if ":" in name:
        return _describe(name, name, "path")
    for info in discover():
        if info.name == name:
            return info
    return BackendInfo(name, "", "unknown", None, False, "no such backend")


def _names_missing_target(exc: Exception, target: str) -> bool:
    """Whether ``exc`` says the path's own module or attribute is missing (rather than
    something the module itself failed to import)."""
    if isinstance(exc, AttributeError):
        return True
    module_name = target.partition(":")[0]
    missing = getattr(exc, "name", None) or ""
    return bool(missing) and (module_name == missing or module_name.startswith(missing + "."))


def resolve(name: str) -> type[Backend]:
    """The backend class for an entry-point name or a ``module:Class`` path.

    Raises :class:`UnknownBackendError` for a name nobody registered or a path whose module
    or class does not exist, and :class:`BackendUnavailableError` (with the reason) for a
    backend that cannot run here (including one whose module fails to import a
    dependency).
    """
    if ":" in name:
        target = name
    else:
        matches = [ep for ep in _entry_points() if ep.name == name]
        if not matches:
            known = ", ".join(sorted({ep.name for ep in _entry_points()})) or "none"
            raise UnknownBackendError(f"unknown backend {name!r}; registered: {known}")
        target = matches[0].value
    try:
        cls = _load_target(target)
    except UnknownBackendError:
        raise
    except (ModuleNotFoundError, AttributeError) as exc:
        if ":" in name and _names_missing_target(exc, target):
            # The user's own path names something that does not exist: a usage error.
            raise UnknownBackendError(f"backend path {target!r} does not resolve: {exc}") from exc
        raise BackendUnavailableError(f"backend {name!r} ({target}) cannot load: {exc}") from exc
    except Exception as exc:
        raise BackendUnavailableError(f"backend {name!r} ({target}) cannot load: {exc}") from exc
    try:
        reason = cls.unavailable_reason()
    except Exception as exc:  # a plugin's check that raises: its fault, named as such
        raise BackendUnavailableError(
            f"backend {name!r} ({target}): its unavailable_reason() raised {exc!r}"
        ) from exc
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable here: {reason}")
    return cls


def create(name: str, *, page_bytes: int, capacity_pages: int, **options: Any) -> Backend:
    """Resolve ``name`` and construct it (not yet opened): see :func:`construct`."""
    cls = resolve(name)
    return construct(cls, page_bytes=page_bytes, capacity_pages=capacity_pages, **options)


def construct(cls: type[Backend], **kwargs: Any) -> Backend:
    """``cls(**kwargs)``. kvtier's own errors (a bad option named as a
    :class:`ConfigError`) and ``TypeError`` (an unknown or missing option) pass as they
    are; anything else the constructor raises (a plugin that connects in its constructor
    and fails) becomes a :class:`BackendUnavailableError` naming the class, not a bare
    exception from inside it."""
    try:
        return cls(**kwargs)
    except (KVTierError, TypeError):
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {cls.__module__}:{cls.__qualname__} could not be created: its "
            f"constructor raised {exc!r}"
        ) from exc
