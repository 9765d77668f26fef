"""The remote store's bulk data path: pipelined ``SET``/``GET`` batches on worker threads.

:class:`RedisStore` moves page bytes through here, never through ``redis-py`` (which keeps
the small commands: ``EXISTS``, ``DEL``, ``SCAN`` and, in cluster mode, the slot map). A
batch runs on one thread and one :class:`~kvtier.backends.remote_wire.WireConnection`:

* :func:`send_pages` sends one ``SET`` per page straight from the page's buffer, the
  64-byte header (xxh3 checksum) computed on the thread just before the page goes out (the
  hash releases the GIL and overlaps the server's reading of the previous page), then
  reads the replies;
* :func:`fetch_pages` sends every ``GET`` at once, reads each value straight into the
  caller's page buffer and verifies it there, on the thread, as it arrives (``sized``:
  values shorter than a page too, for the codec tiers' variable-length blobs).

:class:`WirePool` keeps idle connections per server address and runs batches on its own
threads. Its :meth:`WirePool.run` is cancel-safe: a cancelled caller aborts the
connection and waits for the thread to return, so no thread ever writes into a caller's
buffer after the call that lent it has returned. Each batch has a deadline (a
``time.monotonic()`` instant) that every system call of the thread honours.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import select
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import numpy as np

from kvtier.errors import IntegrityError
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

from .remote_wire import ReplyError, ValueReply, WireConnection, WireError

T = TypeVar("T")
Address = tuple[str, int]


@dataclass(frozen=True)
class WireSettings:
    """How to open a connection: timeouts, credentials, database, TLS."""

    connect_timeout_s: float
    username: str | None = None
    password: str | None = None
    db: int = 0
    ssl_context: ssl.SSLContext | None = None
    tls_error: str | None = None  # TLS was asked for but its context could not be built


class _Job:
    """The connection one thread is using, reachable from the loop to abort it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: WireConnection | None = None
        self._aborted = False

    def attach(self, conn: WireConnection) -> None:
        with self._lock:
            self._conn = conn
            if self._aborted:
                conn.abort()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self._conn is not None:
                self._conn.abort()


