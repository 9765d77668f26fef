"""Exceptions raised by kvtier.

Every error a caller can act on derives from :class:`KVTierError`, and its message names
what was wrong (the offending key, value, shape or backend) so that the CLI can print it
as-is. Usage errors (bad input) derive from :class:`KVTierUsageError` and map to CLI exit
code 2; runtime failures map to exit code 1.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier exception."""


class KVTierUsageError(KVTierError, ValueError):
    """The caller passed something invalid (shape, dtype, size, name, config)."""


class ConfigError(KVTierUsageError):
    """A configuration key or value is unknown or invalid."""


class UnknownBackendError(KVTierUsageError):
    """A backend name or ``module:Class`` path does not resolve to a backend."""


class BackendUnavailableError(KVTierError):
    """A backend exists but cannot run on this machine (no GPU, missing package)."""


class CapacityError(KVTierError):
    """A tier cannot make room: too small for one page, or every page is pinned."""


class TierIOError(KVTierError):
    """A tier failed to move bytes. Callers treat the affected pages as misses."""


class IntegrityError(KVTierError):
    """Bytes read back do not match the checksum they were written with."""


class TierOpenError(KVTierError):
    """A tier's backend could not open (``on_open_error = "fail"``); names the tier,
    its backend and the cause (also chained as ``__cause__``)."""

    def __init__(self, message: str, tier: str = "", backend: str = "") -> None:
        super().__init__(message)
        self.tier = tier
        self.backend = backend

    @classmethod
    def of(cls, tier: str, backend: str, exc: BaseException) -> TierOpenError:
        """The error for tier ``tier`` whose open raised ``exc``: a usage error when the
        cause is one (a path that is not a store...), else a failure."""
        kind = TierOpenUsageError if isinstance(exc, KVTierUsageError) else TierOpenError
        reason = str(exc) or type(exc).__name__
        return kind(f"tier {tier!r} (backend {backend!r}) cannot open: {reason}", tier, backend)


class TierOpenUsageError(TierOpenError, KVTierUsageError):
    """:class:`TierOpenError` caused by a usage error (e.g. a path that is not a store)."""
