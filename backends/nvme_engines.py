"""I/O engines of the NVMe store: how page bytes reach the slab files and come back.

Both engines write the same format (:mod:`kvtier.backends.nvme_layout`); a store written
by one reads with the other. Engine methods are blocking and batch-level: the store runs
each batch on a worker thread (one executor hop per batch, never per page).

* :class:`PosixEngine`: ``os.pwritev`` / ``os.preadv``; with O_DIRECT the body of an
  aligned caller buffer goes to the disk without a copy, and the tail (rest of the
  payload + header) through a per-thread aligned staging buffer; direct writes carry
  ``RWF_DSYNC`` where the file system takes it, so they are durable on return.
* :class:`KvikioEngine`: KvikIO ``CuFile`` futures (GPUDirect Storage when available,
  KvikIO's POSIX compat mode otherwise); the batch's futures are all issued first and
  then awaited, so KvikIO's own thread pool runs them in parallel.

Engines never raise for a page: each item gets ``None`` (written) / header bytes (read)
or the exception that failed it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from kvtier.backends.nvme_layout import SlotLayout, aligned_empty, is_aligned
from kvtier.backends.nvme_slabs import SlabFiles, slab_path

from kvtier.errors import IntegrityError
from kvtier.pageformat import HEADER_SIZE


@dataclass(frozen=True)
class PageWrite:
    """One page to write: payload (``page_bytes`` uint8) and its encoded header."""

    slab: int
    offset: int
    payload: np.ndarray
    header: bytes


@dataclass(frozen=True)
class PageRead:
    """One page to read into ``out`` (``page_bytes`` uint8, writable)."""

    slab: int
    offset: int
    out: np.ndarray


#: Per item: ``None`` when written, else the exception.
WriteResult = BaseException | None
#: Per item: the 64 header bytes read back, else the exception.
ReadResult = bytes | BaseException


class IoEngine(ABC):
    """Moves batches of pages between host buffers and slab files."""

    name: ClassVar[str]
    #: Whether the store should split a batch across its worker threads (True), or hand
    #: the whole batch to one call because the engine parallelises internally (False).
    splits_batches: ClassVar[bool] = True

    def __init__(self, layout: SlotLayout, slabs: SlabFiles) -> None:
        self.layout = layout
        self.slabs = slabs

    @property
    def durable_writes(self) -> bool:
        """Whether a write is durable when :meth:`write_batch` returns (then commit needs
        no ``fdatasync``)."""
        return False

    @abstractmethod
    def write_batch(self, items: Sequence[PageWrite]) -> list[WriteResult]:
        """Write each page (payload + header) at its slot. Blocking."""

    @abstractmethod
    def read_batch(self, items: Sequence[PageRead]) -> list[ReadResult]:
        """Read each page's payload into ``out`` and return its header bytes. Blocking.

        A slot that ends before the page does (a truncated slab) yields an
        :class:`~kvtier.errors.IntegrityError`.
        """

    def close(self) -> None:  # noqa: B027 - a no-op by default, on purpose
        """Release engine resources (the slab descriptors belong to :class:`SlabFiles`)."""


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers."""
    out = list(bufs)
    while out and n >= len(out[0]):
        n -= len(out[0])
        out.pop(0)
    if out and n:
        out[0] = out[0][n:]
    return out