def _stale(conn: WireConnection) -> bool:
    """An idle connection with something to read (the server closed it, or sent what
    nobody asked for) is not reused."""
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class WirePool:
    """Connections per server address and the threads batches run on.

    Args:
        settings: how to connect.
        threads: most batches running at once (more wait for a thread).
    """

    def __init__(self, settings: WireSettings, threads: int) -> None:
        self.settings = settings
        self._idle: dict[Address, list[WireConnection]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvtier-redis-io"
        )
        self._closed = False
        self.connects = 0  # connections opened so far (stats)

    def _take(self, address: Address) -> WireConnection | None:
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if not _stale(conn):
                return conn
            conn.close()
        return None

    def _give(self, conn: WireConnection) -> None:
        if self._closed or conn.broken:
            conn.close()
        else:
            self._idle.setdefault(conn.address, []).append(conn)

    def _call(
        self,
        job: _Job,
        conn: WireConnection | None,
        address: Address,
        fn: Callable[[WireConnection], T],
        deadline: float,
    ) -> tuple[WireConnection, T]:
        if conn is None:
            s = self.settings
            if s.tls_error is not None:
                raise WireError(s.tls_error)  # never fall back to plain text
            conn = WireConnection.connect(
                address[0],
                address[1],
                deadline=deadline,
                connect_timeout_s=s.connect_timeout_s,
                username=s.username,
                password=s.password,
                db=s.db,
                ssl_context=s.ssl_context,
            )
            self.connects += 1
        job.attach(conn)
        conn.deadline = deadline
        try:
            return conn, fn(conn)
        except BaseException:
            conn.close()
            raise

    async def run(self, address: Address, fn: Callable[[WireConnection], T], deadline: float) -> T:
        """Run ``fn(connection)`` on a worker thread with a connection to ``address``
        (an idle one, or a new one opened on the thread), every system call bounded by
        ``deadline``. Raises :class:`~kvtier.backends.remote_wire.WireError` (the
        connection is then closed) or what ``fn`` raises. If the caller is cancelled, the
        connection is aborted and the thread waited for before the cancellation goes on.
        """
        if self._closed:
            raise WireError("the connection pool is closed")
        job = _Job()
        conn = self._take(address)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, self._call, job, conn, address, fn, deadline)
        try:
            used, result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            job.abort()
            await _settle(fut)
            raise
        self._give(used)
        return result

    def close(self) -> None:
        """Close idle connections; connections in use are closed when their batch ends.
        Threads still running finish on their own (their deadline bounds them)."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._executor.shutdown(wait=False)


async def _settle(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` to finish whatever happens to the waiting task (the thread behind
    it was aborted, so this is short); its outcome is dropped."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:
            break
    if fut.done() and not fut.cancelled():
        fut.exception()  # retrieved, so that asyncio does not log it


# -- the batches --------------------------------------------------------------------------


@dataclass(frozen=True)
class SetItem:
    """One ``SET``: the value is ``body``, followed by the page header computed from
    ``body`` when ``key`` is given (``namespace`` labels it), else ``body`` alone."""

    name: bytes
    body: memoryview
    key: bytes | None = None
    namespace: str = ""


def set_suffix(nx: bool, ttl_ms: int) -> tuple[int, bytes]:
    """Argument count and encoded tail (``NX``, ``PX ms``) of a ``SET`` command."""
    args: list[bytes] = []
    if nx:
        args.append(b"NX")
    if ttl_ms:
        args += [b"PX", str(ttl_ms).encode()]
    tail = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    return 3 + len(args), tail


def send_pages(conn: WireConnection, items: Sequence[SetItem], nx: bool, ttl_ms: int) -> list[Any]:
    """Pipelined ``SET`` of every item; per item ``True`` (stored), ``None`` (``NX`` and
    the key exists) or a :class:`ReplyError` (refused: out of memory, no permission,
    redirected). Runs on a worker thread."""
    argc, tail = set_suffix(nx, ttl_ms)
    for item in items:
        header = b"" if item.key is None else encode_header(item.key, item.namespace, item.body)
        size = item.body.nbytes + len(header)
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(item.name), item.name, size)
        conn.send([head, item.body, header + b"\r\n" + tail])
    out: list[Any] = []
    for _ in items:
        reply = conn.read_reply()
        out.append(True if reply == b"OK" else reply)
    return out


class Fetched(Enum):
    """The outcome of one page of :func:`fetch_pages` (besides a :class:`ReplyError`)."""

    HIT = "hit"  # verified, in the caller's buffer
    ABSENT = "absent"  # no such key (never stored, evicted, expired, deleted)
    BAD = "bad"  # a value that is not this page (wrong size, header, key or checksum)


@dataclass(frozen=True)
class GetItem:
    """One ``GET`` of page ``key`` (server name ``name``) into ``out``."""

    name: bytes
    key: bytes
    out: memoryview


def fetch_pages(
    conn: WireConnection, items: Sequence[GetItem], sized: bool = False
) -> list[tuple[Fetched, str, int] | ReplyError]:
    """Pipelined ``GET`` of every item straight into its buffer, each verified there as it
    arrives. Per item ``(Fetched, problem, payload bytes)`` or a :class:`ReplyError`. A
    ``HIT``'s payload fills ``item.out``, or with ``sized`` its first bytes (a blob of 1 to
    ``len(item.out)`` bytes, :meth:`~WireConnection.read_blob_into`); a ``BAD`` page's
    buffer holds unspecified bytes. Runs on a worker thread."""
    conn.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(i.name), i.name) for i in items])
    header = bytearray(HEADER_SIZE)
    hview = memoryview(header)
    out: list[tuple[Fetched, str, int] | ReplyError] = []
    for item in items:
        got: int | ValueReply | ReplyError
        if sized:
            got = conn.read_blob_into(item.out, hview)
        else:
            got = conn.read_value_into(item.out, hview)
            if got is ValueReply.VALUE:
                got = item.out.nbytes
        if isinstance(got, ReplyError):
            out.append(got)
        elif got is ValueReply.NIL:
            out.append((Fetched.ABSENT, "", 0))
        elif not isinstance(got, int):  # ValueReply.WRONG_SIZE
            out.append((Fetched.BAD, "stored value has the wrong size", 0))
        else:
            try:
                verify_page(hview, item.key, item.out[:got])
            except IntegrityError as exc:
                out.append((Fetched.BAD, str(exc), 0))
            else:
                out.append((Fetched.HIT, "", got))
    return out


def byte_view(buf: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous uint8 array (writable if the array is), no copy."""
    view: memoryview = buf.data
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
