"""The backend contract: what every tier implementation provides.

Two kinds of backend sit behind a tier:

* **arenas** (:class:`ArenaBackend`) hold pages in slots of one preallocated buffer (GPU
  HBM, host DRAM) and expose each slot without copying;
* **stores** (:class:`StoreBackend`) map keys to blobs (NVMe, a remote pool).

Both speak the same keyed, batch-first, async interface, so the pipeline moves pages
between any two tiers the same way. The rules every backend keeps (and that
:mod:`kvtier.testing` checks):

1. **Batches with per-item results.** Every call takes a sequence and answers item by item;
   a failure of one item (no room, I/O error, checksum mismatch) is a ``False``/``None`` for
   that item, never an exception. Exceptions are for caller mistakes only (a buffer of the
   wrong size or dtype: :class:`~kvtier.errors.KVTierUsageError`) and for calling a closed
   backend.
2. **Two-phase put.** :meth:`Backend.reserve` takes space, :meth:`Backend.write` fills it,
   :meth:`Backend.commit` publishes it. Until commit a key is invisible to :meth:`get`,
   :meth:`contains`, :meth:`exists` and :meth:`keys`; :meth:`abort` gives the space back.
   Putting a key that is already committed is a successful no-op (keys are content
   addresses: equal keys mean equal bytes).
3. **No policy inside.** A backend never evicts on its own to make room (a remote server
   that drops keys by itself is the exception callers must tolerate: such keys become
   misses). ``reserve`` answers ``None`` when full; the tier above decides what to evict.
4. **Never blocks the event loop.** Blocking work runs on the backend's executor, batched:
   one hop per call, not per page.
5. **Never serves wrong bytes.** A read that cannot be verified is a miss.

Buffers are 1-D, C-contiguous ``numpy.uint8`` arrays of exactly ``page_bytes`` bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import numpy as np

from kvtier.aio import finish_even_if_cancelled, gather_to_the_end
from kvtier.buffers import check_blobs as check_blobs
from kvtier.buffers import check_buffer as check_buffer
from kvtier.buffers import check_buffers as check_buffers
from kvtier.errors import KVTierError, KVTierUsageError
from kvtier.keys import PageKey

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
J = TypeVar("J")
R = TypeVar("R")

#: Below this many bytes of pages a batch of blocking work takes one executor hop
#: (:meth:`Backend.run_blocking_chunks`); above it, one chunk per I/O thread.
CHUNK_MIN_BYTES = 1 << 20


class BackendKind(StrEnum):
    """The two kinds of backend."""

    ARENA = "arena"
    STORE = "store"


class Medium(StrEnum):
    """Where a backend's bytes live; links are chosen per (source, destination) medium.

    ``host`` and ``device`` are memory (arenas), ``file`` a local file system or block
    device, ``network`` a remote server. A backend that says nothing is ``host`` (an
    arena) or ``store`` (a store of unknown kind).
    """

    HOST = "host"
    DEVICE = "device"
    FILE = "file"
    NETWORK = "network"
    STORE = "store"


@dataclass(frozen=True)
class Reservation:
    """Space taken by :meth:`Backend.reserve` for one key, not yet visible.

    Attributes:
        key: the page key.
        handle: backend-specific location (an arena slot, a store slot id, ...).
        present: the key was already committed; write and commit are no-ops for it.
        view: for arenas, a writable zero-copy view of the slot, so a producer may fill
            it in place and pass it back to :meth:`Backend.write` (which then skips the
            copy).
    """

    key: PageKey
    handle: int
    present: bool = False
    view: np.ndarray | None = None


@dataclass(frozen=True)
class Preflight:
    """What :meth:`Backend.preflight` found, without creating or changing anything.

    Attributes:
        note: what was found, in words (``.kvtier-cache/vllm will be created``, ``holds
            12 pages of 2097152 bytes``).
        page_size_conflict: when the store holds pages of another size than the
            backend's ``page_bytes``, the error opening it would raise, else ``None``. It
            is the one finding that depends on the model rather than on the store, so a
            caller that does not know the model (a configuration checked without one)
            may report it instead of failing.
    """

    note: str
    page_size_conflict: str | None = None


class BackendClosedError(KVTierError):
    """A backend was used before :meth:`Backend.open` or after :meth:`Backend.close`."""


class Backend(ABC):
    """Base of every tier backend. See the module docstring for the contract.

    Subclasses take ``page_bytes`` and ``capacity_pages`` plus their own keyword options,
    and must reject unknown options with :class:`~kvtier.errors.ConfigError` (the base
    constructor does this for whatever reaches it).
    """

    #: Arena or store.
    kind: ClassVar[BackendKind]
    #: Where the bytes live (links are registered per medium pair).
    medium: ClassVar[Medium]
    #: Default number of worker threads for blocking work.
    default_io_threads: ClassVar[int] = 4
    #: Other processes may commit pages here behind this process's back (a remote pool
    #: shared by many servers): lookups then ask the backend about pages the local
    #: directory does not know yet.
    shared: ClassVar[bool] = False
    #: ``get`` returns or raises, cancelled too, only once nothing it started writes the
    #: caller's buffers: the cache then awaits it directly, without a task per read.
    get_finishes_before_raising: ClassVar[bool] = False

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        **options: Any,
    ) -> None:
        from kvtier.errors import ConfigError

        if options:
            raise ConfigError(
                f"{type(self).__name__}: unknown option(s) {', '.join(sorted(options))}"
            )
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise KVTierUsageError(f"page_bytes must be a positive integer, got {page_bytes!r}")
        if (
            isinstance(capacity_pages, bool)
            or not isinstance(capacity_pages, int)
            or capacity_pages < 1
        ):
            raise KVTierUsageError(
                f"{type(self).__name__}: capacity must hold at least one page "
                f"({page_bytes} bytes), got {capacity_pages!r} pages"
            )
        threads = self.default_io_threads if io_threads is None else io_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ConfigError(
                f"{type(self).__name__}: io_threads must be an integer >= 1 (at most 1024), "
                f"got {threads!r}"
            )
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_pages
        self.io_threads = threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._opened = False

    # -- discovery ---------------------------------------------------------------------

    @classmethod
    def page_footprint(cls, page_bytes: int) -> int:
        """Bytes of a tier's capacity one page of ``page_bytes`` takes in this backend:
        ``page_bytes`` here (an arena's slot); a backend whose pages take more (a header,
        alignment: the ``nvme`` slots) overrides it, or its tiers outgrow their capacity.
        Must be cheap and must not open anything."""
        return page_bytes

    @classmethod
    def capacity_pages_for(cls, capacity_bytes: int, page_bytes: int) -> int:
        """Pages a tier of ``capacity_bytes`` holds (``create_backend`` builds tiers so);
        a footprint below the page is the backend's fault, named (:class:`KVTierError`)."""
        room = cls.page_footprint(page_bytes)
        if isinstance(room, bool) or not isinstance(room, int) or room < page_bytes:
            raise KVTierError(
                f"{cls.__name__}.page_footprint({page_bytes}) gave {room!r}: a backend bug "
                f"(it must be an int >= the page, {page_bytes})"
            )
        return capacity_bytes // room

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or ``None`` when it can.

        Must be cheap and must not raise: discovery calls it for every backend.
        """
        return None

    def preflight(self) -> Preflight | None:
        """Check what :meth:`open` would find, creating and changing nothing; call it on
        a backend that is not open (it may block: run it off the event loop).

        ``None`` (this default): the backend has no such check, and ``kvtier inspect
        config --check`` opens it and stores, reads back and deletes a probe page
        instead. A persistent store overrides it, so that checking a configuration
        never creates or modifies the store (the built-in ``file`` and ``nvme`` stores
        do). Raises an exception naming what would make :meth:`open` fail (a directory
        that cannot be created, a path that is not a store, a store open elsewhere),
        except a store of another page size: see :attr:`Preflight.page_size_conflict`.
        """
        return None

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Acquire resources (memory, files, connections). Idempotent."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.io_threads,
                thread_name_prefix=f"kvtier-{type(self).__name__}",
                initializer=self._thread_initializer(),
            )
        self._opened = True

    def _thread_initializer(self) -> Callable[[], None] | None:
        """A function each worker thread runs first (e.g. pinning it to the NUMA node of
        the memory it copies); ``None`` for none. Subclasses override."""
        return None

    async def close(self) -> None:
        """Release resources. Committed pages of persistent backends stay. Idempotent."""
        self._opened = False
        executor, self._executor = self._executor, None
        if executor is not None:
            # Wait for in-flight copies without blocking the event loop.
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if not self._opened:
            raise BackendClosedError(f"{type(self).__name__} is not open")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on this backend's executor and await the result; cancelled,
        raise only once ``fn`` has returned (it may still use the caller's buffers).
        Callers batch: one hop per batch of pages, never one per page."""
        self._check_open()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, functools.partial(fn, *args))
        return await finish_even_if_cancelled(fut)

    async def run_blocking_chunks(
        self, fn: Callable[[list[J]], list[R]], jobs: list[J], min_bytes: int = CHUNK_MIN_BYTES
    ) -> list[R]:
        """Run ``fn`` over ``jobs`` (about one page each) on this backend's executor: one
        hop for a batch under ``min_bytes`` of pages, else contiguous chunks, one per I/O
        thread (at most one per core), run at once. Results keep job order. When a chunk
        raises (or the caller is cancelled), it raises only once every chunk's thread has
        returned: none still reads or writes the jobs' buffers."""
        parts = min(self.io_threads, os.cpu_count() or 1, len(jobs))
        if parts <= 1 or len(jobs) * self.page_bytes < min_bytes:
            return await self.run_blocking(fn, jobs)
        self._check_open()
        loop = asyncio.get_running_loop()
        size = -(-len(jobs) // parts)
        chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        futs = [loop.run_in_executor(self._executor, functools.partial(fn, c)) for c in chunks]
        # when a chunk fails (or the caller is cancelled) the other chunks' threads still
        # read or write the caller's buffers (a DRAM slot, in a load): raise only once
        # they stopped, so none writes into a buffer reused meanwhile
        done = await gather_to_the_end(futs)
        return [r for chunk in done for r in chunk]

    # -- the keyed, two-phase interface ------------------------------------------------

    @abstractmethod
    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """Take space for each key; ``None`` for a key that gets no space (full, error).

        ``namespace`` is the :attr:`kvtier.keys.Namespace.label` of the pages, recorded by
        stores for inspection (keys already carry the namespace digest).
        """

    @abstractmethod
    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Fill reserved space with page bytes; ``False`` where a write failed."""

    @abstractmethod
    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Publish written pages; after ``True`` they are durable (per the backend) and
        visible. ``False`` where commit failed: that space is released."""

    @abstractmethod
    async def abort(self, reservations: Sequence[Reservation]) -> None:
        """Release reservations that will not be committed."""

    @abstractmethod
    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read each committed page into ``out[i]``; ``False`` for a miss (absent,
        unreadable or failing verification: then ``out[i]`` holds unspecified bytes)."""

    @abstractmethod
    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """Which keys are committed here."""

    @abstractmethod
    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed keys; ``True`` where a key was committed and is now gone.
        A key that is only reserved (another writer's page in flight) answers ``False``
        and its reservation is left alone: its write and commit still succeed."""

    @abstractmethod
    async def keys(self) -> list[PageKey]:
        """Every committed key (for recovery and inspection; may be slow on stores)."""

    @abstractmethod
    def used_pages(self) -> int:
        """Pages committed or reserved here (what counts against capacity)."""

    async def exists(self, keys: Sequence[PageKey]) -> int:
        """How many leading keys are committed (the length of the cached prefix)."""
        found = await self.contains(keys)
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one call; ``True`` where the page is now committed."""
        bufs = check_buffers(data, len(keys), self.page_bytes)
        reservations = await self.reserve(keys, namespace)
        ok = [False] * len(keys)
        taken = [(i, r) for i, r in enumerate(reservations) if r is not None]
        if not taken:
            return ok
        try:
            written = await self.write([r for _, r in taken], [bufs[i] for i, _ in taken])
        except BaseException:  # cancelled or failed before any commit: give the space back
            await asyncio.shield(self.abort([r for _, r in taken]))
            raise
        to_commit = [(i, r) for (i, r), w in zip(taken, written, strict=True) if w]
        failed = [r for (_, r), w in zip(taken, written, strict=True) if not w]
        if failed:
            await self.abort(failed)
        if to_commit:
            committed = await self.commit([r for _, r in to_commit])
            for (i, _), c in zip(to_commit, committed, strict=True):
                ok[i] = c
        return ok

    def stats(self) -> dict[str, Any]:
        """Backend-specific counters (capacity, use, errors) as plain data."""
        return {
            "kind": str(self.kind),
            "page_bytes": self.page_bytes,
            "capacity_pages": self.capacity_pages,
            "used_pages": self.used_pages(),
        }


class ArenaBackend(Backend):
    """A memory arena: ``capacity_pages`` slots in one preallocated buffer.

    Adds zero-copy access to slots. A slot id is stable while its key stays committed.
    """

    kind: ClassVar[BackendKind] = BackendKind.ARENA
    medium: ClassVar[Medium] = Medium.HOST
    #: Whether :meth:`view` gives a numpy view of a slot. An arena in device memory (the
    #: ``hbm`` backend) sets it false: its :meth:`view` raises, and callers that want a
    #: page's bytes on the host read it with :meth:`get` instead.
    host_addressable: ClassVar[bool] = True

    @abstractmethod
    def slot_of(self, key: PageKey) -> int | None:
        """The slot of a committed key, or ``None``."""

    @abstractmethod
    def view(self, slot: int) -> np.ndarray:
        """Zero-copy uint8 view of one slot (``page_bytes`` long)."""

    def tensor(self, slot: int) -> torch.Tensor:
        """Zero-copy torch uint8 tensor over one slot."""
        import torch

        return torch.from_numpy(self.view(slot))


class StoreBackend(Backend):
    """A key -> blob store (NVMe, remote pool).

    **Variable-length blobs (optional).** A store whose :attr:`variable_length` is true
    also keeps blobs shorter than ``page_bytes``: :meth:`write_blobs` takes them (1 to
    ``page_bytes`` bytes each) in place of :meth:`write`, and :meth:`get_sized` reads them
    back with their length. Its page header records that length and its checksum covers
    exactly those bytes; plain :meth:`get` still serves only whole ``page_bytes`` pages (a
    shorter blob is a miss there). A codec-wrapped tier (:mod:`kvtier.codec.store`) uses
    this to move and keep only a compressed page's bytes.
    """

    kind: ClassVar[BackendKind] = BackendKind.STORE
    medium: ClassVar[Medium] = Medium.STORE

    #: Whether :meth:`write_blobs` / :meth:`get_sized` keep blobs shorter than a page.
    variable_length: ClassVar[bool] = False

    async def write_blobs(
        self, reservations: Sequence[Reservation], blobs: Sequence[Any]
    ) -> list[bool]:
        """Like :meth:`write`, for blobs of 1 to ``page_bytes`` bytes on a store with
        :attr:`variable_length`; other stores take only whole pages (:meth:`write`)."""
        if not self.variable_length:
            return await self.write(reservations, blobs)
        raise NotImplementedError(f"{type(self).__name__} declares variable_length "
                                  "but does not implement write_blobs")  # fmt: skip

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        """Read each committed blob into the start of ``out[i]`` (``page_bytes`` long);
        its length, or ``None`` for a miss. Stores without :attr:`variable_length` hold
        whole pages only, so a hit is ``page_bytes``."""
        got = await self.get(keys, out)
        return [self.page_bytes if hit else None for hit in got]
