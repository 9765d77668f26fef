"""The connection side of the Redis-protocol remote store: options, redis-py clients
for control commands, kvtier's own RESP data path for page bytes, pipelined batches with
deadlines, staging buffers and outage tracking. :class:`RedisStoreBase` holds it;
:class:`~kvtier.backends.remote.RedisStore` adds the keyed, two-phase interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvtier.aio import finish_even_if_cancelled
from kvtier.backend import (
    BackendClosedError,
    Medium,
    StoreBackend,
)
from kvtier.errors import KVTierUsageError
from kvtier.health import Health
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header

from .remote_datapath import (
    Address,
    SetItem,
    WirePool,
    WireSettings,
    send_pages,
)
from .remote_nodes import DownNodes, NodeFailure
from .remote_options import RemoteOptions, parse_options, pipeline_pages, url_parts
from .remote_replies import (
    NO_REPLY,
    Pending,
    as_reply,
    describe,
    is_connection_error,
    is_timeout,
    node_failure,
)
from .remote_wire import ReplyError, WireConnection

log = logging.getLogger("kvtier.backends.remote")

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item of a batch

#: Batches whose staging copy (``write``) is at least this large run on the executor, so
#: the event loop never spends long on them (design invariant 7); below it an executor hop
#: (100 us to milliseconds on a loaded machine) costs more than the work.
_OFFLOAD_BYTES = 4 << 20
#: Seconds a cluster batch's timeout waits past its deadline (see ``_node_slack``).
NODE_DEADLINE_SLACK_S = 0.25
#: Most bytes of idle value buffers kept for reuse between calls.
_SPARE_BYTES = 64 << 20


class RedisStoreBase(StoreBackend):
    """The connection side of :class:`~kvtier.backends.remote.RedisStore`: options,
    clients, the pipelined data path, staging buffers, health. The keyed two-phase
    interface is the subclass's."""

    medium: ClassVar[Medium] = Medium.NETWORK

    default_io_threads: ClassVar[int] = 2
    shared: ClassVar[bool] = True  # one pool, many servers
    variable_length: ClassVar[bool] = True  # write_blobs / get_sized: values of 1 to a page

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        **options: Any,
    ) -> None:
        self.options: RemoteOptions = parse_options(options)
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads
        )
        self._url_parts = url_parts(self.options.url)
        self._client: Any = None
        self._wire: WirePool | None = None
        self._sem: asyncio.Semaphore | None = None
        self._pending: dict[int, Pending] = {}
        self._committed: set[PageKey] = set()
        self._next_handle = 0
        self._putting = 0  # pages inside a one-round-trip put()
        self._spare: list[np.ndarray] = []  # value buffers kept for reuse
        self._step = pipeline_pages(self.options.batch_pages, page_bytes)
        self._ttl_ms = 0 if self.options.ttl_s is None else max(1, round(self.options.ttl_s * 1e3))
        self.health = Health(
            self.options.public()["url"], log, retry_interval_s=self.options.retry_interval_s
        )
        self.checksum_failures = 0
        self.redirects = 0  # pages re-sent through redis-py after MOVED/ASK
        self._busy = 0  # calls using the client now (close waits for them)
        self._failed_at: float | None = None  # monotonic time of the last failed batch
        self._timed_out_at: float | None = None  # and of the last one that timed out
        self._batch_failures = 0  # failed batches, not counting one cluster node's failure
        self._down_nodes = DownNodes()
        # In a cluster each node's part of a batch stops at the batch's deadline by itself
        # (a frozen node fails alone, its NodeFailure beside the live nodes' replies); the
        # batch's own timeout comes this much later, only to catch what hangs past it.
        self._node_slack = NODE_DEADLINE_SLACK_S if self.options.cluster else 0.0
        self._idle = asyncio.Event()

    # -- discovery and lifecycle -----------------------------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError as exc:
            return f"the redis package is not importable: {exc}"
        return None

    def _client_kwargs(self) -> dict[str, Any]:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        o = self.options
        kwargs: dict[str, Any] = {
            "socket_timeout": o.op_timeout_s,
            "socket_connect_timeout": o.connect_timeout_s,
            # One immediate retry: a connection broken by a server restart is replaced at
            # once; a server that stays down fails fast and the batch becomes a miss.
            "retry": Retry(NoBackoff(), 1),
        }
        if o.username is not None:
            kwargs["username"] = o.username
        if o.password is not None:
            kwargs["password"] = o.password
        if o.tls:
            kwargs["ssl_cert_reqs"] = "required" if o.tls_verify else "none"
            kwargs["ssl_check_hostname"] = o.tls_verify
            if o.tls_ca_certs is not None:
                kwargs["ssl_ca_certs"] = o.tls_ca_certs
            if o.tls_certfile is not None:
                kwargs["ssl_certfile"] = o.tls_certfile
            if o.tls_keyfile is not None:
                kwargs["ssl_keyfile"] = o.tls_keyfile
        return kwargs

    def _url(self) -> str:
        url = self.options.url
        if self.options.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        return url

    def _ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the data path (same settings as redis-py's)."""
        o = self.options
        if not o.tls:
            return None
        ctx = ssl.create_default_context(cafile=o.tls_ca_certs)
        if not o.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if o.tls_certfile is not None:
            ctx.load_cert_chain(o.tls_certfile, o.tls_keyfile)
        return ctx

    def _wire_settings(self) -> WireSettings:
        o, u = self.options, self._url_parts
        tls_error = None
        try:
            ctx = self._ssl_context()
        except (OSError, ssl.SSLError) as exc:  # a missing or bad file: misses, logged
            ctx, tls_error = None, f"TLS setup failed: {exc}"
        return WireSettings(
            connect_timeout_s=o.connect_timeout_s,
            username=o.username if o.username is not None else u.username,
            password=o.password if o.password is not None else u.password,
            db=u.db,
            ssl_context=ctx,
            tls_error=tls_error,
        )

    async def open(self) -> None:
        """Create the clients (no connection is made yet: a server that is down now is
        not an error; calls miss until it is up)."""
        if self._client is None:
            if self.options.cluster:
                from redis.asyncio.cluster import RedisCluster

                self._client = RedisCluster.from_url(self._url(), **self._client_kwargs())
            else:
                from redis.asyncio import Redis

                self._client = Redis.from_url(self._url(), **self._client_kwargs())
            threads = self.options.max_inflight * (4 if self.options.cluster else 1)
            self._wire = WirePool(self._wire_settings(), threads)
            self._sem = asyncio.Semaphore(self.options.max_inflight)
            self._idle = asyncio.Event()  # like the semaphore: bound to this loop
        await super().open()

    async def close(self) -> None:
        """Drop pending reservations (they never reached the server) and close the
        connections. Idempotent. Calls made from here on raise
        :class:`~kvtier.backend.BackendClosedError`; calls in flight send no further batch
        (those pages are misses) and are waited for, at most ``op_timeout_s``, so that none
        reopens a connection after the client is closed."""
        self._opened = False  # before the first await: no call may find the client gone
        self._pending.clear()
        self._spare.clear()
        if self._busy:  # calls in flight send nothing more; let them end (one deadline)
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.op_timeout_s):
                    await self._idle.wait()
        if self._wire is not None:
            wire, self._wire = self._wire, None
            wire.close()
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.aclose()
            except Exception as exc:  # closing a broken connection must not fail close()
                log.debug("closing the redis client failed: %r", exc)
        await super().close()

    # -- helpers ---------------------------------------------------------------------------

    def page_name(self, key: PageKey) -> bytes:
        """The server key of a committed page: ``<prefix>:{<32 hex digits>}``."""
        return f"{self.options.key_prefix}:{{{key.hex()}}}".encode()

    def _check_keys(self, keys: Sequence[PageKey]) -> None:
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise KVTierUsageError(
                    f"key {i} must be {KEY_BYTES} bytes (a PageKey), got {k!r:.60}"
                )

    async def _cpu(self, fn: Callable[[], T], nbytes: int) -> T:
        """Run copy/checksum work over ``nbytes`` inline when small, on the executor when
        large (one hop per batch). Also for a call that :meth:`close` is waiting for. A
        caller cancelled meanwhile raises only once the work is over: it copies into or
        out of the caller's buffers."""
        if nbytes < _OFFLOAD_BYTES:
            return fn()
        return await finish_even_if_cancelled(
            asyncio.get_running_loop().run_in_executor(self._executor, fn)
        )

    @contextlib.contextmanager
    def _using_client(self) -> Iterator[Any]:
        """The client, for one call; :meth:`close` waits for such calls to end."""
        self._check_open()
        self._busy += 1
        try:
            yield self._client
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    def _take_buffers(self, n: int) -> list[np.ndarray]:
        """``n`` value buffers (payload + header) from the spares, or new ones."""
        size = self.page_bytes + HEADER_SIZE
        out = [self._spare.pop() for _ in range(min(n, len(self._spare)))]
        out += [np.empty(size, dtype=np.uint8) for _ in range(n - len(out))]
        return out

    def _give_buffers(self, bufs: Sequence[np.ndarray]) -> None:
        keep = min(2 * self.options.max_inflight * self._step, _SPARE_BYTES // self.page_bytes)
        room = max(1, keep) - len(self._spare)
        self._spare.extend(bufs[: max(0, room)])

    def _fill(
        self, values: Sequence[np.ndarray], keys: Sequence[PageKey], namespace: Sequence[str],
        pages: Sequence[np.ndarray],
    ) -> None:  # fmt: skip
        """Copy each page (or shorter blob) and its header into the start of its value
        buffer (one batch, one call)."""
        for value, key, ns, page in zip(values, keys, namespace, pages, strict=True):
            size = page.nbytes
            value[:size] = page
            value[size : size + HEADER_SIZE] = np.frombuffer(
                encode_header(key, ns, page), dtype=np.uint8
            )

    async def _batched(
        self,
        n: int,
        send: Callable[[Any, range, float], Awaitable[Sequence[Any]]],
        *,
        before: Callable[[range], Awaitable[None]] | None = None,
    ) -> list[Any]:
        """Run ``send(client, indices, deadline)`` for items ``0..n-1`` in batches of the
        pipeline depth, up to ``max_inflight`` at once.

        Returns, per item, its reply (a value, a :class:`ReplyError` or an exception
        object), or :data:`NO_REPLY` when its whole batch failed (timeout, connection,
        cluster down) or was skipped: a batch waiting for a pipeline slot (``max_inflight``)
        while another batch of any call failed is not sent, so that during an outage every
        call misses within one deadline instead of queueing for one deadline per wave of
        batches. ``before(indices)`` prepares a batch (inside the concurrency bound, before
        its deadline starts). A batch's deadline (``op_timeout_s``) bounds its ``send``.
        """
        self._check_open()
        results: list[Any] = [NO_REPLY] * n
        if not n:
            return results
        step = self._step
        sem = self._sem
        assert sem is not None

        async def one(client: Any, start: int) -> None:
            chunk = range(start, min(start + step, n))
            failures = self._batch_failures
            async with sem:
                if self._batch_failures != failures:
                    return  # a batch failed while this one waited: miss now, not a deadline later
                if not self._opened:
                    return  # closing: send nothing more
                if not self.health.may_send():
                    return  # fail-fast during an outage: a miss now, no deadline
                sent = False
                try:
                    if before is not None:
                        await before(chunk)
                    timeout = self.options.op_timeout_s
                    async with asyncio.timeout(timeout + self._node_slack):
                        replies = await send(client, chunk, time.monotonic() + timeout)
                    sent = True
                except Exception as exc:  # any failure of the batch makes it a miss
                    self._failed(describe(exc), timed_out=is_timeout(exc))
                    return
                finally:
                    if not sent:  # failed (already reported) or cancelled before an outcome
                        self.health.probe_abandoned()
            broken = [r for r in replies if is_connection_error(r)]
            if broken:  # the batch failed, unless only some cluster nodes did
                self._failed(describe(broken[0]),
                             batch=not all(isinstance(r, NodeFailure) for r in broken))  # fmt: skip
            else:
                self.health.succeeded()
            for i, reply in zip(chunk, replies, strict=True):
                results[i] = reply

        with self._using_client() as client:
            # each batch in a task of its own, even alone: redis-py's writes use
            # ``asyncio.wait_for``, which in Python 3.11 returns normally when the write
            # ends as the caller is cancelled. In the caller's task that swallowed the
            # cancellation (a cancelled load went on and returned pages pinned); gather
            # raises it once its tasks are done.
            await asyncio.gather(*(one(client, s) for s in range(0, n, step)))
        return results

    def _failed(self, reason: str, batch: bool = True, timed_out: bool = False) -> None:
        """Record a failure with :attr:`health`; with ``batch`` (the default: not only
        some cluster nodes failed) also when it failed, and as a failed batch (the batches
        waiting for a pipeline slot are then skipped); with ``timed_out`` (the server did
        not answer within the deadline, as a frozen one does) when that happened."""
        if batch:
            self._failed_at = time.monotonic()
            self._batch_failures += 1
            if timed_out:
                self._timed_out_at = self._failed_at
        self.health.failed(reason)

    def _failed_recently(self, timed_out: bool = False) -> float | None:
        """Seconds since the last failed batch (with ``timed_out``: the last one that
        timed out), when the server has not answered since and that is less than
        ``op_timeout_s`` ago; else ``None``. A question sent now would most likely wait
        out a whole deadline for nothing: :meth:`~kvtier.backends.remote.RedisStore.
        contains` right after a failed read answers at once, and so does a write-down's
        reserve right after a timeout (a refused connection costs nothing to retry, and a
        restarted server is back already)."""
        at = self._timed_out_at if timed_out else self._failed_at
        if not self.health.down or at is None:
            return None
        ago = time.monotonic() - at
        return ago if ago < self.options.op_timeout_s else None

    def _pipelined(
        self, items: Sequence[I], build: Callable[[Any, I], object]
    ) -> Callable[[Any, range, float], Awaitable[Sequence[Any]]]:
        """A ``send`` for :meth:`_batched` through a redis-py pipeline of
        ``build(pipe, item)`` per item (the small commands)."""

        async def send(client: Any, chunk: range, _deadline: float) -> Sequence[Any]:
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                build(pipe, items[i])
            replies: Sequence[Any] = await pipe.execute(raise_on_error=False)
            return replies

        return send

    async def _addresses(self, client: Any, names: Sequence[bytes]) -> list[Address]:
        """The server address of each name: the URL's, or in cluster mode the node owning
        the name's slot (redis-py's slot map)."""
        if not self.options.cluster:
            u = self._url_parts
            return [(u.host, u.port)] * len(names)
        await client.initialize()
        nodes = [client.get_node_from_key(name) for name in names]
        return [(node.host, int(node.port)) for node in nodes]

    async def _on_wire(
        self,
        client: Any,
        items: Sequence[I],
        names: Sequence[bytes],
        run: Callable[[WireConnection, list[I]], list[Any]],
        deadline: float,
        redirected: Callable[[Any, list[I]], Awaitable[list[Any]]],
    ) -> list[Any]:
        """Run ``run(connection, items of one node)`` on the data path, one thread per
        node, and send items answered with ``MOVED``/``ASK`` again through
        ``redirected(client, items)`` (redis-py's cluster pipeline)."""
        wire = self._wire
        if wire is None:
            raise BackendClosedError(f"{type(self).__name__} is closed")
        groups: dict[Address, list[int]] = {}
        for i, address in enumerate(await self._addresses(client, names)):
            groups.setdefault(address, []).append(i)
        out: list[Any] = [NO_REPLY] * len(items)

        async def node(address: Address, idx: list[int]) -> None:
            part = [items[i] for i in idx]
            for i, reply in zip(idx, await wire.run(address, lambda c: run(c, part), deadline),
                                strict=True):  # fmt: skip
                out[i] = reply

        if not self.options.cluster:
            [(address, idx)] = groups.items()
            await node(address, idx)
        else:
            # A node that failed moments ago is not asked again; every node asked runs to
            # its end (or its aborted end) before this returns: no thread is left writing
            # into the caller's buffers. A failed node's items get its failure as their
            # reply (a miss); the other nodes' items keep their replies.
            down, window = self._down_nodes, self.options.op_timeout_s
            failures: dict[Address, NodeFailure | None] = {
                a: down.recent(a, window) for a in groups
            }
            asked = [a for a, failure in failures.items() if failure is None]
            done = await asyncio.gather(*(node(a, groups[a]) for a in asked),
                                        return_exceptions=True)  # fmt: skip
            for d in done:
                if isinstance(d, BaseException) and not isinstance(d, Exception):
                    raise d  # a cancellation
            for address, d in zip(asked, done, strict=True):
                if isinstance(d, BaseException):
                    failures[address] = failure = node_failure(address, d)
                    down.failed(failure)
                else:
                    down.answered(address)
            for address, reply in failures.items():
                for i in groups[address] if reply is not None else ():
                    out[i] = reply
        again = [i for i, r in enumerate(out) if isinstance(r, ReplyError) and r.redirected]
        if again and self.options.cluster:
            self.redirects += len(again)
            for i, reply in zip(again, await redirected(client, [items[i] for i in again]),
                                strict=True):  # fmt: skip
                out[i] = reply
        return out

    def _set_kwargs(self, nx: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"nx": nx}
        if self._ttl_ms:
            kwargs["px"] = self._ttl_ms
        return kwargs

    async def _set_pages(self, items: Sequence[SetItem], nx: bool) -> list[Any]:
        """``SET`` every item on the data path; per item ``True``, ``None`` (``NX``: the
        key exists), a :class:`ReplyError`, or :data:`NO_REPLY`."""
        names = [it.name for it in items]
        ttl = self._ttl_ms

        async def redirected(client: Any, part: list[SetItem]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for it in part:
                header = b"" if it.key is None else encode_header(it.key, it.namespace, it.body)
                pipe.set(it.name, bytes(it.body) + header, **self._set_kwargs(nx))
            return [as_reply(r) for r in await pipe.execute(raise_on_error=False)]

        async def send(client: Any, chunk: range, deadline: float) -> list[Any]:
            part = [items[i] for i in chunk]
            return await self._on_wire(
                client, part, [names[i] for i in chunk],
                lambda conn, its: send_pages(conn, its, nx, ttl), deadline, redirected,
            )  # fmt: skip

        return await self._batched(len(items), send)
