"""The remote tier on a Redis-protocol server: Valkey or Redis, single node or cluster.

:class:`RedisStore` keeps each page as one string value under ``<prefix>:{<key hex>}``:
the payload followed by the 64-byte header of :mod:`kvtier.pageformat` (key, length, xxh3
checksum), the same layout as the NVMe slots. Reads are a plain pipelined ``GET``
(measured twice as fast as ``HMGET`` of hash fields), verified before the bytes are
copied out; a page that does not verify, that the server evicted, or that a failing server
could not return is a miss, never wrong bytes (a page that fails verification is also
deleted, so that it can be stored again).

**Two-phase put: the value reaches the server only at commit.** ``reserve`` asks which
keys already exist (those are no-ops) and takes client-side capacity; ``write`` copies the
page and its header into a client-side buffer (the one copy a header+payload value needs;
the caller may reuse its buffer at once); ``commit`` sends each buffer in one ``SET``
(zero-copy: redis-py sends a ``memoryview`` without copying it). A ``SET`` is atomic, so
readers see either no page or the whole page, and uncommitted data is never on the server
for ``get``/``contains``/``exists``/``keys`` to see. :meth:`RedisStore.put` does the same in
one round trip (``SET ... NX``: a page already there is kept).

**Capacity.** ``capacity_pages`` bounds what *this client* has reserved and committed (the
pool is shared; the server's own ``maxmemory`` bounds it as a whole). Pages the server drops
on its own become misses and leave the client-side count when a read or ``contains``
notices they are gone.

**Failures.** Each pipelined batch (``batch_pages`` pages, by default 16 MiB) has a deadline
(``op_timeout_s``); a batch that times out or cannot reach the server fails as a whole and
its pages count as misses (``False``/``None``), and batches (of any call) still waiting for
a pipeline slot then are skipped, so that during an outage calls miss within about one
deadline instead of queueing for one deadline each. The
client reconnects by itself on the next call. An outage is logged once when it starts and
once when it ends (:class:`~kvtier.backends.remote_health.Health`); a server refusing
writes (out of memory) is logged once per episode. A server that is down when the store
opens is not an error: the store opens and misses until the server is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvtier.backend import BackendClosedError, Reservation, StoreBackend, check_buffers
from kvtier.errors import IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

from .remote_health import Health
from .remote_options import RemoteOptions, parse_options, pipeline_pages

log = logging.getLogger("kvtier.backends.remote")

T = TypeVar("T")

#: Batches whose verify-and-copy work is at least this large run on the executor, so the
#: event loop never spends long on them (design invariant 7); below it an executor hop
#: (100 us to milliseconds on a loaded machine) costs more than the work.
_OFFLOAD_BYTES = 4 << 20
#: Most bytes of idle value buffers kept for reuse between calls.
_SPARE_BYTES = 64 << 20


@dataclass
class _Pending:
    """A reservation between ``reserve`` and ``commit``/``abort``."""

    key: PageKey
    namespace: str
    value: np.ndarray | None = None  # payload + header, filled by write()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".strip()


class RedisStore(StoreBackend):
    """A remote page store on Valkey/Redis (``redis.asyncio``, hiredis parser).

    Options (see :class:`~kvtier.backends.remote_options.RemoteOptions`): ``url``,
    ``cluster``, ``key_prefix``, ``ttl_s``, ``batch_pages``, ``max_inflight``,
    ``op_timeout_s``, ``connect_timeout_s``, ``username``, ``password``, ``tls``,
    ``tls_ca_certs``, ``tls_certfile``, ``tls_keyfile``, ``tls_verify``. Unknown or invalid
    options raise :class:`~kvtier.errors.ConfigError` naming the option.
    """

    default_io_threads: ClassVar[int] = 2
    shared: ClassVar[bool] = True  # one pool, many servers

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
        self._client: Any = None
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

    async def open(self) -> None:
        """Create the client (no connection is made yet: a server that is down now is
        not an error; calls miss until it is up)."""
        if self._client is None:
            if self.options.cluster:
                from redis.asyncio.cluster import RedisCluster

                self._client = RedisCluster.from_url(self._url(), **self._client_kwargs())
            else:
                from redis.asyncio import Redis

                self._client = Redis.from_url(self._url(), **self._client_kwargs())
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
        """Copy each page and its header into its value buffer (one batch, one call)."""
        size = self.page_bytes
        for value, key, ns, page in zip(values, keys, namespace, pages, strict=True):
            value[:size] = page
            value[size:] = np.frombuffer(encode_header(key, ns, page), dtype=np.uint8)

    def _set_kwargs(self, nx: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"nx": nx}
        if self._ttl_ms:
            kwargs["px"] = self._ttl_ms
        return kwargs

    async def _pipelined(
        self,
        items: Sequence[T],
        build: Callable[[Any, T], object],
        per_item: int = 1,
        *,
        before: Callable[[range], Awaitable[None]] | None = None,
        after: Callable[[range, list[list[Any] | None]], Awaitable[None]] | None = None,
    ) -> list[list[Any] | None]:
        """Send ``build(pipe, item)`` for every item in pipelined batches.

        Returns, per item, its ``per_item`` replies (each a value or an exception object),
        or ``None`` when its whole batch failed (timeout, connection, cluster down) or was
        skipped: a batch waiting for a pipeline slot (``max_inflight``) while another batch
        of any call failed is not sent, so that during an outage every call misses within
        one deadline instead of queueing for one deadline per wave of batches.
        ``before(indices)`` prepares a batch (inside the concurrency bound, before its
        deadline starts); ``after(indices, results)`` runs as each batch's replies arrive,
        outside the bound. Both let CPU work on one batch overlap other batches' transfers.
        """
        self._check_open()
        results: list[list[Any] | None] = [None] * len(items)
        if not items:
            return results
        step = self._step
        sem = self._sem
        assert sem is not None

        async def one(client: Any, start: int) -> None:
            chunk = range(start, min(start + step, len(items)))
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
                    async with asyncio.timeout(self.options.op_timeout_s):
                        pipe = client.pipeline(transaction=False)
                        for i in chunk:
                            build(pipe, items[i])
                        replies = await pipe.execute(raise_on_error=False)
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
            for j, i in enumerate(chunk):
                results[i] = list(replies[j * per_item : (j + 1) * per_item])
            if after is not None:
                await after(chunk, results)

        with self._using_client() as client:
            await asyncio.gather(*(one(client, s) for s in range(0, len(items), step)))
        return results

    # -- the keyed, two-phase interface ----------------------------------------------------

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """``present`` reservations for keys already committed on the server; new ones
        while the client-side capacity lasts; ``None`` when full or the server fails."""
        self._check_keys(keys)
        self._check_open()
        found = await self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        out: list[Reservation | None] = []
        for key, reply in zip(keys, found, strict=True):
            if reply is None or isinstance(reply[0], BaseException):
                out.append(None)
                continue
            handle = self._next_handle
            self._next_handle += 1
            if reply[0]:
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
            len(todo) * self.page_bytes,
        )  # fmt: skip
        for (i, p), value in zip(todo, values, strict=True):
            p.value = value
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
        kwargs = self._set_kwargs(nx=False)

        def build(pipe: Any, p: _Pending) -> None:
            assert p.value is not None
            pipe.set(self.page_name(p.key), p.value.data, **kwargs)

        try:
            replies = await self._pipelined([p for _, p in todo], build)
        finally:
            for i, _ in todo:
                self._release(reservations[i].handle)
        self._settle([(i, reservations[i].key) for i, _ in todo], replies, ok)
        return ok

    def _settle(
        self, items: Sequence[tuple[int, PageKey]], replies: list[list[Any] | None],
        ok: list[bool],
    ) -> None:  # fmt: skip
        """Mark the ``SET`` replies of ``items`` in ``ok``; log refused writes once."""
        refusals: list[BaseException] = []
        for (i, key), reply in zip(items, replies, strict=True):
            if reply is None:
                continue
            if isinstance(reply[0], BaseException):
                refusals.append(reply[0])
                continue
            ok[i] = True
            if reply[0]:  # stored now (an NX put answers None for a page already there)
                self._committed.add(key)
        if refusals:
            self.health.refused(len(refusals), _describe(refusals[0]))

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one round trip per batch: ``SET ... NX`` of the
        page and its header (an existing page is kept, as the contract asks).

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
        values = self._take_buffers(len(todo))
        try:
            if todo:
                await self._put_now(keys, bufs, todo, values, namespace, ok)
        finally:
            self._putting -= len(todo)
            self._give_buffers(values)
        for i, key in enumerate(keys):
            if key in first and first[key] != i:
                ok[i] = ok[first[key]]  # the same key twice in one batch
        return ok

    async def _put_now(
        self,
        keys: Sequence[PageKey],
        bufs: list[np.ndarray],
        todo: list[int],
        values: list[np.ndarray],
        namespace: str,
        ok: list[bool],
    ) -> None:
        kwargs = self._set_kwargs(nx=True)
        filled: set[int] = set()

        async def fill(chunk: range) -> None:  # per batch, so copies overlap transfers
            await self._cpu(
                lambda: self._fill([values[j] for j in chunk], [keys[todo[j]] for j in chunk],
                                   [namespace] * len(chunk), [bufs[todo[j]] for j in chunk]),
                len(chunk) * self.page_bytes,
            )  # fmt: skip
            filled.update(chunk)

        def build(pipe: Any, j: int) -> None:
            assert j in filled
            pipe.set(self.page_name(keys[todo[j]]), values[j].data, **kwargs)

        replies = await self._pipelined(list(range(len(todo))), build, before=fill)
        self._settle([(i, keys[i]) for i in todo], replies, ok)

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        """Release reservations (nothing of them is on the server)."""
        self._check_open()
        for r in reservations:
            if self._pending_of(r) is not None:
                self._release(r.handle)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read and verify each page into ``out[i]``; ``False`` for absent, evicted,
        unverifiable or unreachable pages (then ``out[i]`` is unspecified)."""
        self._check_keys(keys)
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        self._check_open()
        size = self.page_bytes
        ok = [False] * len(keys)
        bad: list[tuple[int, str]] = []

        def verify_and_copy(fetched: list[tuple[int, bytes]]) -> None:
            for i, value in fetched:
                view = memoryview(value)
                try:
                    if len(view) != size + HEADER_SIZE:
                        raise IntegrityError(f"stored value is {len(view)} bytes, expected "
                                             f"{size + HEADER_SIZE}")  # fmt: skip
                    verify_page(view[size:], keys[i], view[:size])
                except IntegrityError as exc:
                    bad.append((i, str(exc)))
                    continue
                np.copyto(bufs[i], np.frombuffer(view[:size], dtype=np.uint8))
                ok[i] = True

        async def arrived(chunk: range, replies: list[list[Any] | None]) -> None:
            fetched: list[tuple[int, bytes]] = []
            for i in chunk:
                reply = replies[i]
                if reply is None or isinstance(reply[0], BaseException):
                    continue  # batch failed, or a foreign value type under our key
                if reply[0] is None:
                    self._committed.discard(keys[i])  # gone: evicted, expired or deleted
                    continue
                fetched.append((i, reply[0]))
                replies[i] = None  # let the bytes go as soon as they are copied
            await self._cpu(lambda: verify_and_copy(fetched), len(fetched) * size)

        await self._pipelined(keys, lambda pipe, k: pipe.get(self.page_name(k)), after=arrived)
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
        replies = await self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        out: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            answered = reply is not None and not isinstance(reply[0], BaseException)
            hit = answered and reply is not None and reply[0] == 1
            if answered and not hit:
                self._committed.discard(key)  # gone: evicted, expired or deleted
            out.append(hit)
        return out

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed keys; ``True`` where this call removed one."""
        self._check_keys(keys)
        replies = await self._pipelined(keys, lambda pipe, k: pipe.delete(self.page_name(k)))
        out: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            if reply is None or isinstance(reply[0], BaseException):
                out.append(False)
                continue
            self._committed.discard(key)
            out.append(reply[0] == 1)
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
        )
        return out


def _is_connection_error(reply: Any) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(reply, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError)


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