def pwritev_all(fd: int, bufs: list[memoryview], offset: int, flags: int = 0) -> None:
    """Write every byte of ``bufs`` at ``offset``, retrying short writes."""
    done = 0
    while bufs:
        n = os.pwritev(fd, bufs, offset + done, flags)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev made no progress")
        done += n
        bufs = _advance(bufs, n)


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill every byte of ``bufs`` from ``offset``; a read past the end of the file
    raises :class:`IntegrityError` (the slab is shorter than the page)."""
    want = sum(len(b) for b in bufs)
    done = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + done)
        if n <= 0:
            raise IntegrityError(
                f"slab ends inside the page: read {done} of {want} bytes at offset {offset}"
            )
        done += n
        bufs = _advance(bufs, n)


class PosixEngine(IoEngine):
    """``os.pwritev`` / ``os.preadv`` with O_DIRECT where the slabs were opened with it."""

    name: ClassVar[str] = "posix"

    def __init__(self, layout: SlotLayout, slabs: SlabFiles) -> None:
        super().__init__(layout, slabs)
        self._local = threading.local()
        # Direct writes with RWF_DSYNC are durable on return (FUA where the device has
        # it), overlapping the flush with the other in-flight writes instead of one
        # fdatasync barrier per commit.
        self._flags = os.RWF_DSYNC if slabs.dsync else 0

    @property
    def durable_writes(self) -> bool:
        return self.slabs.dsync

    def _staging(self) -> np.ndarray:
        """This thread's aligned buffer of one slot."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = aligned_empty(self.layout.slot_bytes)
            self._local.buf = buf
        return buf

    def write_batch(self, items: Sequence[PageWrite]) -> list[WriteResult]:
        out: list[WriteResult] = []
        for item in items:
            try:
                self._write_one(item)
                out.append(None)
            except Exception as exc:
                out.append(exc)
        return out

    def read_batch(self, items: Sequence[PageRead]) -> list[ReadResult]:
        out: list[ReadResult] = []
        for item in items:
            try:
                out.append(self._read_one(item))
            except Exception as exc:
                out.append(exc)
        return out

    def _write_one(self, item: PageWrite) -> None:
        lay = self.layout
        fd = self.slabs.fd(item.slab)
        if not self.slabs.direct:
            pwritev_all(fd, [item.payload.data, memoryview(item.header)], item.offset)
            return
        stage = self._staging()
        body = lay.body_bytes
        if body and is_aligned(item.payload):
            tail = stage[: lay.tail_bytes]
            tail[: lay.tail_payload_bytes] = item.payload[body:]
            tail[lay.tail_payload_bytes : lay.tail_payload_bytes + HEADER_SIZE] = np.frombuffer(
                item.header, dtype=np.uint8
            )
            pwritev_all(fd, [item.payload[:body].data, tail.data], item.offset, self._flags)
        else:
            np.copyto(stage[: lay.page_bytes], item.payload)
            stage[lay.page_bytes : lay.page_bytes + HEADER_SIZE] = np.frombuffer(
                item.header, dtype=np.uint8
            )
            pwritev_all(fd, [stage.data], item.offset, self._flags)

    def _read_one(self, item: PageRead) -> bytes:
        lay = self.layout
        fd = self.slabs.fd(item.slab)
        if not self.slabs.direct:
            header = bytearray(HEADER_SIZE)
            preadv_all(fd, [item.out.data, memoryview(header)], item.offset)
            return bytes(header)
        stage = self._staging()
        body = lay.body_bytes
        if body and is_aligned(item.out):
            tail = stage[: lay.tail_bytes]
            preadv_all(fd, [item.out[:body].data, tail.data], item.offset)
            item.out[body:] = tail[: lay.tail_payload_bytes]
            start = lay.tail_payload_bytes
        else:
            preadv_all(fd, [stage.data], item.offset)
            np.copyto(item.out, stage[: lay.page_bytes])
            start = lay.page_bytes
        return stage[start : start + HEADER_SIZE].tobytes()


