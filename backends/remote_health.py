"""Moved: outage tracking for remote stores lives in :mod:`kvtier.health` (public, for
plugins too). Re-exported here so that older imports keep working."""

from kvtier.health import MAX_BACKOFF, REFUSAL_QUIET_S, Health

__all__ = ["MAX_BACKOFF", "REFUSAL_QUIET_S", "Health"]
