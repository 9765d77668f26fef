"""The GPU HBM tier: a preallocated CuPy device buffer split into page slots.

Slots are exposed without copying as CuPy arrays (:meth:`HbmArena.device_view`) and torch
CUDA tensors (:meth:`HbmArena.tensor`, through DLPack). Pages enter and leave through
:meth:`write` and :meth:`get` like every backend; the host side may be any host array
(page-locked memory, e.g. the pinned DRAM arena's slot views, gives full PCIe speed) or a
CuPy array on the same GPU (a device-to-device copy).

A batch's copies are one ``cudaMemcpyAsync`` per run of consecutive slots whose host
pages are consecutive too (:func:`coalesce`), else one per page.

Copies run on dedicated non-blocking streams (:class:`~kvtier.cuda_streams.
CopyStreams`), never the default stream, so they overlap with the engine's compute. Each
call submits its whole batch from one executor hop (a copy from pageable host memory
blocks the submitting thread), records one event, and awaits it through the event poller:
the loop never blocks and no core spins. Stream ordering is explicit per slot
(:class:`~kvtier.cuda_streams.SlotOrdering`, kept under the submission lock): a
read of a slot waits on the GPU for the event of its last write, a write waits for the
last write and the reads since.
:meth:`write` returns only after its copies completed, so a committed page is complete.

Differences from host arenas, by necessity: :meth:`view` cannot give a numpy view of
device memory and raises :class:`KVTierUsageError` pointing at :meth:`device_view`, and
reservations carry no host ``view``.

Without CuPy or a CUDA driver, :meth:`HbmArena.unavailable_reason` says which, and
discovery lists the backend as unavailable.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvtier.aio import finish_even_if_cancelled
from kvtier.arena import SlotArena
from kvtier.backend import Medium, Reservation, check_buffer
from kvtier.cuda_streams import (
    CopyStreams,
    EventPoller,
    SlotOrdering,
    cupy_unavailable_reason,
    default_poller,
    require_cupy,
)
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.slots import SlotBook

if TYPE_CHECKING:
    import torch


def _is_device_array(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "cupy"


def coalesce(jobs: Sequence[tuple[int, Any]], page_bytes: int) -> list[tuple[int, Any, int]]:
    """One copy per run instead of one per page: ``(slot, other side)`` jobs become
    ``(first slot, first other side, bytes)``, merging a job into the previous one when its
    slot follows that run's last slot and its host buffer starts where the run's host
    bytes end (pages that are consecutive views of one host buffer, as a DRAM tier's
    adjacent slots are). Pages on the device are never merged: two device arrays that
    happen to be adjacent may be separate allocations. Order is kept."""
    runs: list[tuple[int, Any, int]] = []
    end_slot = end_addr = -1
    for slot, other in jobs:
        addr = -1 if _is_device_array(other) else int(other.ctypes.data)
        if runs and addr >= 0 and slot == end_slot and addr == end_addr:
            first_slot, first, nbytes = runs[-1]
            runs[-1] = (first_slot, first, nbytes + page_bytes)
        else:
            runs.append((slot, other, page_bytes))
        end_slot, end_addr = slot + 1, (addr + page_bytes if addr >= 0 else -1)
    return runs


class HbmArena(SlotArena):
    """``capacity_pages`` slots of ``page_bytes`` in the memory of one GPU.

    Options:
        device: CUDA device index (default 0).
        copy_streams: streams per direction (default 1; 2 overlaps consecutive batches).
        io_threads: threads that submit copies (default 2).

    Not persistent. Raises :class:`~kvtier.errors.CapacityError` at :meth:`open` when the
    GPU lacks the memory, naming what was asked and what is free.
    """

    medium: ClassVar[Medium] = Medium.DEVICE

    default_io_threads: ClassVar[int] = 2
    #: Slots are device memory: no numpy views, no host reservation views. (A marker for
    #: the conformance kit's host-view case, which does not apply here.)
    host_addressable: ClassVar[bool] = False

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        device: int = 0,
        copy_streams: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads, **options
        )
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise KVTierUsageError(f"device must be a CUDA device index >= 0, got {device!r}")
        if isinstance(copy_streams, bool) or not isinstance(copy_streams, int) or copy_streams < 1:
            raise KVTierUsageError(f"copy_streams must be an integer >= 1, got {copy_streams!r}")
        self.device = device
        self.copy_streams = copy_streams
        self._buf: Any = None
        self._streams: CopyStreams | None = None
        self._poller: EventPoller | None = None
        self._ordering = SlotOrdering()
        self._submit_lock = threading.Lock()
        # Slot reuse needs no read guard here: SlotOrdering makes a write to a slot wait
        # on the GPU for every read of it already submitted.
        self.slots = SlotBook(0)
        self._bytes_h2d = 0
        self._bytes_d2h = 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """CuPy missing, no CUDA driver, or no GPU; ``None`` when the GPU is usable."""
        return cupy_unavailable_reason()

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.capacity_pages

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Allocate the device buffer and copy streams. Idempotent."""
        if self._opened:
            return
        cupy = require_cupy()
        count = int(cupy.cuda.runtime.getDeviceCount())
        if self.device >= count:
            raise KVTierUsageError(
                f"CUDA device {self.device} does not exist (this machine has {count} GPU(s))"
            )
        await super().open()
        try:
            await self.run_blocking(self._allocate)
        except BaseException:
            await super().close()
            raise
        self._poller = default_poller()
        self._ordering = SlotOrdering()
        self.slots = SlotBook(self.capacity_pages)

    def _allocate(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            try:
                self._buf = cupy.empty(self.nbytes, dtype=cupy.uint8)
            except cupy.cuda.memory.OutOfMemoryError as exc:
                free, total = cupy.cuda.runtime.memGetInfo()
                raise CapacityError(
                    f"HBM arena: cannot allocate {self.nbytes} bytes on GPU {self.device} "
                    f"({free} of {total} bytes free): lower the hbm tier's capacity"
                ) from exc
            self._streams = CopyStreams(self.device, self.copy_streams)

    async def close(self) -> None:
        """Wait for in-flight copies, then release the device buffer. Idempotent."""
        if self._streams is not None and self._executor is not None:
            await self.run_blocking(self._synchronize)
        await super().close()
        self.slots = SlotBook(0)
        self._buf = None
        self._streams = None
        self._ordering = SlotOrdering()

    def _synchronize(self) -> None:
        assert self._streams is not None
        for s in (*self._streams.d2h, *self._streams.h2d):
            s.synchronize()

    # -- zero-copy access ---------------------------------------------------------------

    def device_view(self, slot: int) -> Any:
        """Zero-copy CuPy uint8 array over ``slot`` (device memory)."""
        self._check_open()
        self.check_slot(slot)
        start = int(slot) * self.page_bytes
        return self._buf[start : start + self.page_bytes]

    def view(self, slot: int) -> np.ndarray:
        """Not available: HBM slots are device memory. Raises :class:`KVTierUsageError`."""
        raise KVTierUsageError(
            "HBM slots live in GPU memory and have no numpy view: use device_view(slot) "
            "(CuPy) or tensor(slot) (torch)"
        )

    def tensor(self, slot: int) -> torch.Tensor:
        """Zero-copy torch CUDA uint8 tensor over ``slot`` (DLPack)."""
        import torch.utils.dlpack

        return torch.utils.dlpack.from_dlpack(self.device_view(slot))

    # -- copies -------------------------------------------------------------------------

    def _check_device_page(self, arr: Any, what: str) -> Any:
        dev = int(arr.device.id)
        if dev != self.device:
            raise KVTierUsageError(
                f"{what} is on GPU {dev} but this HBM arena is on GPU {self.device}: copy it "
                "to the arena's device or to host memory first"
            )
        if arr.dtype != np.uint8 or arr.ndim != 1 or int(arr.size) != self.page_bytes:
            raise KVTierUsageError(
                f"{what} must be a 1-D uint8 array of {self.page_bytes} bytes, "
                f"got {arr.dtype} shape {tuple(arr.shape)}"
            )
        if not arr.flags.c_contiguous:
            raise KVTierUsageError(f"{what} must be C-contiguous")
        return arr

    def _pages(self, data: Sequence[Any], count: int, writable: bool) -> list[Any]:
        if len(data) != count:
            raise KVTierUsageError(f"got {len(data)} buffers for {count} keys")
        out: list[Any] = []
        for i, buf in enumerate(data):
            if _is_device_array(buf):
                out.append(self._check_device_page(buf, f"buffer {i}"))
            else:
                arr = check_buffer(buf, self.page_bytes, f"buffer {i}")
                if writable and not arr.flags.writeable:
                    raise KVTierUsageError(f"buffer {i} must be writable to receive a page")
                out.append(arr)
        return out

    def _submit(self, direction: str, jobs: list[tuple[int, Any]]) -> Any:
        """Queue one batch of copies on one stream (worker thread); returns its event.

        ``jobs`` are (slot, other side); ``h2d`` writes slots, ``d2h`` reads them. The
        ordering state is read and updated under one lock, together with queuing the
        copies and recording their event, so two batches submitted from two threads can
        never miss each other's event.
        """
        import cupy

        assert self._streams is not None
        with self._submit_lock, cupy.cuda.Device(self.device):
            stream = self._streams.stream(direction)
            for slot, _ in jobs:
                deps = (
                    self._ordering.before_write(slot)
                    if direction == "h2d"
                    else self._ordering.before_read(slot)
                )
                for ev in deps:
                    stream.wait_event(ev)
            base = self._buf.data  # cupy MemoryPointer of slot 0
            for slot, other, nbytes in coalesce(jobs, self.page_bytes):
                mem = base + slot * self.page_bytes
                if _is_device_array(other):
                    if direction == "h2d":
                        mem.copy_from_device_async(other.data, nbytes, stream)
                    else:
                        other.data.copy_from_device_async(mem, nbytes, stream)
                elif direction == "h2d":
                    mem.copy_from_host_async(ctypes.c_void_p(other.ctypes.data), nbytes, stream)
                else:
                    mem.copy_to_host_async(ctypes.c_void_p(other.ctypes.data), nbytes, stream)
            event = self._streams.new_event()
            event.record(stream)
            for slot, _ in jobs:
                if direction == "h2d":
                    self._ordering.wrote(slot, event)
                else:
                    self._ordering.read(slot, event)
        return event

    async def _run_copies(self, direction: str, jobs: list[tuple[int, Any]]) -> None:
        """Queue the copies and wait until they are done, also when cancelled: a
        cancelled ``get`` returned while its device-to-host copy still ran, and the copy
        then wrote the caller's buffer (a DRAM slot given to another page by then)."""
        if not jobs:
            return
        await finish_even_if_cancelled(self._copies_done(direction, jobs))
        moved = len(jobs) * self.page_bytes
        if direction == "h2d":
            self._bytes_h2d += moved
        else:
            self._bytes_d2h += moved

    async def _copies_done(self, direction: str, jobs: list[tuple[int, Any]]) -> None:
        event = await self.run_blocking(self._submit, direction, jobs)
        assert self._poller is not None
        await self._poller.wait(event)

    # -- the keyed, two-phase interface ------------------------------------------------

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Copy host or same-GPU pages into reserved slots; returns after the copies are
        complete. ``False`` for a reservation no longer live."""
        self._check_open()
        bufs = self._pages(data, len(reservations), writable=False)
        ok: list[bool] = []
        jobs: list[tuple[int, Any]] = []
        for r, buf in zip(reservations, bufs, strict=True):
            if r.present:
                ok.append(True)
            elif self.slots.is_live(r.handle, r.key):
                jobs.append((r.handle, buf))
                ok.append(True)
            else:
                ok.append(False)
        await self._run_copies("h2d", jobs)
        return ok

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Copy committed pages into host or same-GPU buffers; ``False`` for misses."""
        self._check_open()
        bufs = self._pages(out, len(keys), writable=True)
        ok: list[bool] = []
        jobs: list[tuple[int, Any]] = []
        for key, buf in zip(keys, bufs, strict=True):
            slot = self.slots.slot_of(key)
            if slot is None:
                ok.append(False)
            else:
                jobs.append((slot, buf))
                ok.append(True)
        await self._run_copies("d2h", jobs)
        return ok

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            device=self.device,
            arena_bytes=self.nbytes,
            copy_streams=self.copy_streams,
            bytes_h2d=self._bytes_h2d,
            bytes_d2h=self._bytes_d2h,
        )
        return out