def cuda_driver_missing() -> str | None:
    """``None`` when a CUDA driver library can be loaded, else why not."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        return f"no CUDA driver library ({name}: {exc})"
    return None


def kvikio_unavailable_reason() -> str | None:
    """Why the KvikIO engine cannot run here, or ``None``. Never raises."""
    missing = cuda_driver_missing()
    if missing is not None:
        return f"{missing}; KvikIO needs it even in compat mode"
    try:
        import kvikio  # noqa: F401
    except Exception as exc:
        return f"kvikio is not importable ({exc!r}); install the gpu extra (kvikio-cu13)"
    return None


class KvikioEngine(IoEngine):
    """KvikIO ``CuFile`` futures: all of a batch's reads or writes in flight at once.

    Host buffers go through KvikIO's POSIX path (compat mode) or its bounce buffers; the
    header travels as its own small request after the payload.
    """

    name: ClassVar[str] = "kvikio"
    splits_batches: ClassVar[bool] = False

    def __init__(self, layout: SlotLayout, slabs: SlabFiles) -> None:
        super().__init__(layout, slabs)
        reason = kvikio_unavailable_reason()
        if reason is not None:
            from kvtier.errors import BackendUnavailableError

            raise BackendUnavailableError(f"nvme engine 'kvikio' is unavailable: {reason}")
        import kvikio

        self._kvikio: Any = kvikio
        self._files: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _file(self, slab: int) -> Any:
        with self._lock:
            f = self._files.get(slab)
            if f is None:
                path: Path = slab_path(self.slabs.root, slab)
                f = self._kvikio.CuFile(path, "r+")
                self._files[slab] = f
            return f

    def write_batch(self, items: Sequence[PageWrite]) -> list[WriteResult]:
        pending: list[tuple[Any, Any] | BaseException] = []
        for item in items:
            try:
                f = self._file(item.slab)
                header = np.frombuffer(item.header, dtype=np.uint8)
                first = f.pwrite(item.payload, item.payload.nbytes, item.offset)
                second = _after(
                    first,
                    lambda f=f, header=header, item=item: f.pwrite(
                        header, HEADER_SIZE, item.offset + self.layout.page_bytes
                    ),
                )
                pending.append((first, second))
            except Exception as exc:
                pending.append(exc)
        out: list[WriteResult] = []
        for p in pending:
            if isinstance(p, BaseException):
                out.append(p)
                continue
            try:
                n = _get_both(p[0], p[1])
                want = self.layout.page_bytes + HEADER_SIZE
                out.append(None if n == want else OSError(errno.EIO, f"wrote {n} of {want}"))
            except Exception as exc:
                out.append(exc)
        return out

    def read_batch(self, items: Sequence[PageRead]) -> list[ReadResult]:
        pending: list[tuple[Any, Any, np.ndarray] | BaseException] = []
        for item in items:
            try:
                f = self._file(item.slab)
                header = np.empty(HEADER_SIZE, dtype=np.uint8)
                first = f.pread(item.out, item.out.nbytes, item.offset)
                second = _after(
                    first,
                    lambda f=f, header=header, item=item: f.pread(
                        header, HEADER_SIZE, item.offset + self.layout.page_bytes
                    ),
                )
                pending.append((first, second, header))
            except Exception as exc:
                pending.append(exc)
        out: list[ReadResult] = []
        for p in pending:
            if isinstance(p, BaseException):
                out.append(p)
                continue
            try:
                n = _get_both(p[0], p[1])
                want = self.layout.page_bytes + HEADER_SIZE
                if n != want:
                    raise IntegrityError(f"slab ends inside the page: read {n} of {want} bytes")
                out.append(p[2].tobytes())
            except Exception as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for f in files.values():
            f.close()


ENGINES: dict[str, type[IoEngine]] = {"posix": PosixEngine, "kvikio": KvikioEngine}


def _after(first: Any, start_second: Any) -> Any:
    """``start_second()``; when it raises, wait for ``first`` (a KvikIO future whose
    worker may still use a buffer of this call) before raising."""
    try:
        return start_second()
    except BaseException:
        with contextlib.suppress(Exception):
            first.get()
        raise


def _get_both(first: Any, second: Any) -> int:
    """Bytes moved by two KvikIO futures, waiting for both even when the first fails:
    a read's header buffer was freed while a worker still wrote into it."""
    try:
        n = int(first.get())
    except BaseException:
        with contextlib.suppress(Exception):
            second.get()
        raise
    return n + int(second.get())
