"""A blocking RESP2 connection for the remote store's bulk data path.

One :class:`WireConnection` is one TCP (optionally TLS) connection to a Redis-protocol
server, used by one thread at a time. It exists so that a page crosses user space as few
times as possible:

* commands go out with ``sendmsg``, one iovec per buffer, so a page is sent straight from
  the caller's buffer (no join, no staging copy);
* a ``GET`` reply's value is read with ``recvmsg_into`` (``MSG_WAITALL``) straight into
  the caller's page buffer and a header buffer: the kernel's copy is the only one.

Every blocking call honours :attr:`WireConnection.deadline` (a ``time.monotonic()``
instant): the socket's send/receive timeouts are set to the time left before each system
call, and a call that runs past it raises :class:`WireTimeout`. Any :class:`WireError`
leaves the connection :attr:`~WireConnection.broken` (its reply stream is out of step):
close it. :meth:`WireConnection.abort`, callable from any thread, makes a blocked call fail
at once (used when the caller is cancelled and must not leave a thread writing into its
buffers).

Server error replies (``-ERR ...``, ``-MOVED ...``) are not exceptions: they come back as
:class:`ReplyError` values, one per command, as a pipelined batch needs.

TLS connections use the ``ssl`` module's blocking sockets, which have no
``sendmsg``/``recvmsg_into``: they send and receive buffer by buffer (same bytes, more
system calls).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

#: Bytes asked for when reading a reply line (status, error, integer, bulk length).
_LINE_READ = 4096
#: Longest reply line accepted (an error message, a bulk length); longer is a protocol error.
_MAX_LINE = 1 << 16
#: How far past its deadline one system call may wait (see ``WireConnection._arm``).
_DEADLINE_SLACK_S = 0.005
#: Most buffers per ``sendmsg`` call (Linux ``IOV_MAX`` is 1024).
_IOV_MAX = 1024
_CRLF = b"\r\n"
#: What an error a server sends before closing a connection most likely means.
_HINTS = {
    "invalid bulk length": (
        " (a page value is larger than the server's proto-max-bulk-len: raise it, or use"
        " smaller pages)"
    ),
}


def _no_password_set(reply: ReplyError, address: tuple[str, int]) -> bool:
    """Whether ``reply`` refuses an ``AUTH`` only because the server has no password
    (``AUTH <password> called without any password configured...``, or Redis < 6's
    ``Client sent AUTH, but no password is set``): the connection is usable, as redis-py
    (the store's control path) treats it, and as the URL's password then protects nothing,
    the first such reply from each server is logged."""
    text = reply.message
    if "called without any password configured" not in text and "no password is set" not in text:
        return False
    if address not in _NO_PASSWORD_LOGGED:
        _NO_PASSWORD_LOGGED.add(address)
        logging.getLogger("kvtier.backends.remote").warning(
            "the remote store's URL gives a password but the server %s:%d has none "
            "configured (it answered: %s); connecting without authentication",
            *address,
            text,
        )
    return True


#: Servers whose "no password configured" answer was logged (once each per process).
_NO_PASSWORD_LOGGED: set[tuple[str, int]] = set()


class WireError(Exception):
    """The connection failed (refused, reset, closed, protocol error); it is unusable."""


class WireTimeout(WireError, TimeoutError):
    """The deadline passed during a call; the connection is unusable."""


class AuthenticationError(WireError):
    """The server refused the credentials (``AUTH``) or the database (``SELECT``)."""


@dataclass(frozen=True)
class ReplyError:
    """A server error reply (``-PREFIX message``), kept as a value in a batch's results."""

    message: str

    @property
    def prefix(self) -> str:
        """The error code, e.g. ``"OOM"``, ``"MOVED"``, ``"WRONGTYPE"``."""
        return self.message.split(" ", 1)[0]

    @property
    def redirected(self) -> bool:
        """A cluster redirection (``MOVED``/``ASK``): the key lives on another node."""
        return self.prefix in ("MOVED", "ASK")

    def __str__(self) -> str:
        return self.message


class ValueReply(Enum):
    """What :meth:`WireConnection.read_value_into` found."""

    VALUE = "value"  # a value of the expected size, now in the caller's buffers
    NIL = "nil"  # no such key
    WRONG_SIZE = "wrong size"  # a value of another size (read and discarded)


def command(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings) with every argument inline."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _as_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class WireConnection:
    """One connection, used by one thread at a time (see the module docstring).

    Build it with :meth:`connect`. :attr:`deadline` bounds every blocking call; set it per
    batch. Not thread-safe except :meth:`abort`.
    """

    def __init__(self, sock: socket.socket, address: tuple[str, int]) -> None:
        self.address = address
        self.deadline = float("inf")
        self.broken = False
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._timeout_set: float | None = None

    # -- opening and closing -------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        deadline: float,
        connect_timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> WireConnection:
        """Connect, authenticate and select ``db``.

        Raises :class:`WireTimeout` past ``deadline`` (or ``connect_timeout_s`` for the TCP
        and TLS handshakes), :class:`AuthenticationError` for refused credentials and
        :class:`WireError` for anything else.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireTimeout("deadline passed before connecting")
        try:
            raw = socket.create_connection((host, port), timeout=min(connect_timeout_s, left))
        except TimeoutError as exc:
            raise WireTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise WireError(f"connecting to {host}:{port} failed: {exc}") from exc
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock: socket.socket = raw
            if ssl_context is not None:
                raw.settimeout(max(0.001, min(connect_timeout_s, deadline - time.monotonic())))
                sock = ssl_context.wrap_socket(raw, server_hostname=host)
            else:
                sock.settimeout(None)  # blocking; deadlines through SO_RCVTIMEO/SO_SNDTIMEO
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            if isinstance(exc, TimeoutError):
                raise WireTimeout(f"TLS handshake with {host}:{port} timed out") from exc
            raise WireError(f"TLS handshake with {host}:{port} failed: {exc}") from exc
        conn = cls(sock, (host, port))
        conn.deadline = deadline
        try:
            setup: list[bytes] = []
            if password is not None:
                creds = [username.encode()] if username else []
                setup.append(command(b"AUTH", *creds, password.encode()))
            if db:
                setup.append(command(b"SELECT", str(db).encode()))
            if setup:
                conn.send(setup)
                for _ in setup:
                    reply = conn.read_reply()
                    if isinstance(reply, ReplyError) and not _no_password_set(reply, (host, port)):
                        raise AuthenticationError(f"Authentication failed: {reply.message}")
        except BaseException:
            conn.close()
            raise
        return conn

    def fileno(self) -> int:
        """The socket's file descriptor (-1 once closed)."""
        return self._sock.fileno()

    def abort(self) -> None:
        """Make a call blocked in another thread fail now (shut the socket down)."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- deadlines -----------------------------------------------------------------------

    def _arm(self) -> None:
        """Set the socket's timeouts to the time left; raise :class:`WireTimeout` if none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.broken = True
            raise WireTimeout("deadline passed")
        left = max(left, 0.001)
        if self._tls:
            self._sock.settimeout(left)
            return
        # The socket timeouts bound each system call; re-set them only when they would let
        # a call overrun the deadline by more than _DEADLINE_SLACK_S (two setsockopt calls
        # per system call would cost more than the calls themselves for small pages).
        if self._timeout_set is not None and left <= self._timeout_set <= left + _DEADLINE_SLACK_S:
            return
        sec = int(left)
        tv = struct.pack("ll", sec, int((left - sec) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._timeout_set = left

    def _fail(self, exc: BaseException, what: str, said: str | None = None) -> WireError:
        self.broken = True
        timed_out = isinstance(exc, TimeoutError | BlockingIOError) or (
            isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
        )
        if timed_out:
            return WireTimeout(f"{what} timed out")
        if said is None:
            return WireError(f"{what} failed: {exc}")
        hint = _HINTS.get(said.split(":")[-1].strip(), "")
        return WireError(f"{what} failed: {exc}; the server said: {said}{hint}")

    def _error_waiting(self) -> str | None:
        """The error reply a server sent before it closed the connection (a value over its
        ``proto-max-bulk-len``, ``maxclients`` reached), read without waiting, else
        ``None``: a send cut short by the server says why, not only "connection reset"."""
        if self._tls:
            return None
        try:
            data = self._sock.recv(_MAX_LINE, socket.MSG_DONTWAIT)
        except OSError:
            return None
        if not data.startswith(b"-"):
            return None
        return data[1:].split(_CRLF)[0].decode("utf-8", "replace")

    # -- sending -------------------------------------------------------------------------

    def send(self, buffers: Sequence[Any]) -> None:
        """Send every buffer, in order, without joining them (``sendmsg``)."""
        views = [_as_view(b) for b in buffers]
        views = [v for v in views if v.nbytes]
        try:
            if self._tls:
                for v in views:
                    self._arm()
                    self._sock.sendall(v)
                return
            i = 0
            while i < len(views):
                self._arm()
                sent = self._sock.sendmsg(views[i : i + _IOV_MAX])
                while sent:
                    if sent >= views[i].nbytes:
                        sent -= views[i].nbytes
                        i += 1
                    else:
                        views[i] = views[i][sent:]
                        sent = 0
        except WireError:
            raise
        except (OSError, ssl.SSLError) as exc:
            raise self._fail(exc, "send", self._error_waiting()) from exc

    # -- receiving -----------------------------------------------------------------------

    def _recv_into(self, view: memoryview) -> int:
        """One receive into ``view`` (at least one byte, or an error)."""
        self._arm()
        try:
            n = self._sock.recv_into(view)
        except (OSError, ssl.SSLError) as exc:
            raise self._fail(exc, "receive") from exc
        if n == 0:
            self.broken = True
            raise WireError("connection closed by the server")
        return n

    def _fill(self, limit: int) -> None:
        """Read at most ``limit`` more bytes into the line buffer."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + limit > len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        limit = min(limit, len(self._buf) - self._end)
        self._end += self._recv_into(self._view[self._end : self._end + limit])

    def _line(self, read_size: int = _LINE_READ) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= _MAX_LINE:
                self.broken = True
                raise WireError("protocol error: reply line too long")
            self._fill(read_size)

    def _read_exact(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order: first from buffered bytes, then from the socket
        straight into the views (one ``recvmsg_into`` with ``MSG_WAITALL`` per attempt)."""
        pending: list[memoryview] = []
        for v in views:
            if not v.nbytes:
                continue
            have = self._end - self._start
            if have and not pending:
                take = min(have, v.nbytes)
                v[:take] = self._view[self._start : self._start + take]
                self._start += take
                if take == v.nbytes:
                    continue
                v = v[take:]
            pending.append(v)
        while pending:
            if self._tls:
                n = self._recv_into(pending[0])
            else:
                self._arm()
                try:
                    n = self._sock.recvmsg_into(pending, 0, socket.MSG_WAITALL)[0]
                except (OSError, ssl.SSLError) as exc:
                    raise self._fail(exc, "receive") from exc
                if n == 0:
                    self.broken = True
                    raise WireError("connection closed by the server")
            while n:
                if n >= pending[0].nbytes:
                    n -= pending[0].nbytes
                    pending.pop(0)
                else:
                    pending[0] = pending[0][n:]
                    n = 0

    def _discard(self, nbytes: int) -> None:
        while nbytes:
            have = self._end - self._start
            if not have:
                self._fill(min(nbytes, len(self._buf)))
                continue
            take = min(have, nbytes)
            self._start += take
            nbytes -= take

    def read_reply(self) -> Any:
        """The next reply: ``bytes`` (status or bulk), ``int``, ``None`` (nil), ``list``
        (array) or :class:`ReplyError`. Raises :class:`WireError` on a protocol error."""
        line = self._line()
        if not line:
            self.broken = True
            raise WireError("protocol error: empty reply line")
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                return ReplyError(rest.decode(errors="replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                if n < 0:
                    return None
                data = bytearray(n + 2)
                self._read_exact([memoryview(data)])
                return bytes(data[:n])
            if kind == b"*":
                n = int(rest)
                return None if n < 0 else [self.read_reply() for _ in range(n)]
        except ValueError:
            pass
        self.broken = True
        raise WireError(f"protocol error: unexpected reply line {line[:40]!r}")

    def _value_length(self, largest: int) -> int | ReplyError:
        """The length of the next ``GET`` reply's value (``-1``: nil), or its error.
        Reads no more of the reply than a length line for ``largest`` bytes, so that the
        value's bytes go to the caller's buffers rather than through the line buffer.
        Raises :class:`WireError` on a protocol error."""
        line = self._line(len(b"$%d\r\n" % largest))
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        try:
            n = int(rest) if kind == b"$" else None
        except ValueError:
            n = None
        if n is None:
            self.broken = True
            raise WireError(f"protocol error: unexpected GET reply {line[:40]!r}")
        return n

    def _read_value(self, views: Sequence[memoryview]) -> None:
        """Read a value (its length line already read) into ``views``, then its CRLF."""
        crlf = bytearray(2)
        self._read_exact([*views, memoryview(crlf)])
        if crlf != _CRLF:
            self.broken = True
            raise WireError("protocol error: bulk value not followed by CRLF")

    def read_value_into(self, payload: memoryview, trailer: memoryview) -> ValueReply | ReplyError:
        """Read one ``GET`` reply expected to hold ``len(payload) + len(trailer)`` bytes
        straight into ``payload`` then ``trailer``.

        A value of another size is read and discarded (:attr:`ValueReply.WRONG_SIZE`); the
        caller's buffers are then untouched. Raises :class:`WireError` on a protocol error.
        """
        size = payload.nbytes + trailer.nbytes
        n = self._value_length(size)
        if isinstance(n, ReplyError):
            return n
        if n < 0:
            return ValueReply.NIL
        if n != size:
            self._discard(n + 2)
            return ValueReply.WRONG_SIZE
        self._read_value([payload, trailer])
        return ValueReply.VALUE

    def read_blob_into(
        self, payload: memoryview, trailer: memoryview
    ) -> int | ValueReply | ReplyError:
        """Read one ``GET`` reply of ``len(trailer) + 1`` to ``len(payload) + len(trailer)``
        bytes: all but its last ``len(trailer)`` bytes into the start of ``payload``, those
        into ``trailer``. Returns how many bytes went to ``payload``, or what
        :meth:`read_value_into` returns for nil, another size (the buffers untouched) or an
        error reply. Raises :class:`WireError` on a protocol error.
        """
        n = self._value_length(payload.nbytes + trailer.nbytes)
        if isinstance(n, ReplyError):
            return n
        if n < 0:
            return ValueReply.NIL
        body = n - trailer.nbytes
        if not 0 < body <= payload.nbytes:
            self._discard(n + 2)
            return ValueReply.WRONG_SIZE
        self._read_value([payload[:body], trailer])
        return body
