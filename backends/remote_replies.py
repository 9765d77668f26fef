"""Replies of the remote store's server, item by item: the marker of an item that got no
reply, what counts as a failed item, a value checked into page bytes, page names, and a
deadline for control commands (see :mod:`kvtier.backends.remote`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import IntegrityError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, verify_page

from .remote_datapath import (
    Fetched,
    GetItem,
)
from .remote_nodes import NodeFailure
from .remote_wire import ReplyError


class NoReply:
    """Marks an item whose batch failed or was skipped (``None`` is a real reply)."""

    def __repr__(self) -> str:
        return "NO_REPLY"


NO_REPLY: Any = NoReply()


@dataclass
class Pending:
    """A reservation between ``reserve`` and ``commit``/``abort``."""

    key: PageKey
    namespace: str
    value: np.ndarray | None = None  # payload + header, filled by write()
    size: int = 0  # payload bytes in value (page_bytes, or less from write_blobs())


#: Errors a client library raises when a reply is not what a Redis-protocol server sends
#: (something else listens on the port): named as such, not as a bare Python error.
_NOT_REDIS = (AttributeError, TypeError, IndexError, KeyError, UnicodeDecodeError)


def describe(exc: Any) -> str:
    """``exc`` (an exception, a :class:`ReplyError`, or :data:`NO_REPLY`: no answer) in
    a log line or an error message: what failed, and why."""
    if not isinstance(exc, BaseException | ReplyError):
        return "no reply"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, _NOT_REDIS):
        return f"the server's reply is not Redis protocol: is it a Redis server? ({text})"
    return text


#: Error codes of a server that refuses this client, not a page: no password given (a
#: wrong one fails at connect already), or an ACL user denied the key prefix or the
#: command (``NOPERM``: every page of the tier shares its prefix, so one refused page
#: means all are; it was counted as a full server's refusal, naming no ACL).
ACCESS_DENIED: frozenset[str] = frozenset({"NOAUTH", "NOPERM"})


def access_denied(reply: Any) -> bool:
    """Whether ``reply`` is a server error refusing this client (:data:`ACCESS_DENIED`)."""
    return isinstance(reply, ReplyError) and reply.prefix in ACCESS_DENIED


def failed(reply: Any) -> bool:
    """A per-item failure: no reply, a server error, or an exception object."""
    return reply is NO_REPLY or isinstance(reply, ReplyError | BaseException)


def as_reply(reply: Any) -> Any:
    """A redis-py pipeline reply in the data path's terms (errors become ReplyError,
    with the error code redis-py takes off the message put back where it knows it:
    ``NOPERM``, which :func:`access_denied` looks for)."""
    if isinstance(reply, BaseException) and not is_connection_error(reply):
        from redis.exceptions import NoPermissionError

        text = str(reply)
        if isinstance(reply, NoPermissionError) and not text.startswith("NOPERM"):
            text = f"NOPERM {text}"
        return ReplyError(text)
    return reply


def check_value(item: GetItem, value: Any, sized: bool) -> Any:
    """Verify a value fetched through redis-py (after a redirection) and copy it into the
    item's buffer; the same outcomes as :func:`fetch_pages` (``sized``: a blob of 1 to
    ``len(item.out)`` bytes)."""
    if isinstance(value, BaseException):
        return as_reply(value)
    if value is None:
        return (Fetched.ABSENT, "", 0)
    view, largest = memoryview(value), item.out.nbytes
    size = len(view) - HEADER_SIZE
    try:
        if not (0 < size <= largest if sized else size == largest):
            raise IntegrityError(f"stored value is {len(view)} bytes, expected "
                                 f"{'up to ' if sized else ''}{largest + HEADER_SIZE}")  # fmt: skip
        verify_page(view[size:], item.key, view[:size])
    except IntegrityError as exc:
        return (Fetched.BAD, str(exc), 0)
    item.out[:size] = view[:size]
    return (Fetched.HIT, "", size)


_CONNECTION_ERRORS: tuple[type[BaseException], ...] = ()


def is_connection_error(reply: Any) -> bool:
    global _CONNECTION_ERRORS
    if not isinstance(reply, BaseException):
        return False
    if not _CONNECTION_ERRORS:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        _CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)
    return isinstance(reply, _CONNECTION_ERRORS)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` says the server did not answer in time (the built-in, asyncio's or
    redis-py's timeout), not that it refused or dropped the connection."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(exc, TimeoutError | RedisTimeoutError)


def node_failure(address: tuple[str, int], exc: BaseException) -> NodeFailure:
    """``exc``, raised for one node of a cluster batch, as the per-item reply of that
    node's items: a :class:`~kvtier.backends.remote_nodes.NodeFailure` naming the node (a
    miss, and an outage of the store)."""
    err = NodeFailure(address, describe(exc))
    err.__cause__ = exc
    return err


def parse_page_name(name: bytes, prefix: bytes) -> PageKey | None:
    """The key of ``<prefix>{<32 hex>}``, or ``None`` for anything else."""
    if not name.startswith(prefix) or len(name) != len(prefix) + 2 * KEY_BYTES + 1:
        return None
    if not name.endswith(b"}"):
        return None
    try:
        return PageKey(bytes.fromhex(name[len(prefix) : -1].decode()))
    except ValueError:
        return None


async def with_deadline(aw: Awaitable[None], seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await aw
