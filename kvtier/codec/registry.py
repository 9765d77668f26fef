"""Finding codecs: the ``kvtier.codecs`` entry-point group and ``module:Class`` paths.

Built-in codecs (``none``, ``zstd``, ``lz4``, ``fp8-e4m3``) register through the same
group a plugin uses (see ``pyproject.toml``)::

    [project.entry-points."kvtier.codecs"]
    my-codec = "my_package.codec:MyCodec"

:func:`discover` never raises (a codec whose module fails to import, or whose
:meth:`~kvtier.codec.base.Codec.unavailable_reason` gives a reason, is listed unavailable);
:func:`make_codec` raises :class:`~kvtier.errors.ConfigError` naming an unknown or
unavailable codec, or a bad parameter.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.codec.base import Codec
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec

ENTRY_POINT_GROUP = "kvtier.codecs"
#: The codec name meaning "no codec": the tier's store is used as is.
NO_CODEC = "none"


@dataclass(frozen=True)
class CodecInfo:
    """What discovery knows of one codec: name, ``module:Class`` target, where it came
    from, whether it is lossy, and whether it can run here (with the reason if not)."""

    name: str
    target: str
    origin: str
    lossy: bool | None
    available: bool
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """One per name: kvtier's own wins a name registered twice, with a warning
    (:func:`kvtier.registry.unique_entry_points`)."""
    from kvtier.registry import unique_entry_points

    return unique_entry_points(ENTRY_POINT_GROUP, "codec")


def _load(target: str) -> type[Codec]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"codec path {target!r} is not of the form 'module:Class'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Codec)):
        raise ConfigError(f"{target!r} is not a kvtier Codec subclass")
    return obj


def _describe(name: str, target: str, origin: str) -> CodecInfo:
    try:
        cls = _load(target)
    except Exception as exc:  # discovery survives any plugin failure
        return CodecInfo(name, target, origin, None, False, f"cannot load: {exc!r}")
    try:
        reason = cls.unavailable_reason()
    except Exception as exc:
        reason = f"availability check failed: {exc!r}"
    return CodecInfo(name, target, origin, cls.lossy, reason is None, reason)


def registered_names() -> set[str]:
    """The names codecs are registered under (nothing is imported)."""
    try:
        return {ep.name for ep in _entry_points()}
    except Exception:
        return set()


def discover() -> list[CodecInfo]:
    """Every codec registered in the entry-point group, sorted by name. Never raises."""
    infos: dict[str, CodecInfo] = {}
    try:
        eps = _entry_points()
    except Exception:
        return []
    for ep in eps:
        if ep.name not in infos:  # one per name (the built-in wins)
            dist = ep.dist
            origin = "entry point" if dist is None else (
                f"entry point ({dist.metadata['Name']} {dist.version})"
            )  # fmt: skip
            infos[ep.name] = _describe(ep.name, ep.value, origin)
    return list(infos.values())


def resolve(name: str) -> type[Codec]:
    """The codec class for an entry-point name or a ``module:Class`` path.

    Raises :class:`ConfigError` naming the codec when nobody registered it, its module
    cannot load, or it cannot run here.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"codec must be a non-empty string, got {name!r}")
    if ":" in name:
        target = name
    else:
        matches = [ep for ep in _entry_points() if ep.name == name]
        if not matches:
            known = ", ".join(sorted({ep.name for ep in _entry_points()})) or "none"
            raise ConfigError(f"unknown codec {name!r}; registered: {known}")
        target = matches[0].value
    try:
        cls = _load(target)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"codec {name!r} ({target}) cannot load: {exc}") from exc
    try:
        reason = cls.unavailable_reason()
    except Exception as exc:  # a plugin's check that fails is its bug, named as such
        raise ConfigError(
            f"codec {name!r} ({target}): its availability check raised {exc!r}"
        ) from exc
    if reason is not None:
        raise ConfigError(f"codec {name!r} is unavailable here: {reason}")
    return cls


def make_codec(name: str, spec: KVSpec, **params: Any) -> Codec:
    """Resolve ``name`` and build it for ``spec`` with ``params``; :class:`ConfigError`
    names an unknown codec or a bad parameter."""
    cls = resolve(name)
    try:
        codec = cls(spec, **params)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: bad parameters: {exc}") from None
    except Exception as exc:  # a plugin's constructor bug: named, not "a kvtier bug"
        raise ConfigError(f"codec {name!r}: its constructor raised {exc!r}") from exc
    try:
        most = codec.max_encoded_bytes()
    except Exception as exc:
        raise ConfigError(f"codec {name!r}: max_encoded_bytes() raised {exc!r}") from exc
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        raise ConfigError(
            f"codec {name!r}: max_encoded_bytes() gave {most!r}, not a number of bytes "
            "(an int >= 0): a bug of the codec"
        )
    return codec
