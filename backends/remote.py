"""The remote tier on a Redis-protocol server: Valkey or Redis, single node or cluster.

:class:`RedisStore` keeps each page as one string value under ``<prefix>:{<key hex>}``:
the payload followed by the 64-byte header of :mod:`kvtier.pageformat` (key, length, xxh3
checksum), the same layout as the NVMe slots. The payload is sent straight from the
caller's buffer (redis-py sends a ``memoryview`` argument without copying it) and the
header is appended to it on the server, so writing a page copies nothing on the client;
reads are a plain ``GET`` (measured twice as fast as ``HMGET`` of a hash field).

Every read verifies the header and checksum; a page that does not verify, that the server
evicted, or that a failing server could not return is a miss, never wrong bytes.

**Two-phase put.** ``reserve`` checks which keys already exist (those are no-ops) and takes
client-side capacity; ``write`` stores the page under a private staging key
``<prefix>:{<hex>}:w:<token>`` (same hash slot as the final key, with a TTL so a crashed
writer leaves nothing behind for long); ``commit`` renames it to the final key in one
server-side script (atomic: readers see either no page or the whole page). Uncommitted data
is never under the final key, so ``get``/``contains``/``exists``/``keys`` cannot see it.

**Capacity.** ``capacity_pages`` bounds what *this client* has reserved and committed (the
pool is shared; the server's own ``maxmemory`` bounds it as a whole). Pages the server drops
on its own become misses and leave the client-side count when a read or ``contains``
notices they are gone.

**Failures.** Each pipelined batch (``batch_pages`` pages) has a deadline
(``op_timeout_s``); a batch that times out or cannot reach the server fails as a whole and
its pages count as misses (``False``/``None``), and the rest of that call is skipped. The
client reconnects by itself on the next call. An outage is logged once when it starts and
once when it ends (:class:`~kvtier.backends.remote_health.Health`). A server that is down
when the store opens is not an error: the store opens and misses until the server is up.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvtier.backend import Reservation, StoreBackend, check_buffers
from kvtier.errors import IntegrityError, KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

from .remote_health import Health
from .remote_options import RemoteOptions, parse_options

log = logging.getLogger("kvtier.backends.remote")

T = TypeVar("T")


#: Batches whose CPU work (checksums, copies) is at least this large run on the executor,
#: so the event loop never spends long on them (design invariant 7).
_OFFLOAD_BYTES = 1 << 20

# KEYS[1] staging key, KEYS[2] final key; ARGV[1] TTL in ms (0: none), ARGV[2] the exact
# length a complete page has, ARGV[3] 1 to keep an existing final key (the one-round-trip
# put, which cannot ask first), 0 to replace it (the two-phase path asked in reserve).
# 1: committed now; 2: the page is already committed (staging dropped); 0: nothing
# complete to commit (staging missing, evicted or short: a refused APPEND) -- dropped.
_COMMIT_SCRIPT = """
local staged = redis.call('STRLEN', KEYS[1])
if staged ~= tonumber(ARGV[2]) then
  if staged > 0 then redis.call('DEL', KEYS[1]) end
  if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
  return 0
end
if tonumber(ARGV[3]) == 1 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[1])
  return 2
end
redis.call('RENAME', KEYS[1], KEYS[2])
if tonumber(ARGV[1]) > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
else
  redis.call('PERSIST', KEYS[2])
