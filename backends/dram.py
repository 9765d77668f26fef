"""The host DRAM tier: a preallocated arena of page slots in CPU memory.

The memory is one page-aligned anonymous ``mmap``, bound to ``numa_node`` (or the
``placement`` decision) *before* any page is faulted in, then locked in one of three ways,
chosen at :meth:`DramArena.open`:

* **pinned**: when a CUDA driver is present, registered with CUDA (``cudaHostRegister``,
  portable: usable from every GPU), so host<->device copies run at full PCIe speed. The
  registration faults every page in on the bound node; page-locked pages never migrate.
* **mlocked**: without CUDA (or when CUDA refuses the registration, which is logged once
  per process), ``mlock``-ed when the kernel allows it (``RLIMIT_MEMLOCK`` or
  ``CAP_IPC_LOCK``), which also faults every page in.
* **plain**: when ``mlock`` is refused too the arena still works, pre-faulted by touching
  every page so the first copy into a slot does not pay for page faults; the refusal is
  logged once per process.

:meth:`DramArena.stats` reports which of the three (``memory``) the arena got.

Slots are exposed without copying as numpy views (:meth:`DramArena.view`) and torch
tensors (:meth:`DramArena.tensor`) over the same bytes. Metadata (which slot holds which
key) lives on the event-loop thread; the executor only copies bytes, one hop per call, and
a large batch is split across the I/O threads so the copy runs on several cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import mmap
import os
import resource
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from kvtier.backends.dram_memory import (
    INLINE_COPY_MAX_BYTES,
    LOGGED,
    PARALLEL_COPY_MIN_BYTES,
    ArenaAllocationError,
    CopyPair,
    available_memory,
    copy_pairs,
    cuda_available,
    cuda_host_register,
    cuda_host_unregister,
    same_memory,
    size_text,
    split_pairs,
    try_mlock,
)

from kvtier.aio import gather_to_the_end
from kvtier.arena import SlotArena
from kvtier.backend import Reservation, check_buffers
from kvtier.cuda_streams import HostMapping
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.slots import SlotBook

if TYPE_CHECKING:
    import torch

    from kvtier.placement import HostPlacement

_log = logging.getLogger(__name__)

__all__ = [
    "INLINE_COPY_MAX_BYTES",
    "LOGGED",
    "PARALLEL_COPY_MIN_BYTES",
    "ArenaAllocationError",
    "DramArena",
    "available_memory",
    "cuda_host_register",
    "split_pairs",
    "try_mlock",
]


def _unregister(addr: int) -> None:
    """Undo the arena's CUDA registration (looked up at call time: tests replace it)."""
    cuda_host_unregister(addr)


