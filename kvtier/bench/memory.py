"""Whether a benchmark's pages fit in memory, checked before any is allocated: a run that
would need more than the machine has is a usage error naming the flags to lower, not a
``MemoryError`` from deep inside numpy."""

from __future__ import annotations

from kvtier.errors import KVTierUsageError


def require_memory(command: str, pages: int, page_bytes: int, copies: int, lower: str) -> None:
    """Raise :class:`KVTierUsageError` when ``copies`` times ``pages`` pages of
    ``page_bytes`` exceed the memory available now (``MemAvailable``; no check where the
    kernel does not say). ``lower`` names the flags that shrink the run."""
    from kvtier.backends.dram import available_memory
    from kvtier.config import format_size

    need = copies * pages * page_bytes
    have = available_memory()
    if have is not None and need > have:
        raise KVTierUsageError(
            f"{command}: {pages} pages of {format_size(page_bytes)} need about "
            f"{format_size(need)} of memory ({copies}x their size while the bench runs); "
            f"{format_size(have)} is available: lower {lower}"
        )