end
return 1
"""


@dataclass
class _Pending:
    """A reservation between ``reserve`` and ``commit``/``abort``."""

    key: PageKey
    staging: bytes
    namespace: str
    sent: bool = False  # bytes may sit under the staging key (delete them on release)
    written: bool = False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".strip()


class RedisStore(StoreBackend):
    """A remote page store on Valkey/Redis (``redis.asyncio``, hiredis parser).

    Options (see :class:`~kvtier.backends.remote_options.RemoteOptions`): ``url``,
    ``cluster``, ``key_prefix``, ``ttl_s``, ``staging_ttl_s``, ``batch_pages``,
    ``max_inflight``, ``op_timeout_s``, ``connect_timeout_s``, ``username``, ``password``,
    ``tls``, ``tls_ca_certs``, ``tls_certfile``, ``tls_keyfile``, ``tls_verify``. Unknown or
    invalid options raise :class:`~kvtier.errors.ConfigError` naming the option.
    """

    default_io_threads: ClassVar[int] = 2

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
        self._token = uuid.uuid4().hex[:12]
        self._ttl_ms = 0 if self.options.ttl_s is None else max(1, round(self.options.ttl_s * 1e3))
        self._staging_ttl_ms = max(1, round(self.options.staging_ttl_s * 1e3))
        self.health = Health(self.options.public()["url"], log)
        self.checksum_failures = 0

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
        await super().open()

    async def close(self) -> None:
        """Drop pending reservations (their staging keys are deleted when the server is
        reachable, else they expire) and close the connections. Idempotent."""
        if self._client is not None:
            if self._pending and self._opened:
                staging = [p.staging for p in self._pending.values() if p.sent]
                if staging:
                    await self._pipelined(staging, lambda pipe, s: pipe.delete(s))
            self._pending.clear()
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
        """Run checksum/copy work inline when small, on the executor when large."""
        if nbytes < _OFFLOAD_BYTES:
            return fn()
        return await self.run_blocking(fn)

    async def _pipelined(
        self,
        items: Sequence[T],
        build: Callable[[Any, T], object],
        per_item: int = 1,
        on_chunk: Callable[[range, list[list[Any] | None]], Awaitable[None]] | None = None,
    ) -> list[list[Any] | None]:
        """Send ``build(pipe, item)`` for every item in pipelined batches.

        Returns, per item, its ``per_item`` replies (each a value or an exception object),
        or ``None`` when its whole batch failed (timeout, connection, cluster down).
        ``on_chunk(indices, results)`` runs as each batch's replies arrive, outside the
        concurrency bound, so that its CPU work overlaps the next batches' transfers.
        """
        self._check_open()
        results: list[list[Any] | None] = [None] * len(items)
        if not items:
            return results
        step = self.options.batch_pages
        client, sem = self._client, self._sem
        assert client is not None and sem is not None
        give_up = False

        async def one(start: int) -> None:
            nonlocal give_up
            chunk = range(start, min(start + step, len(items)))
            async with sem:
                if give_up:
                    return
                try:
                    async with asyncio.timeout(self.options.op_timeout_s):
                        pipe = client.pipeline(transaction=False)
                        for i in chunk:
                            build(pipe, items[i])
                        replies = await pipe.execute(raise_on_error=False)
                except Exception as exc:  # any failure of the batch makes it a miss
                    give_up = True
                    self.health.failed(_describe(exc))
                    return
            broken = next((r for r in replies if _is_connection_error(r)), None)
            if broken is not None:
                self.health.failed(_describe(broken))
            else:
                self.health.succeeded()
            for j, i in enumerate(chunk):
                results[i] = list(replies[j * per_item : (j + 1) * per_item])
            if on_chunk is not None:
                await on_chunk(chunk, results)

        await asyncio.gather(*(one(s) for s in range(0, len(items), step)))
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
                staging = self.page_name(key) + f":w:{self._token}:{handle}".encode()
                self._pending[handle] = _Pending(key, staging, namespace)
                out.append(Reservation(key, handle))
            else:
                out.append(None)
        return out

    def _pending_of(self, r: Reservation) -> _Pending | None:
        p = self._pending.get(r.handle)
        return p if p is not None and p.key == r.key else None

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Store each page under its staging key (zero-copy send); ``False`` where the
        server refused it (e.g. out of memory) or the batch failed."""
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        self._check_open()
        ok = [r.present for r in reservations]
        todo = [(i, p) for i, r in enumerate(reservations) if not r.present
                if (p := self._pending_of(r)) is not None]  # fmt: skip
        if not todo:
            return ok
        headers = await self._cpu(
            lambda: [encode_header(p.key, p.namespace, bufs[i]) for i, p in todo],
            len(todo) * self.page_bytes,
        )
        items = [(p.staging, h, bufs[i].data) for (i, p), h in zip(todo, headers, strict=True)]
        for _, p in todo:
            p.sent = True

        def build(pipe: Any, item: tuple[bytes, bytes, memoryview]) -> None:
            staging, header, payload = item
            pipe.set(staging, payload, px=self._staging_ttl_ms)
            pipe.append(staging, header)

        replies = await self._pipelined(items, build, per_item=2)
        refusals: list[BaseException] = []
        for (i, p), reply in zip(todo, replies, strict=True):
            if reply is None:
                continue
            err = next((x for x in reply if isinstance(x, BaseException)), None)
            if err is None:
                p.written = True
                ok[i] = True
            else:
                refusals.append(err)
        if refusals:
            self.health.refused(len(refusals), _describe(refusals[0]))
        return ok

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Publish written pages atomically (rename staging -> final, set TTL); ``False``
        where the page was not written, its staging data was evicted, or the batch failed.
        Every non-present reservation is released, committed or not."""
        self._check_open()
        ok = [r.present for r in reservations]
        todo: list[tuple[int, _Pending]] = []
        for i, r in enumerate(reservations):
            if r.present:
                continue
            p = self._pending_of(r)
            if p is not None and p.written:
                todo.append((i, p))
            elif p is not None:
                await self.abort([r])
        if not todo:
            return ok

        def build(pipe: Any, p: _Pending) -> None:
            pipe.eval(_COMMIT_SCRIPT, 2, p.staging, self.page_name(p.key), self._ttl_ms,
                      self.page_bytes + HEADER_SIZE, 0)  # fmt: skip

        replies = await self._pipelined([p for _, p in todo], build)
        for (i, p), reply in zip(todo, replies, strict=True):
            self._pending.pop(reservations[i].handle, None)
            if reply is not None and reply[0] in (1, 2):
                self._committed.add(p.key)
                ok[i] = True
        return ok

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one pipelined round trip per batch.

        Each page goes ``SET staging payload`` (zero-copy), ``APPEND staging header``,
        then the commit script, which publishes it only if it is complete and the key is
        not already committed (so an existing page is kept, as the contract asks). Keys
        this client knows are committed answer ``True`` without sending anything. The
        client-side capacity is checked before sending, so a key already committed by
        another client is refused (``False``) when this client is full.
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
            elif key in first:
                continue  # the same key twice in one batch: answered like the first
            elif self.used_pages() < self.capacity_pages:
                first[key] = i
                todo.append(i)
                self._putting += 1
        try:
            if todo:
                await self._put_now(keys, bufs, todo, namespace, ok)
        finally:
            self._putting -= len(todo)
        for i, key in enumerate(keys):
            if key in first and first[key] != i:
                ok[i] = ok[first[key]]
        return ok

    async def _put_now(
        self,
        keys: Sequence[PageKey],
        bufs: list[np.ndarray],
        todo: list[int],
        namespace: str,
        ok: list[bool],
    ) -> None:
        headers = await self._cpu(
            lambda: [encode_header(keys[i], namespace, bufs[i]) for i in todo],
            len(todo) * self.page_bytes,
        )
        full = self.page_bytes + HEADER_SIZE
        items = []
        for i, header in zip(todo, headers, strict=True):
            self._next_handle += 1
            name = self.page_name(keys[i])
            items.append((name, name + f":w:{self._token}:{self._next_handle}".encode(),
                          header, bufs[i].data))  # fmt: skip

        def build(pipe: Any, item: tuple[bytes, bytes, bytes, memoryview]) -> None:
            name, staging, header, payload = item
            pipe.set(staging, payload, px=self._staging_ttl_ms)
            pipe.append(staging, header)
            pipe.eval(_COMMIT_SCRIPT, 2, staging, name, self._ttl_ms, full, 1)

        replies = await self._pipelined(items, build, per_item=3)
        refusals: list[BaseException] = []
        for i, reply in zip(todo, replies, strict=True):
            if reply is None:
                continue
            err = next((x for x in reply if isinstance(x, BaseException)), None)
            if err is not None:
                refusals.append(err)
            elif reply[2] in (1, 2):
                ok[i] = True
                if reply[2] == 1:
                    self._committed.add(keys[i])
        if refusals:
            self.health.refused(len(refusals), _describe(refusals[0]))

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        """Release reservations; written staging data is deleted (best effort: if the
        server is unreachable it expires after ``staging_ttl_s``)."""
        self._check_open()
        staging: list[bytes] = []
        for r in reservations:
            p = self._pending_of(r)
            if p is not None:
                del self._pending[r.handle]
                if p.sent:
                    staging.append(p.staging)
        if staging:
            await self._pipelined(staging, lambda pipe, s: pipe.delete(s))

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

        await self._pipelined(keys, lambda pipe, k: pipe.get(self.page_name(k)), on_chunk=arrived)
        for i, problem in bad:
            self.checksum_failures += 1
            log.warning("remote page %s failed verification, treated as a miss: %s",
                        keys[i].hex(), problem)  # fmt: skip
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
        self._check_open()
        client = self._client
        assert client is not None
        prefix = f"{self.options.key_prefix}:{{".encode()
        found: list[PageKey] = []

        async def scan() -> None:
            async for name in client.scan_iter(match=prefix + b"*", count=1000):
                k = _parse_page_name(name, prefix)
                if k is not None:
                    found.append(k)

        try:
            await _with_deadline(scan(), 30 * self.options.op_timeout_s)
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
            failed_batches=self.health.failed_batches,
            refused_writes=self.health.refused_writes,
            down=self.health.down,
            checksum_failures=self.checksum_failures,
        )
        return out


def _is_connection_error(reply: Any) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(reply, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError)


def _parse_page_name(name: bytes, prefix: bytes) -> PageKey | None:
    """The key of ``<prefix>{<32 hex>}``, or ``None`` for anything else (staging keys)."""
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
