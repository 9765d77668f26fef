"""The NVMe store's foundation: options, open (recovery) and close, the slot book of the
slab files, and page I/O on the worker pool. :class:`NvmeStoreBase` holds it;
:class:`~kvtier.backends.nvme.NvmeStore` adds the keyed, two-phase interface (see its
module for the guarantees).
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from kvtier.backends.nvme_engines import (
    ENGINES,
    IoEngine,
    kvikio_unavailable_reason,
)
from kvtier.backends.nvme_index import PageRow, StoreIndex, StoreLock
from kvtier.backends.nvme_layout import SlotLayout
from kvtier.backends.nvme_open import OpenedStore, open_store
from kvtier.backends.nvme_preflight import check_first_slab_room, preflight_store
from kvtier.backends.nvme_slabs import SlabFiles, slab_path
from kvtier.backends.store_files import Modes, check_path_text, describe_os_error, free_space

from kvtier.aio import finish_even_if_cancelled
from kvtier.backend import BackendClosedError, Medium, Preflight, StoreBackend
from kvtier.errors import BackendUnavailableError, ConfigError, KVTierUsageError, TierIOError
from kvtier.health import LogOnce
from kvtier.keys import KEY_BYTES
from kvtier.log import get_logger
from kvtier.slots import FreeSlots


def log() -> Any:
    """The module logger, looked up per use: a logger bound at import time would keep the
    logging configuration of that moment, not the one the application sets later."""
    return get_logger("kvtier.backends.nvme")


EngineName = Literal["posix", "kvikio", "auto"]
DEFAULT_SLAB_BYTES = 1 << 30
CHECKSUM_AT = struct.Struct("<Q")  # payload checksum at byte 16 of the header


@dataclass
class Pending:
    """A reserved slot: whose page it will hold and whether its bytes are written."""

    key: bytes
    namespace: str
    written: bool = False
    checksum: int = 0


def check_key(key: Any, i: int) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise KVTierUsageError(
            f"key {i} must be {KEY_BYTES} bytes, got {type(key).__name__} "
            f"of length {len(key) if isinstance(key, bytes) else '?'}"
        )
    return key


T = TypeVar("T")
R = TypeVar("R")


def split(items: Sequence[T], parts: int) -> list[list[T]]:
    """``items`` cut into at most ``parts`` contiguous, non-empty chunks."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out: list[list[T]] = []
    start = 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def cause(exc: BaseException) -> str:
    """A short name for an error's cause, for log-once de-duplication."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def slab_failure(
    root: os.PathLike[str], failed: dict[int, BaseException], pages: int
) -> TierIOError:
    """The error :meth:`NvmeStore.reserve` raises when slab files could not be allocated
    (``failed``: slab -> the ``OSError``): the medium failed (full file system, read-only
    directory, I/O error), not the store's capacity, so the tier is marked failing rather
    than answering "full". Names the slab file, the OS error and the free space."""
    slab, exc = min(failed.items())
    reason = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
    more = f" (and {len(failed) - 1} more slabs)" if len(failed) > 1 else ""
    space = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    why = "the file system refused the space" if space else "its slab file could not be made"
    return TierIOError(
        f"NVMe store {root}: cannot allocate slab file {slab_path(Path(root), slab)}{more}: "
        f"{reason}; the file system has {free_space(root)}; none of the {pages} pages of "
        f"this reserve got a slot (the store is below its capacity: {why}, the store is "
        "not full)"
    )


def commit_failure(root: os.PathLike[str], exc: BaseException, pages: int) -> TierIOError:
    """The error :meth:`NvmeStore.commit` raises when the index transaction failed (its
    pages are not committed, their slots free again): names the error and the free
    space, so that a full file system marks the tier failing instead of looking full."""
    return TierIOError(
        f"NVMe store {root}: committing to the index failed: {exc}; the file system has "
        f"{free_space(root)}; {pages} pages of this commit were not stored"
    )


class NvmeStoreBase(StoreBackend):
    """Options, lifecycle (open with recovery, close), slots and page I/O on the worker
    pool of :class:`~kvtier.backends.nvme.NvmeStore`, which adds the keyed interface."""

    medium: ClassVar[Medium] = Medium.FILE

    default_io_threads: ClassVar[int] = 8

    @classmethod
    def page_footprint(cls, page_bytes: int) -> int:
        """The slot a page takes on disk: its payload, a 64-byte header and the padding
        to 4 KiB (:class:`~kvtier.backends.nvme_layout.SlotLayout`; a 512-byte page takes
        4 KiB, a 2 MiB page 2 MiB + 4 KiB). With the last slab cut to the slots left
        (:meth:`_slab_target`), a tier never takes more disk than its capacity."""
        return SlotLayout(page_bytes, 1).slot_bytes

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        path: str | os.PathLike[str] | None = None,
        engine: str = "auto",
        direct_io: bool | str = "auto",
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        preallocate: bool = True,
        io_threads: int | None = None,
        group_access: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads, **options
        )
        if path is None or str(path) == "":
            raise ConfigError("nvme: option 'path' (the store directory) is required")
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"nvme: option 'path' must be a path, got {path!r}")
        if not isinstance(preallocate, bool):
            raise ConfigError(
                f"nvme: option 'preallocate' must be true or false, got {preallocate!r}"
            )
        self._modes = Modes.for_option(group_access, "nvme")
        if engine not in ("posix", "kvikio", "auto"):
            raise ConfigError(
                f"nvme: option 'engine' must be posix, kvikio or auto, got {engine!r}"
            )
        if direct_io not in (True, False, "auto"):
            raise ConfigError(
                f"nvme: option 'direct_io' must be true, false or 'auto', got {direct_io!r}"
            )
        if isinstance(slab_bytes, bool) or not isinstance(slab_bytes, int) or slab_bytes <= 0:
            raise ConfigError(
                f"nvme: option 'slab_bytes' must be a positive integer, got {slab_bytes!r}"
            )
        if engine == "kvikio":
            reason = kvikio_unavailable_reason()
            if reason is not None:
                raise BackendUnavailableError(f"nvme engine 'kvikio' is unavailable here: {reason}")
        self.path = check_path_text(path, "nvme: option 'path'")
        self.engine_name: str = (
            engine
            if engine != "auto"
            else ("kvikio" if kvikio_unavailable_reason() is None else "posix")
        )
        self._direct_opt = direct_io
        self._slab_opt = slab_bytes
        self._preallocate = preallocate
        self._reset_state()

    def _reset_state(self) -> None:
        self._lock: StoreLock | None = None
        self._index: StoreIndex | None = None
        self._slabs: SlabFiles | None = None
        self._engine: IoEngine | None = None
        self.layout: SlotLayout | None = None
        self.direct = False
        self.direct_reason: str | None = None
        self._entries: dict[bytes, PageRow] = {}
        self._reserved: dict[int, Pending] = {}
        self._quarantined: dict[int, str] = {}
        self._slots = FreeSlots(lowest_first=True, next_new=0)  # slots of the slab files
        self._slab_slots: dict[int, int] = {}  # slab -> slots its file holds
        self._slab_lock = asyncio.Lock()
        self._committing: dict[int, Pending] = {}  # rows on their way into the index
        self._undeleted: set[int] = set()  # slots whose delete never reached the index
        self._accessed: dict[bytes, float] = {}
        self._commit_queue: list[
            tuple[list[tuple[int, Pending]], asyncio.Future[dict[int, bool]]]
        ] = []
        self._commit_task: asyncio.Task[None] | None = None
        #: slot -> why its group commit failed, until its committer takes it
        self._commit_errors: dict[int, BaseException] = {}
        self._logged = LogOnce()
        self._counters: Counter[str] = Counter()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self.recovery_seconds = 0.0
        self.recovered_pages = 0
        self.rebuilt_index = False
        self.dropped_index_rows = 0

    # -- lifecycle ---------------------------------------------------------------------

    def preflight(self) -> Preflight:
        """What :meth:`open` would find, creating, locking and changing nothing
        (:func:`~kvtier.backends.nvme_preflight.preflight_store`): raises what open would
        raise, except for a store holding pages of another size
        (:attr:`~kvtier.backend.Preflight.page_size_conflict`), and refuses a new store
        whose first preallocated slab cannot fit the file system (every write would fail)."""
        found = preflight_store(self.path, self.page_bytes)
        if self._preallocate:
            first = SlotLayout.for_page(self.page_bytes, self._slab_opt, self.capacity_pages)
            check_first_slab_room(self.path, first.slab_bytes)
        return found

    async def open(self) -> None:
        """Open (creating or recovering) the store. Idempotent.

        Raises :class:`~kvtier.backends.nvme_index.NotAStoreError` (path is not a store),
        :class:`~kvtier.backends.nvme_index.StoreVersionError` (newer format),
        :class:`~kvtier.backends.nvme_index.StoreLockedError` (opened elsewhere),
        :class:`~kvtier.backends.nvme_index.StoreReadOnlyError` (cannot write),
        :class:`ConfigError` (the store holds pages of another size, O_DIRECT required
        but unsupported). A store that holds no page but was made for another page size
        is re-initialised for this one, with a warning (``nvme.page_size_reset``).
        """
        if self._opened:
            return
        await super().open()
        try:
            await self.run_blocking(self._open_blocking)
        except BaseException:
            await super().close()  # waits for the open's thread, even when cancelled
            # Release what that thread took all the same (a cancelled open's lock).
            await asyncio.get_running_loop().run_in_executor(None, self._close_blocking, {})
            self._reset_state()
            raise

    def _open_blocking(self) -> None:
        start = time.perf_counter()
        opened = open_store(
            self.path,
            page_bytes=self.page_bytes,
            slab_bytes=self._slab_opt,
            capacity_pages=self.capacity_pages,
            engine=self.engine_name,
            direct_io=self._direct_opt,
            modes=self._modes,
        )
        try:
            engine = ENGINES[self.engine_name](opened.layout, opened.slabs)
        except BaseException:
            opened.close()
            raise
        self._lock, self._index, self._slabs, self._engine = (
            opened.lock,
            opened.index,
            opened.slabs,
            engine,
        )
        self.layout = opened.layout
        self.direct, self.direct_reason = opened.direct, opened.direct_reason
        self._recover(opened)
        self.recovery_seconds = time.perf_counter() - start

    def _recover(self, opened: OpenedStore) -> None:
        """Take the checked rows, quarantine and free slots :func:`open_store` found."""
        self._entries = {r.key: r for r in opened.rows}
        self._quarantined = dict(opened.quarantined)
        self._slots = FreeSlots(opened.free, lowest_first=True, next_new=opened.hwm)
        self._slab_slots = dict(opened.slab_slots)
        self.recovered_pages = len(opened.rows)
        self.rebuilt_index = opened.rebuilt is not None
        self.dropped_index_rows = opened.dropped_rows

    async def close(self) -> None:
        """Wait for calls in flight and pending commits, drop uncommitted reservations,
        release the store. Calls made once closing has begun raise
        :class:`~kvtier.backend.BackendClosedError`. A close cancelled while it waits
        leaves the store open (and closable again)."""
        if not self._opened or self._closing:
            return
        self._closing = True
        try:
            await self._idle.wait()
            if self._commit_task is not None:
                await asyncio.shield(self._commit_task)
        except BaseException:
            self._closing = False  # cancelled before anything was released: still open
            raise
        self._reserved.clear()
        accessed, self._accessed = self._accessed, {}
        try:
            await self.run_blocking(self._close_blocking, accessed)
        finally:
            await super().close()
            self._reset_state()

    def _close_blocking(self, accessed: dict[bytes, float]) -> None:
        try:
            if self._index is not None and accessed:
                self._index.touch(accessed)
        except Exception as exc:  # access times are advisory
            log().warning("nvme.touch_failed", path=str(self.path), error=str(exc))
        if self._engine is not None:
            self._engine.close()
        if self._slabs is not None:
            self._slabs.close()
        if self._index is not None:
            self._index.close()
        if self._lock is not None:
            self._lock.release()

    # -- helpers -----------------------------------------------------------------------

    def _enter(self) -> None:
        """Start a call: refused once closing began; :meth:`close` waits for it."""
        self._check_open()
        if self._closing:
            raise BackendClosedError(f"NvmeStore {self.path} is closing")
        self._active += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._active -= 1
        if not self._active:
            self._idle.set()

    def _log_once(self, cause: str, event: str, **fields: Any) -> None:
        """Log an error the first time its cause is seen (counted every time)."""
        self._counters[f"errors.{event}"] += 1
        if self._logged.first(cause):
            log().error(event, path=str(self.path), cause=cause, **fields)

    def _alloc_slot(self) -> int:
        slot = self._slots.take()
        assert slot is not None  # a growing space always has one
        return slot

    def _free_slot(self, slot: int) -> None:
        self._slots.release(slot)

    async def _slot_io(
        self,
        fn: Callable[[list[T]], R],
        groups: list[list[T]],
        slots: Sequence[int],
        finish_if_cancelled: bool = False,
    ) -> list[R]:
        """Run ``fn`` on each group on the worker pool, with ``slots`` busy until every
        thread is done.

        A worker thread cannot be stopped: when the caller is cancelled its page I/O runs
        on, so the slots stay busy (a slot freed meanwhile is handed out only after that
        I/O ends) and :meth:`close` waits for it, not just for the caller. With
        ``finish_if_cancelled`` (reads: the threads write the caller's buffers) a
        cancelled call raises only once every group's thread has returned.
        """
        self._slots.begin_io(slots)
        self._active += 1
        self._idle.clear()
        # return_exceptions: the gather ends only when every group's thread has returned,
        # also when one group raised (a plain gather ends at the first exception, and the
        # slots would be freed while the other threads still read or write them)
        io = asyncio.gather(*(self.run_blocking(fn, g) for g in groups), return_exceptions=True)

        def done(fut: asyncio.Future[list[Any]]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved, for when the caller is gone
            self._slots.end_io(slots)
            self._exit()

        io.add_done_callback(done)
        # reads: the threads write the caller's buffers, so a cancelled read waits for them
        wait = finish_even_if_cancelled(io) if finish_if_cancelled else asyncio.shield(io)
        results = await wait
        out: list[R] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            out.append(r)
        return out

    def _release(self, slot: int) -> None:
        if self._reserved.pop(slot, None) is not None:
            self._free_slot(slot)

    def _slab_target(self, slab: int, within: int) -> int:
        """Slots slab ``slab`` should hold for a slot ``within`` it: the whole slab, or
        for the last slab the store's capacity reaches only the slots left (at least
        ``within + 1``), so the slab files never take more than ``capacity_pages`` slots
        of disk. A slot past the capacity (a store reopened with less) still fits."""
        assert self.layout is not None
        per = self.layout.slots_per_slab
        left = self.capacity_pages - slab * per
        return min(per, max(within + 1, left))

    def _ensure_slabs(self, targets: dict[int, int]) -> dict[int, BaseException]:
        """Grow each slab of ``targets`` to hold that many slots (on a worker thread).
        Returns the slabs that could not grow, with the error."""
        assert self._slabs is not None
        failed: dict[int, BaseException] = {}
        for slab, slots in targets.items():
            try:
                self._slabs.ensure(slab, self._preallocate, slots)
            except OSError as exc:
                failed[slab] = exc
        return failed
