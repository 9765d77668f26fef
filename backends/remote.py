"""The remote tier on a Redis-protocol server: Valkey or Redis, single node or cluster.

:class:`RedisStore` keeps each page as one string value under ``<prefix>:{<key hex>}``:
the payload followed by the 64-byte header of :mod:`kvtier.pageformat` (key, length, xxh3
checksum), the same layout as the NVMe slots. Reads are a plain pipelined ``GET``
(measured twice as fast as ``HMGET`` of hash fields), verified before the page counts as
read; a page that does not verify, that the server evicted, or that a failing server
could not return is a miss, never wrong bytes (a page that fails verification is also
deleted, so that it can be stored again).

**Short values** (:attr:`~kvtier.backend.StoreBackend.variable_length`): a blob of 1 to
``page_bytes`` bytes written with :meth:`RedisStore.write_blobs` is a value of its own
length plus the header (which records that length); :meth:`RedisStore.get_sized` reads it
back with its length. A codec tier (:mod:`kvtier.codec.store`) thus sends a compressed page
at its compressed size. Plain ``get`` takes whole pages only (a shorter value is a damaged
page there).

**Two paths to the server.** Page bytes (``SET`` and ``GET`` of values) go through the
data path of :mod:`~kvtier.backends.remote_datapath`: a small RESP client of kvtier's own
that sends each page straight from the caller's buffer and reads each value straight into
the caller's buffer, on worker threads, with the checksum work on those threads too
(measured against ``redis-py`` and the C client ``redis-benchmark`` in
``benchmarks/remote_clients.py``). Everything else (``EXISTS``, ``DEL``, ``SCAN``, and in
cluster mode the slot map and ``MOVED``/``ASK`` redirections) goes through ``redis-py``.
In cluster mode, each batch is split by the node owning each key's slot; a key answered
with a redirection is sent again through ``redis-py``'s cluster pipeline, which follows
the redirection and refreshes the slot map.

**Two-phase put: the value reaches the server only at commit.** ``reserve`` asks which
keys already exist (those are no-ops) and takes client-side capacity; ``write`` copies the
page and its header into a client-side buffer (the one copy a header+payload value needs;
the caller may reuse its buffer at once); ``commit`` sends each buffer in one ``SET``
without copying it. A ``SET`` is atomic, so readers see either no page or the whole page,
and uncommitted data is never on the server for ``get``/``contains``/``exists``/``keys``
to see. :meth:`RedisStore.put` does the same in one round trip (``SET ... NX``: a page
already there is kept), sent straight from the caller's buffers.

**Capacity.** ``capacity_pages`` bounds what *this client* has reserved and committed (the
pool is shared; the server's own ``maxmemory`` bounds it as a whole). Pages the server drops
on its own become misses and leave the client-side count when a read or ``contains``
notices they are gone.

**Failures.** Each pipelined batch (``batch_pages`` pages, by default 16 MiB) has a deadline
(``op_timeout_s``) that every system call of the data path honours; a batch that times
out or cannot reach the server fails as a whole and its pages count as misses
(``False``/``None``), and batches (of any call) still waiting for a pipeline slot then are
skipped, so that during an outage calls miss within about one deadline instead of queueing
for one deadline each. A cancelled call returns only once no thread writes into its
buffers any more. The client reconnects by itself on the next call. An outage is logged
once when it starts and once when it ends
(:class:`~kvtier.backends.remote_health.Health`); a server refusing writes (out of memory)
is logged once per episode. A server that is down when the store opens is not an error:
the store opens and misses until the server is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvtier.backend import (
    BackendClosedError,
    Reservation,
    StoreBackend,
    check_blobs,
    check_buffers,
)
from kvtier.errors import IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

from .remote_datapath import (
    Address,
    Fetched,
    GetItem,
    SetItem,
    WirePool,
    WireSettings,
    byte_view,
    fetch_pages,
    send_pages,
)
from .remote_health import Health
from .remote_options import RemoteOptions, parse_options, pipeline_pages, url_parts
from .remote_wire import ReplyError, WireConnection

log = logging.getLogger("kvtier.backends.remote")

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item of a batch

#: Batches whose staging copy (``write``) is at least this large run on the executor, so
#: the event loop never spends long on them (design invariant 7); below it an executor hop
#: (100 us to milliseconds on a loaded machine) costs more than the work.
_OFFLOAD_BYTES = 4 << 20
#: Most bytes of idle value buffers kept for reuse between calls.
_SPARE_BYTES = 64 << 20


class _NoReply:
    """Marks an item whose batch failed or was skipped (``None`` is a real reply)."""

    def __repr__(self) -> str:
        return "NO_REPLY"


NO_REPLY: Any = _NoReply()


@dataclass
class _Pending:
    """A reservation between ``reserve`` and ``commit``/``abort``."""

    key: PageKey
    namespace: str
    value: np.ndarray | None = None  # payload + header, filled by write()
    size: int = 0  # payload bytes in value (page_bytes, or less from write_blobs())


def _describe(exc: BaseException | ReplyError) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".strip()


def _failed(reply: Any) -> bool:
    """A per-item failure: no reply, a server error, or an exception object."""
    return reply is NO_REPLY or isinstance(reply, ReplyError | BaseException)


class RedisStore(StoreBackend):
    """A remote page store on Valkey/Redis.

    Options (see :class:`~kvtier.backends.remote_options.RemoteOptions`): ``url``,
    ``cluster``, ``key_prefix``, ``ttl_s``, ``batch_pages``, ``max_inflight``,
    ``op_timeout_s``, ``connect_timeout_s``, ``retry_interval_s``, ``username``,
    ``password``, ``tls``, ``tls_ca_certs``, ``tls_certfile``, ``tls_keyfile``,
    ``tls_verify``. Unknown or invalid options raise :class:`~kvtier.errors.ConfigError`
    naming the option.
    """

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
        self._pending: dict[int, _Pending] = {}
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
        large (one hop per batch). Also for a call that :meth:`close` is waiting for."""
        if nbytes < _OFFLOAD_BYTES:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

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
            failures = self.health.failed_batches
            async with sem:
                if self.health.failed_batches != failures:
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
                    async with asyncio.timeout(timeout):
                        replies = await send(client, chunk, time.monotonic() + timeout)
                    sent = True
                except Exception as exc:  # any failure of the batch makes it a miss
                    self.health.failed(_describe(exc))
                    return
                finally:
                    if not sent:  # failed (already reported) or cancelled before an outcome
                        self.health.probe_abandoned()
            broken = next((r for r in replies if _is_connection_error(r)), None)
            if broken is not None:
                self.health.failed(_describe(broken))
            else:
                self.health.succeeded()
            for i, reply in zip(chunk, replies, strict=True):
                results[i] = reply

        with self._using_client() as client:
            if n <= step:
                await one(client, 0)
            else:
                await asyncio.gather(*(one(client, s) for s in range(0, n, step)))
        return results

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

        if len(groups) == 1:  # one node (always, outside a cluster): no task to create
            [(address, idx)] = groups.items()
            await node(address, idx)
        else:
            # Every group runs to its end (or its aborted end) before this returns: no
            # thread is left writing into the caller's buffers.
            done = await asyncio.gather(*(node(a, idx) for a, idx in groups.items()),
                                        return_exceptions=True)  # fmt: skip
            failure = next((d for d in done if isinstance(d, BaseException)), None)
            if failure is not None:
                raise failure
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
            return [_as_reply(r) for r in await pipe.execute(raise_on_error=False)]

        async def send(client: Any, chunk: range, deadline: float) -> list[Any]:
            part = [items[i] for i in chunk]
            return await self._on_wire(
                client, part, [names[i] for i in chunk],
                lambda conn, its: send_pages(conn, its, nx, ttl), deadline, redirected,
            )  # fmt: skip

        return await self._batched(len(items), send)

    # -- the keyed, two-phase interface ----------------------------------------------------

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """``present`` reservations for keys already committed on the server; new ones
        while the client-side capacity lasts; ``None`` when full or the server fails."""
        self._check_keys(keys)
        self._check_open()
        found = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        )
        out: list[Reservation | None] = []
        for key, reply in zip(keys, found, strict=True):
            if _failed(reply):
                out.append(None)
                continue
            handle = self._next_handle
            self._next_handle += 1
            if reply:
                out.append(Reservation(key, handle, present=True))
            elif self.used_pages() < self.capacity_pages:
                self._pending[handle] = _Pending(key, namespace)
                out.append(Reservation(key, handle))
            else:
                out.append(None)
        return out

    def _pending_of(self, r: Reservation) -> _Pending | None:
        p = self._pending.get(r.handle)
        return p if p is not None and p.key == r.key else None

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Stage each page (payload + header) in a client-side buffer; nothing is sent
        before :meth:`commit`. ``False`` only for reservations no longer pending."""
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        self._check_open()
        return await self._stage(reservations, bufs)

    async def write_blobs(
        self, reservations: Sequence[Reservation], blobs: Sequence[Any]
    ) -> list[bool]:
        """:meth:`write` for blobs of 1 to ``page_bytes`` bytes: the value sent at commit
        is the blob and its header, no longer (read back with :meth:`get_sized`)."""
        bufs = check_blobs(blobs, len(reservations), self.page_bytes)
        self._check_open()
        return await self._stage(reservations, bufs)

    async def _stage(
        self, reservations: Sequence[Reservation], bufs: Sequence[np.ndarray]
    ) -> list[bool]:
        ok = [r.present for r in reservations]
        todo = [(i, p) for i, r in enumerate(reservations) if not r.present
                if (p := self._pending_of(r)) is not None]  # fmt: skip
        if not todo:
            return ok
        staged = [p.value for _, p in todo]
        fresh = self._take_buffers(sum(v is None for v in staged))
        values = [v if v is not None else fresh.pop() for v in staged]
        await self._cpu(
            lambda: self._fill(values, [p.key for _, p in todo], [p.namespace for _, p in todo],
                               [bufs[i] for i, _ in todo]),
            sum(bufs[i].nbytes for i, _ in todo),
        )  # fmt: skip
        for (i, p), value in zip(todo, values, strict=True):
            p.value = value
            p.size = bufs[i].nbytes
            ok[i] = True
        return ok

    def _release(self, handle: int) -> None:
        p = self._pending.pop(handle, None)
        if p is not None and p.value is not None:
            self._give_buffers([p.value])

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Publish written pages, each with one atomic ``SET`` (sent from the staged
        buffer without a copy); ``False`` where the page was not written, the server
        refused it (out of memory) or the batch failed. Every non-present reservation is
        released, committed or not."""
        self._check_open()
        ok = [r.present for r in reservations]
        todo: list[tuple[int, _Pending]] = []
        for i, r in enumerate(reservations):
            p = None if r.present else self._pending_of(r)
            if p is not None and p.value is not None:
                todo.append((i, p))
            elif p is not None:
                self._release(r.handle)
        if not todo:
            return ok
        items = [SetItem(self.page_name(p.key), byte_view(p.value[: p.size + HEADER_SIZE]))
                 for _, p in todo if p.value is not None]  # fmt: skip
        try:
            replies = await self._set_pages(items, nx=False)
        finally:
            for i, _ in todo:
                self._release(reservations[i].handle)
        self._settle([(i, reservations[i].key) for i, _ in todo], replies, ok)
        return ok

    def _settle(
        self, items: Sequence[tuple[int, PageKey]], replies: Sequence[Any], ok: list[bool]
    ) -> None:
        """Mark the ``SET`` replies of ``items`` in ``ok``; log refused writes once."""
        refusals: list[BaseException | ReplyError] = []
        for (i, key), reply in zip(items, replies, strict=True):
            if reply is NO_REPLY:
                continue
            if isinstance(reply, ReplyError | BaseException):
                refusals.append(reply)
                continue
            ok[i] = True
            if reply:  # stored now (an NX put answers None for a page already there)
                self._committed.add(key)
        if refusals:
            self.health.refused(len(refusals), _describe(refusals[0]))

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one round trip per batch: ``SET ... NX`` of the
        page and its header, sent straight from ``data`` (an existing page is kept, as the
        contract asks).

        Keys this client knows are committed answer ``True`` without sending anything.
        Capacity is checked before sending, so when this client is full a key committed
        by another client answers ``False`` (the two-phase path would find it present).
        """
        self._check_keys(keys)
        bufs = check_buffers(data, len(keys), self.page_bytes)
        self._check_open()
        ok = [False] * len(keys)
        first: dict[PageKey, int] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            if key in self._committed:
                ok[i] = True
            elif key not in first and self.used_pages() < self.capacity_pages:
                first[key] = i
                todo.append(i)
                self._putting += 1
        try:
            if todo:
                items = [SetItem(self.page_name(keys[i]), byte_view(bufs[i]), keys[i], namespace)
                         for i in todo]  # fmt: skip
                replies = await self._set_pages(items, nx=True)
                self._settle([(i, keys[i]) for i in todo], replies, ok)
        finally:
            self._putting -= len(todo)
        for i, key in enumerate(keys):
            if key in first and first[key] != i:
                ok[i] = ok[first[key]]  # the same key twice in one batch
        return ok

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        """Release reservations (nothing of them is on the server)."""
        self._check_open()
        for r in reservations:
            if self._pending_of(r) is not None:
                self._release(r.handle)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read each page straight into ``out[i]`` and verify it there; ``False`` for
        absent, evicted, unverifiable or unreachable pages (then ``out[i]`` is
        unspecified). No thread writes into ``out`` after this returns, cancelled or not.
        A shorter blob (:meth:`write_blobs`) is a miss here, deleted like a damaged page."""
        return [n is not None for n in await self._get(keys, out, sized=False)]

    async def get_sized(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[int | None]:
        """Read committed blobs (whole pages, or shorter ones from :meth:`write_blobs`)
        into the start of ``out[i]``; each one's length, or ``None`` for a miss, exactly
        as :meth:`get` decides it."""
        return await self._get(keys, out, sized=True)

    async def _get(
        self, keys: Sequence[PageKey], out: Sequence[Any], sized: bool
    ) -> list[int | None]:
        self._check_keys(keys)
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        self._check_open()
        names = [self.page_name(k) for k in keys]
        items = [GetItem(name, key, byte_view(buf))
                 for name, key, buf in zip(names, keys, bufs, strict=True)]  # fmt: skip

        async def redirected(client: Any, part: list[GetItem]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for it in part:
                pipe.get(it.name)
            values = await pipe.execute(raise_on_error=False)
            return await self._cpu(lambda: [_check_value(it, v, sized) for it, v in
                                            zip(part, values, strict=True)],
                                   len(part) * self.page_bytes)  # fmt: skip

        async def send(client: Any, chunk: range, deadline: float) -> list[Any]:
            return await self._on_wire(
                client, [items[i] for i in chunk], [names[i] for i in chunk],
                lambda conn, its: fetch_pages(conn, its, sized), deadline, redirected,
            )  # fmt: skip

        replies = await self._batched(len(keys), send)
        ok: list[int | None] = [None] * len(keys)
        bad: list[tuple[int, str]] = []
        for i, reply in enumerate(replies):
            if _failed(reply):
                continue  # batch failed, or a foreign value type under our key
            outcome, problem, length = reply
            if outcome is Fetched.HIT:
                ok[i] = length
            elif outcome is Fetched.ABSENT:
                self._committed.discard(keys[i])  # gone: evicted, expired or deleted
            else:
                bad.append((i, problem))
        if bad:
            for i, problem in bad:
                self.checksum_failures += 1
                log.warning("remote page %s failed verification, treated as a miss and "
                            "deleted: %s", keys[i].hex(), problem)  # fmt: skip
            await self.delete([keys[i] for i, _ in bad])
        return ok

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """Which keys are committed on the server (``False`` when it cannot answer)."""
        self._check_keys(keys)
        replies = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        )
        out: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            answered = not _failed(reply)
            hit = answered and reply == 1
            if answered and not hit:
                self._committed.discard(key)  # gone: evicted, expired or deleted
            out.append(hit)
        return out

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed keys; ``True`` where this call removed one."""
        self._check_keys(keys)
        replies = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.delete(self.page_name(k)))
        )
        out: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            if _failed(reply):
                out.append(False)
                continue
            self._committed.discard(key)
            out.append(reply == 1)
        return out

    async def keys(self) -> list[PageKey]:
        """Every committed page under this prefix on the server (a SCAN; slow on big
        pools). When the server cannot be reached the answer is empty (logged).

        This is the recovery call: the pages listed are adopted into the client-side
        count (:meth:`used_pages`), as the tier above now tracks them.
        """
        prefix = f"{self.options.key_prefix}:{{".encode()
        found: list[PageKey] = []

        async def scan(client: Any) -> None:
            async for name in client.scan_iter(match=prefix + b"*", count=1000):
                if not self._opened:
                    raise BackendClosedError(f"{type(self).__name__} closed during keys()")
                k = _parse_page_name(name, prefix)
                if k is not None:
                    found.append(k)

        with self._using_client() as client:
            try:
                await _with_deadline(scan(client), 30 * self.options.op_timeout_s)
            except BackendClosedError:
                raise
            except Exception as exc:
                self.health.failed(_describe(exc))
                return []
        self.health.succeeded()
        self._committed.update(found)
        return sorted(set(found))

    def used_pages(self) -> int:
        """Pages this client reserved, committed or adopted (:meth:`keys`) and still
        believes present."""
        return len(self._committed) + len(self._pending) + self._putting

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            options=self.options.public(),
            reserved_pages=len(self._pending),
            outages=self.health.outages,
            skipped_batches=self.health.skipped_batches,
            failed_batches=self.health.failed_batches,
            refused_writes=self.health.refused_writes,
            down=self.health.down,
            down_reason=self.health.reason,
            checksum_failures=self.checksum_failures,
            redirected_pages=self.redirects,
            data_connections_opened=0 if self._wire is None else self._wire.connects,
        )
        return out


def _as_reply(reply: Any) -> Any:
    """A redis-py pipeline reply in the data path's terms (errors become ReplyError)."""
    if isinstance(reply, BaseException) and not _is_connection_error(reply):
        return ReplyError(str(reply))
    return reply


def _check_value(item: GetItem, value: Any, sized: bool) -> Any:
    """Verify a value fetched through redis-py (after a redirection) and copy it into the
    item's buffer; the same outcomes as :func:`fetch_pages` (``sized``: a blob of 1 to
    ``len(item.out)`` bytes)."""
    if isinstance(value, BaseException):
        return _as_reply(value)
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


def _is_connection_error(reply: Any) -> bool:
    global _CONNECTION_ERRORS
    if not isinstance(reply, BaseException):
        return False
    if not _CONNECTION_ERRORS:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        _CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)
    return isinstance(reply, _CONNECTION_ERRORS)


def _parse_page_name(name: bytes, prefix: bytes) -> PageKey | None:
    """The key of ``<prefix>{<32 hex>}``, or ``None`` for anything else."""
    if not name.startswith(prefix) or len(name) != len(prefix) + 2 * KEY_BYTES + 1:
        return None
    if not name.endswith(b"}"):
        return None
    try:
        return PageKey(bytes.fromhex(name[len(prefix) : -1].decode()))
    except ValueError:
        return None


async def _with_deadline(aw: Awaitable[None], seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await aw