class DramArena(SlotArena):
    """``capacity_pages`` slots of ``page_bytes`` in host memory (see module docstring).

    Options:
        numa_node: NUMA node the arena should live on (``None``: wherever the kernel puts
            it). Bound with ``mbind`` at :meth:`open` (see :meth:`_bind_memory`).
        placement: let :func:`kvtier.placement.plan_placement` decide from the machine's
            topology at :meth:`open`: ``auto`` (the node nearest ``gpu``, nothing on a
            one-node or GPU-less machine), ``local``, ``interleave`` or ``none``; with
            ``numa_node`` it binds there. The memory policy is applied before the pages
            are faulted in, the copy threads are pinned to the chosen node's CPUs, and the
            decision with its reason is logged and shown in ``stats()["placement"]``.
            ``None`` (default): only ``numa_node`` applies.
        gpu: the GPU index this arena serves (for ``placement``; default 0).
        io_threads: copy threads (default 4; a large batch is split across them).

    Not persistent: a closed arena loses its pages.
    """

    default_io_threads: ClassVar[int] = 4
    #: :meth:`_copy` waits for its copy threads when cancelled (a subclass overriding
    #: :meth:`get` must too, or set this ``False``).
    get_finishes_before_raising: ClassVar[bool] = True

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        numa_node: int | None = None,
        placement: str | None = None,
        gpu: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(
            page_bytes=page_bytes,
            capacity_pages=capacity_pages,
            io_threads=io_threads,
            **options,
        )
        if numa_node is not None and (
            isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < 0
        ):
            raise KVTierUsageError(
                f"numa_node must be a non-negative int or None, got {numa_node!r}"
            )
        if placement is not None and placement not in ("auto", "local", "interleave", "none"):
            raise KVTierUsageError(
                f"placement must be auto, local, interleave, none or None, got {placement!r}"
            )
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise KVTierUsageError(f"gpu must be a GPU index >= 0, got {gpu!r}")
        self.numa_node = numa_node
        self.placement_mode = placement
        self.gpu = gpu
        self._placement: HostPlacement | None = None
        self._buf: np.ndarray | None = None
        self._mmap: HostMapping | None = None
        self._memory = "none"
        self._memory_note: str | None = None
        # A new book per open: a get finishing after close touches only its old book.
        # The book also keeps a slot being read from reuse until the read ends (so a
        # delete + put cannot overwrite bytes a get is copying out).
        self.slots = SlotBook(0)
        self._copies = 0
        self._skipped_copies = 0
        self._inline_copies = 0

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Size of the arena buffer."""
        return self.page_bytes * self.capacity_pages

    async def open(self) -> None:
        """Allocate (and pin or lock) the arena. Idempotent; raises
        :class:`ArenaAllocationError` saying how much memory is available when the arena
        is larger than that, or the allocation fails."""
        if self._opened:
            return
        available = available_memory()
        if available is not None and self.nbytes > available:
            raise ArenaAllocationError(
                f"a DRAM arena of {size_text(self.nbytes)} does not fit: {size_text(available)} of "
                "memory is available (MemAvailable); lower the tier's capacity"
            )
        self._placement = self._plan()  # before the executor: its threads get pinned
        await super().open()
        try:
            await self.run_blocking(self._allocate)
        except BaseException:
            await super().close()
            raise
        self.slots = SlotBook(self.capacity_pages)

    async def close(self) -> None:
        """Drop every page and release the memory (views already handed out keep their
        bytes alive). Idempotent."""
        await super().close()
        self.slots = SlotBook(0)
        if self._mmap is not None:
            # Views still handed out stay valid (the mmap lives on), just no longer pinned.
            self._mmap.run_cleanups()
        self._buf = None
        self._mmap = None  # not mm.close(): outstanding views would make it raise

    def _plan(self) -> HostPlacement | None:
        """The placement decision for ``placement`` (``None`` when that option is unset)."""
        if self.placement_mode is None:
            return None
        from kvtier.placement import plan_placement
        from kvtier.topology import read_topology

        topology = read_topology()
        plan = plan_placement(
            topology,
            self.placement_mode,  # type: ignore[arg-type]
            gpus=[self.gpu] if topology.gpus else None,
            node=self.numa_node,
        )
        return plan.for_gpu(self.gpu)

    def _thread_initializer(self) -> Callable[[], None] | None:
        """Copy threads run on the CPUs of the arena's node (when ``placement`` chose one)."""
        if self._placement is None or not self._placement.cpus:
            return None
        from kvtier.placement import thread_initializer

        return thread_initializer(self._placement)

    def _allocate(self) -> None:
        # Not MAP_POPULATE: the NUMA policy is set first, so pages are faulted in on the
        # right node (by pinning, mlock, or touching each one) instead of being migrated.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        try:
            mm = HostMapping(-1, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError, MemoryError) as exc:
            available = available_memory()
            have = "unknown" if available is None else size_text(available)
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            capped = (
                f"; the process's address-space limit (ulimit -v) is {size_text(limit)}"
                if limit != resource.RLIM_INFINITY
                else ""
            )
            raise ArenaAllocationError(
                f"cannot allocate a DRAM arena of {size_text(self.nbytes)} ({exc}); memory "
                f"available: {have}{capped}"
            ) from exc
        buf = np.frombuffer(mm, dtype=np.uint8)
        self._bind_memory(buf)
        self._mmap = mm
        self._buf = buf
        self._memory_note = None
        pin_refusal = None
        if cuda_available():
            pin_refusal = cuda_host_register(buf.ctypes.data, self.nbytes)
            if pin_refusal is None:
                self._memory = "pinned"
                # Unregistered at close, or when the last view is gone if never closed.
                mm.before_unmap(_unregister, buf.ctypes.data)
                return
            if LOGGED.first("cudaHostRegister"):
                _log.warning("dram arena not pinned for CUDA (continuing): %s", pin_refusal)
        refusal = try_mlock(buf.ctypes.data, self.nbytes)  # mlock faults every page in
        if refusal is None:
            self._memory = "mlocked"
            self._memory_note = pin_refusal
        else:
            buf[:: mmap.PAGESIZE] = 0  # pre-fault: touch every page so no copy pays for it
            self._memory = "plain"
            self._memory_note = "; ".join(r for r in (pin_refusal, refusal) if r)
            if LOGGED.first("mlock"):
                _log.warning("dram arena not locked in memory (continuing): %s", refusal)

    def _bind_memory(self, buf: np.ndarray) -> None:
        """Bind ``buf`` per ``placement`` (logged with its reason), else to
        :attr:`numa_node` with ``mbind`` (no-op when neither is set).

        Called once per :meth:`open` on the freshly allocated buffer, before any of its
        pages is faulted in (pinning, ``mlock`` and pre-faulting come after), so every
        page lands on the bound node; page-locked pages could not be migrated later. Raises
        :class:`kvtier.numa.NumaNodeError` for a node that does not exist here and
        :class:`kvtier.numa.NumaError` when the kernel refuses.
        """
        if self._placement is not None:
            from kvtier.placement import apply_memory

            apply_memory(self._placement, buf)
            return
        if self.numa_node is None:
            return
        from kvtier import numa

        numa.bind_buffer(buf, [self.numa_node], numa.MemPolicy.BIND, move=True)

    # -- zero-copy access ---------------------------------------------------------------

    def ready(self) -> None:
        self._arena()

    def reservation_view(self, slot: int) -> np.ndarray:
        """Reservations carry their slot's writable view (a store reads straight in)."""
        return self._slot_view(slot)

    def _arena(self) -> np.ndarray:
        self._check_open()
        assert self._buf is not None
        return self._buf

    def view(self, slot: int) -> np.ndarray:
        """Writable zero-copy uint8 view of ``slot``; raises for a slot out of range."""
        buf = self._arena()
        self.check_slot(slot)
        start = int(slot) * self.page_bytes
        return buf[start : start + self.page_bytes]

    def _slot_view(self, slot: int) -> np.ndarray:
        """:meth:`view` without the checks, for slots the slot book handed out."""
        assert self._buf is not None
        start = slot * self.page_bytes
        return self._buf[start : start + self.page_bytes]

    def tensor(self, slot: int) -> torch.Tensor:
        """Zero-copy torch uint8 tensor over ``slot`` (shares memory with :meth:`view`)."""
        import torch

        return torch.from_numpy(self.view(slot))

    def copy_threads_for(self, nbytes: int) -> int:
        """Threads one call copying ``nbytes`` runs on: one below
        :data:`PARALLEL_COPY_MIN_BYTES` (on the loop itself below
        :data:`INLINE_COPY_MAX_BYTES`), else the I/O threads (at most one per core)."""
        if nbytes < PARALLEL_COPY_MIN_BYTES:
            return 1
        return max(1, min(self.io_threads, os.cpu_count() or 1))

    # -- copies -------------------------------------------------------------------------

    async def _copy(self, pairs: list[tuple[int, CopyPair]]) -> None:
        """Run a batch of ``(slot, (dst, src))`` copies: inline when the whole batch is
        under :data:`INLINE_COPY_MAX_BYTES`, else off the loop in one hop, split across
        the I/O threads when the batch is large.

        The slots stay busy in the slot book until the worker threads have returned, even
        when the awaiting task is cancelled first, so an abort or delete meanwhile cannot
        hand a slot to a new page that a late copy would then overwrite or read."""
        self._check_open()
        assert self._executor is not None
        work = [(slot, (d, s)) for slot, (d, s) in pairs if not same_memory(d, s)]
        if not work:
            return
        self._copies += len(work)
        copies = [pair for _, pair in work]
        total = len(copies) * self.page_bytes  # every pair is one page (or less)
        if total < INLINE_COPY_MAX_BYTES:
            self._inline_copies += len(work)
            copy_pairs(copies)  # no await in between: nothing can reuse the slots meanwhile
            # Yield once, so that a stream of small calls cannot starve the loop's other
            # tasks (one loop iteration: far cheaper than the hop this replaces).
            await asyncio.sleep(0)
            return
        parts = min(self.io_threads, os.cpu_count() or 1)
        groups = (
            [copies]
            if parts <= 1 or total < PARALLEL_COPY_MIN_BYTES
            else split_pairs(copies, parts)
        )
        book, slots = self.slots, [slot for slot, _ in work]
        book.begin_io(slots)
        loop = asyncio.get_running_loop()
        futures = [self._executor.submit(copy_pairs, group) for group in groups]
        left = len(futures)

        def finished() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                book.end_io(slots)

        def on_done(_: concurrent.futures.Future[None]) -> None:  # a worker thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing to free
                loop.call_soon_threadsafe(finished)

        for fut in futures:
            fut.add_done_callback(on_done)
        # raises (cancelled too) only once every group's copy has returned: none still
        # writes the caller's buffers
        await gather_to_the_end([asyncio.wrap_future(f) for f in futures])

    # -- the keyed, two-phase interface ------------------------------------------------

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Copy each buffer into its slot (skipped when the buffer *is* the slot view).
        ``False`` for a reservation that is no longer live (aborted or committed)."""
        self._arena()
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        ok: list[bool] = []
        pairs: list[tuple[int, CopyPair]] = []
        for r, buf in zip(reservations, bufs, strict=True):
            if r.present:
                ok.append(True)
            elif self.slots.is_live(r.handle, r.key):
                dst = self._slot_view(r.handle)
                if same_memory(dst, buf):
                    self._skipped_copies += 1
                else:
                    pairs.append((r.handle, (dst, buf)))
                ok.append(True)
            else:
                ok.append(False)
        await self._copy(pairs)
        return ok

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one pass (the base class's three calls, without
        building reservations): the same results and the same slot-book rules, less
        Python per page, which is what small pages pay for."""
        self._arena()
        bufs = check_buffers(data, len(keys), self.page_bytes)
        ok = [False] * len(keys)
        taken: list[tuple[int, int, PageKey]] = []
        pairs: list[tuple[int, CopyPair]] = []
        for i, (key, buf) in enumerate(zip(keys, bufs, strict=True)):
            got = self.slots.take(key)
            if got is None:
                continue
            slot, present = got
            if present:
                ok[i] = True
                continue
            taken.append((i, slot, key))
            dst = self._slot_view(slot)
            if same_memory(dst, buf):
                self._skipped_copies += 1
            else:
                pairs.append((slot, (dst, buf)))
        try:
            await self._copy(pairs)
        except BaseException:  # cancelled or failed before any commit: give the slots back
            for _, slot, key in taken:
                self.slots.abort(slot, key, False)
            raise
        for i, slot, key in taken:
            ok[i] = self.slots.commit(slot, key, False)
        return ok

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Copy committed pages into ``out`` (one hop); ``False`` for keys not here."""
        self._arena()
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        ok: list[bool] = []
        pairs: list[tuple[int, CopyPair]] = []
        for key, buf in zip(keys, bufs, strict=True):
            slot = self.slots.slot_of(key)
            if slot is None:
                ok.append(False)
                continue
            pairs.append((slot, (buf, self._slot_view(slot))))
            ok.append(True)
        await self._copy(pairs)
        return ok

    def stats(self) -> dict[str, Any]:
        """Base counters plus ``memory`` (pinned / mlocked / plain / none before open),
        why memory is not locked (``memory_note``), the NUMA node, and copy counts
        (``inline_copies``: pages of batches small enough to copy on the loop)."""
        out = super().stats()
        out.update(
            memory=self._memory,
            memory_note=self._memory_note,
            numa_node=self.numa_node,
            placement=None if self._placement is None else self._placement.to_dict(),
            arena_bytes=self.nbytes,
            committed_pages=len(self.slots.committed),
            reserved_pages=len(self.slots.reserved),
            draining_pages=self.slots.draining,
            copies=self._copies,
            skipped_copies=self._skipped_copies,
            inline_copies=self._inline_copies,
        )
        return out
