"""A test-only stand-in for the small CuPy surface the HBM arena uses.

It is NOT CuPy and proves nothing about CuPy or a GPU. It models the semantics the arena
relies on: "device" memory (host numpy underneath), streams that run their queued
operations in order on their own thread, events that are done until recorded and then
fire when their stream reaches them, and ``stream.wait_event``. It checks what *our* code
does with that surface: batching, event waits off the loop, the per-slot ordering that
keeps a slot from being overwritten under an in-flight read, and the cache's pipeline
over a tier whose slots have no host view. On a GPU machine the same tests run on CuPy.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
import types
import weakref
from typing import Any

import numpy as np
import pytest

from kvtier import cuda_streams


def install_standin(monkeypatch: pytest.MonkeyPatch, read_delay_s: float = 0.0) -> types.ModuleType:
    """Install the stand-in as ``cupy`` (undone with ``monkeypatch``) and clear the
    cached GPU availability answer; returns the module."""
    mod = standin_cupy_module(read_delay_s)
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(cuda_streams, "_reason_cache", [])
    return mod


def _serve(q: queue.Queue[Any]) -> None:
    """A stand-in stream's thread: run its queued operations in order until ``None``."""
    while (op := q.get()) is not None:
        op()
        q.task_done()


class _StandInStream:
    """Operations run in order on a thread of the stream's own, which ends once the stream
    is garbage (a CUDA stream is no Python thread: a closed arena leaves none running)."""

    def __init__(self, non_blocking: bool = False, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._q: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=_serve, args=(self._q,), daemon=True).start()
        weakref.finalize(self, self._q.put, None)

    def enqueue(self, op: Any, slow: bool = False) -> None:
        if slow and self.delay_s:
            delay = self.delay_s
            self._q.put(lambda: (time.sleep(delay), op()))
        else:
            self._q.put(op)

    def wait_event(self, event: _StandInEvent) -> None:
        flag = event._flag
        self._q.put(flag.wait)

    def synchronize(self) -> None:
        self._q.join()

    def __enter__(self) -> _StandInStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _StandInEvent:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self._flag = threading.Event()
        self._flag.set()  # like CUDA: an event never recorded counts as done

    def record(self, stream: _StandInStream) -> None:
        self._flag.clear()
        stream.enqueue(self._flag.set)

    @property
    def done(self) -> bool:
        return self._flag.is_set()


class _StandInMemPtr:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.ptr = arr.ctypes.data

    def __add__(self, offset: int) -> _StandInMemPtr:
        return _StandInMemPtr(self.arr[offset:])

    @staticmethod
    def _host(ptr: Any, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr.value))

    def copy_from_host_async(self, ptr: Any, n: int, stream: _StandInStream) -> None:
        src = self._host(ptr, n)
        stream.enqueue(lambda: np.copyto(self.arr[:n], src))

    def copy_to_host_async(self, ptr: Any, n: int, stream: _StandInStream) -> None:
        dst = self._host(ptr, n)
        stream.enqueue(lambda: np.copyto(dst, self.arr[:n]), slow=True)  # reads are slow

    def copy_from_device_async(self, src: _StandInMemPtr, n: int, stream: _StandInStream) -> None:
        stream.enqueue(lambda: np.copyto(self.arr[:n], src.arr[:n]))


class _StandInArray:
    def __init__(self, arr: np.ndarray, device: int = 0) -> None:
        self._arr = arr
        self.device = types.SimpleNamespace(id=device)
        self.dtype = arr.dtype
        self.ndim = arr.ndim
        self.size = arr.size
        self.shape = arr.shape
        self.nbytes = arr.nbytes
        self.flags = arr.flags
        self.data = _StandInMemPtr(arr)

    def __dlpack__(self, **kwargs: Any) -> Any:  # a CPU tensor over the "device" bytes
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._arr.__dlpack_device__()

    def __getitem__(self, item: Any) -> _StandInArray:
        return _StandInArray(self._arr[item], self.device.id)


_StandInArray.__module__ = "cupy"  # how the arena tells device arrays from host arrays


def standin_cupy_module(read_delay_s: float = 0.0) -> types.ModuleType:
    class OutOfMemoryError(MemoryError):
        pass

    class Device:
        def __init__(self, index: int = 0) -> None:
            self.id = index

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    cupy = types.ModuleType("cupy")
    cupy.uint8 = np.uint8  # type: ignore[attr-defined]
    cupy.empty = lambda n, dtype=np.uint8: _StandInArray(np.zeros(n, dtype))  # type: ignore[attr-defined]
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Device=Device,
        Stream=lambda non_blocking=False: _StandInStream(non_blocking, read_delay_s),
        Event=_StandInEvent,
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1, memGetInfo=lambda: (1 << 30, 1 << 30)
        ),
    )
    return cupy
