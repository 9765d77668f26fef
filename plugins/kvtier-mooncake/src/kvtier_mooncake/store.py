"""The remote tier on Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

Each page is one object ``<prefix>/<32 hex digits>`` holding the payload followed by the
64-byte header of :mod:`kvtier.pageformat`; reads verify it (a mismatch is a miss).

**Two-phase put without a rename.** Mooncake has no atomic rename, so nothing reaches the
store before commit: ``reserve`` takes a slot of a registered staging buffer, ``write``
copies the page and its header into it, ``commit`` sends every written slot in one
``batch_upsert_from`` (zero-copy from the registered buffer). ``upsert``, not ``put``:
Mooncake's ``put`` on an existing key silently keeps the old object, which would keep a
page that failed verification forever. Uncommitted pages exist only in this process.

**Removal and leases.** A read grants a lease (the master's ``default_kv_lease_ttl``,
10 s by default) during which removal fails. :meth:`MooncakeStore.delete` retries such
keys until ``op_timeout_s``; what is still leased then answers ``False``. A read that
outlasts its lease (``LEASE_EXPIRED``: a slow transfer under load) is retried once in the
same hop, under a new lease; if it fails again it is a miss and the page is *kept* (only
``OBJECT_NOT_FOUND`` means a page is gone).

**Listing.** Mooncake cannot list keys, so :meth:`keys` answers the keys this process
committed that still exist; pages do not survive a reopen in the index (they may still be
in the pool and are found again by ``contains``/``get``).

Blocking client calls run on the backend's executor, one hop per batch, each bounded by
``op_timeout_s``; a failing master makes pages misses, logged once per outage. A worker
thread cannot be stopped, so a hop past its deadline runs on: it keeps the registered
slots it uses until it returns (later calls wait for them at most ``op_timeout_s``), and a
read copies into the caller's buffers only after its fetch finished in time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvtier.backend import Medium, Reservation, StoreBackend, check_buffers
from kvtier.errors import ConfigError, IntegrityError, KVTierUsageError, TierIOError
from kvtier.health import Health
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.pageformat import HEADER_SIZE, encode_header, verify_page

log = logging.getLogger("kvtier_mooncake.store")

T = TypeVar("T")

#: Mooncake error codes the store interprets.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
OBJECT_ALREADY_EXISTS = -705
#: A read that outlasted its lease fails with this: the lease must exceed the slowest
#: batch transfer (``read_pages`` pages), or large pages on a slow link are misses.
LEASE_EXPIRED = -707
#: Prefix of a read problem that says nothing about the page (an error code other than
#: OBJECT_NOT_FOUND, e.g. an expired lease twice): a miss that keeps the page.
TRANSIENT = "transient:"

#: Copies out of the read slots at least this large run on the executor (design invariant
#: 7); smaller ones run inline, where an executor hop would cost more than the copy.
_OFFLOAD_COPY_BYTES = 4 << 20
#: Registered memory for staged writes and for reads when their page counts are 0 (auto).
STAGING_BYTES = 64 << 20
READ_BYTES = 32 << 20

_DEFAULTS: dict[str, Any] = {
    "master": None,
    "metadata_server": None,
    "local_hostname": "127.0.0.1",
    "protocol": "tcp",
    "device_name": "",
    "segment_bytes": 0,
    "staging_pages": 0,  # 0: as many as fit in STAGING_BYTES
    "read_pages": 0,  # 0: as many as fit in READ_BYTES
    "key_prefix": "kvtier",
    "op_timeout_s": 5.0,
}


def _options(raw: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(raw) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"mooncake: unknown option(s) {', '.join(unknown)}; known: {', '.join(_DEFAULTS)}"
        )
    opts = {**_DEFAULTS, **raw}
    for name in ("master", "metadata_server"):
        if not isinstance(opts[name], str) or not opts[name]:
            raise ConfigError(f"mooncake option {name!r} is required (got {opts[name]!r})")
    if not opts["metadata_server"].startswith(("http://", "etcd://", "P2PHANDSHAKE")):
        raise ConfigError(
            f"mooncake option 'metadata_server' must be an http:// URL, got "
            f"{opts['metadata_server']!r}"
        )
    for name in ("segment_bytes", "staging_pages", "read_pages"):
        try:
            opts[name] = int(opts[name])
        except (TypeError, ValueError):
            raise ConfigError(f"mooncake option {name!r} must be an integer") from None
        if opts[name] < 0:
            raise ConfigError(f"mooncake option {name!r} is out of range: {opts[name]}")
    try:
        opts["op_timeout_s"] = float(opts["op_timeout_s"])
    except (TypeError, ValueError):
        raise ConfigError("mooncake option 'op_timeout_s' must be a number") from None
    if opts["op_timeout_s"] <= 0:
        raise ConfigError("mooncake option 'op_timeout_s' must be > 0")
    prefix = opts["key_prefix"]
    if not isinstance(prefix, str) or not prefix or any(c.isspace() for c in prefix):
        raise ConfigError(f"mooncake option 'key_prefix' must be a word, got {prefix!r}")
    return opts


class _Slots:
    """``n`` page slots in one buffer registered with the Mooncake client."""

    def __init__(self, n: int, slot_bytes: int) -> None:
        self.count = n
        self.slot_bytes = slot_bytes
        self.buf = np.zeros(n * slot_bytes, dtype=np.uint8)
        self.free = list(range(n - 1, -1, -1))

    def view(self, i: int) -> np.ndarray:
        return self.buf[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def ptr(self, i: int) -> int:
        return int(self.buf.ctypes.data) + i * self.slot_bytes


class MooncakeStore(StoreBackend):
    """A remote page store on Mooncake Store (TCP or RDMA transfer engine).

    Options: ``master`` (``host:port`` of ``mooncake_master``, required),
    ``metadata_server`` (``http://host:port/metadata``, required), ``local_hostname``
    (the address other clients reach this one at; default 127.0.0.1), ``protocol``
    (``tcp``/``rdma``), ``device_name`` (RDMA devices), ``segment_bytes`` (memory this
    client lends to the pool; 0 = a pure client), ``staging_pages`` (reservations in flight;
    0: 64 MiB worth), ``read_pages`` (pages per read batch; 0: 32 MiB worth), ``key_prefix``,
    ``op_timeout_s``.
    """

    medium: ClassVar[Medium] = Medium.NETWORK

    default_io_threads: ClassVar[int] = 2
    shared: ClassVar[bool] = True  # one pool, many servers
    #: Pause between removal attempts of keys still under a read lease.
    _RETRY_REMOVE_EVERY_S = 0.05

    def __init__(
        self,
        *,
        page_bytes: int,
        capacity_pages: int,
        io_threads: int | None = None,
        **options: Any,
    ) -> None:
        self.options = _options(options)
        super().__init__(
            page_bytes=page_bytes, capacity_pages=capacity_pages, io_threads=io_threads
        )
        self._client: Any = None
        self._slot_bytes = page_bytes + HEADER_SIZE
        self._staging: _Slots | None = None
        self._reads: _Slots | None = None
        self._read_lock = asyncio.Lock()
        self._pending: dict[int, tuple[PageKey, str, bool]] = {}  # slot -> key, ns, written
        self._committed: set[PageKey] = set()
        self._last_setup_try = 0.0
        self._setup: asyncio.Future[Any] | None = None
        self._hops: set[asyncio.Task[Any]] = set()  # executor calls not finished yet
        self.health = Health(f"mooncake://{self.options['master']}", log)
        self.checksum_failures = 0
        self.transient_read_failures = 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
        except ImportError as exc:
            return (
                "the mooncake package is not importable "
                f"(pip install 'kvtier-mooncake[tcp]'): {exc}"
            )
        return None

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Register the staging and read buffers and connect. A master that is down is
        not an error: calls miss and the connection is retried (at most once a second)."""
        if self._opened:
            return
        await super().open()
        self._staging = _Slots(self._slots("staging_pages", STAGING_BYTES), self._slot_bytes)
        self._reads = _Slots(self._slots("read_pages", READ_BYTES), self._slot_bytes)
        await self._ensure_client()

    def _slots(self, option: str, budget: int) -> int:
        """Slots of a registered buffer: the option, or as many as ``budget`` holds."""
        n = int(self.options[option])
        return n if n > 0 else max(4, budget // self._slot_bytes)

    def _setup_blocking(self) -> Any:
        from mooncake.store import MooncakeDistributedStore

        o = self.options
        client = MooncakeDistributedStore()
        rc = client.setup(
            o["local_hostname"], o["metadata_server"], o["segment_bytes"], 16 << 20,
            o["protocol"], o["device_name"], o["master"],
        )  # fmt: skip
        if rc != 0:
            raise ConnectionError(f"setup failed with code {rc}")
        assert self._staging is not None and self._reads is not None
        for slots in (self._staging, self._reads):
            rc = client.register_buffer(slots.ptr(0), slots.buf.nbytes)
            if rc != 0:
                client.close()
                raise ConnectionError(f"register_buffer failed with code {rc}")
        return client

    async def _master_reachable(self) -> bool:
        """A quick TCP connect to the master: a dead master fails fast here instead of
        tying up a worker thread inside the client's own (minutes-long) retries."""
        host, _, port = self.options["master"].rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host or "127.0.0.1", int(port)),
                min(1.0, self.options["op_timeout_s"]),
            )
        except (OSError, TimeoutError, ValueError):
            return False
        writer.close()
        return True

    async def _ensure_client(self) -> Any:
        """The connected client, or ``None`` while the master cannot be reached (then
        the attempt is repeated at most once a second)."""
        if self._client is not None:
            return self._client
        if self._setup is not None and not self._setup.done():
            return None  # a slow setup is still running
        now = time.monotonic()
        if now - self._last_setup_try < 1.0:
            return None
        self._last_setup_try = now
        if not await self._master_reachable():
            self.health.failed(f"master {self.options['master']} is not reachable")
            return None
        # setup() can block for minutes when the master stops answering: run it on a
        # daemon thread of its own so that neither close() nor interpreter exit waits.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                client = self._setup_blocking()
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, client, None)

        self._setup = fut
        threading.Thread(target=run, name="kvtier-mooncake-setup", daemon=True).start()
        try:
            async with asyncio.timeout(self.options["op_timeout_s"]):  # not wait_for: _bounded
                await asyncio.shield(fut)
        except Exception as exc:
            self.health.failed(f"cannot connect: {exc or type(exc).__name__}")
            return None
        finally:  # adopted now, or when it connects late; closed if the store closed
            if fut.done():
                self._adopt_client(fut)
            else:
                fut.add_done_callback(self._adopt_client)
        if self._client is None:
            return None  # the store closed meanwhile
        self.health.succeeded()
        return self._client

    def _adopt_client(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        if self._opened and self._client is None:
            self._client = fut.result()
        else:
            threading.Thread(target=fut.result().close, daemon=True).start()

    async def close(self) -> None:
        """Disconnect and release buffers, in at most about ``op_timeout_s``. Idempotent.
        Calls made from here on raise :class:`~kvtier.backend.BackendClosedError`.

        Closing the client under a call still inside it crashes the process, so calls in
        flight are waited for (at most ``op_timeout_s``); one stuck longer (a frozen pool)
        leaves the client to be closed, on a thread of its own, when the last returns.
        """
        self._opened = False  # before the first await: no call reconnects meanwhile
        client, self._client = self._client, None
        self._pending.clear()
        executor, self._executor = self._executor, None
        hops = list(self._hops)
        if hops:
            await asyncio.wait(hops, timeout=self.options["op_timeout_s"])
        stuck = [h for h in hops if not h.done()]
        if client is not None and stuck:
            _close_after(client, stuck)
        elif client is not None and executor is not None:
            loop = asyncio.get_running_loop()
            try:
                closing = loop.run_in_executor(executor, client.close)
                await asyncio.wait_for(closing, self.options["op_timeout_s"])
            except Exception as exc:
                log.debug("mooncake close failed: %r", exc)
        if executor is not None:  # a call stuck in a dead master must not block close()
            executor.shutdown(wait=False, cancel_futures=True)
        await super().close()

    # -- helpers ---------------------------------------------------------------------------

    def _hop(self, fn: Callable[..., T], *args: Any) -> asyncio.Task[T]:
        """Start ``fn(*args)`` on the executor (one hop) as a task that runs to its end.

        A worker thread cannot be stopped: a hop that outlives its caller's deadline (or
        its caller) still runs, and writes into whatever memory it was given. The task is
        done only when the thread is, so what a hop uses (registered slots) is given back
        from its done callbacks, never when the caller stops waiting.
        """
        task = asyncio.ensure_future(self.run_blocking(fn, *args))
        task.add_done_callback(_retrieve)
        self._hops.add(task)
        task.add_done_callback(self._hops.discard)
        return task

    async def _bounded(self, hop: asyncio.Task[T]) -> T:
        """Wait at most ``op_timeout_s`` for ``hop`` (TimeoutError past it); the hop itself
        is never cancelled. A cancellation of the caller always raises (Python 3.11's
        ``asyncio.wait_for`` returned the hop's result instead when the hop ended as the
        cancellation came)."""
        async with asyncio.timeout(self.options["op_timeout_s"]):
            return await asyncio.shield(hop)

    async def _client_now(self) -> Any:
        """The client, or ``None`` (an outage recorded) while the master is unreachable."""
        self._check_open()
        client = await self._ensure_client()
        if client is None:
            return None
        if self.health.down and not await self._master_reachable():
            self.health.failed(f"master {self.options['master']} is not reachable")
            return None
        return client

    async def _outcome(self, what: str, hop: asyncio.Task[T]) -> T | None:
        """``hop``'s result within ``op_timeout_s``, or ``None`` (an outage recorded)."""
        try:
            out = await self._bounded(hop)
        except Exception as exc:
            self.health.failed(f"{what}: {type(exc).__name__}: {exc}")
            return None
        self.health.succeeded()
        return out

    async def _with_client(
        self, what: str, fn: Callable[[Any], T], on_done: Callable[[], None] | None = None
    ) -> T | None:
        """Run ``fn(client)`` in one hop bounded by ``op_timeout_s``; ``None`` (and an
        outage) when the master cannot be reached or the call fails. ``on_done`` (which
        gives back the memory ``fn`` uses) runs once no thread uses it any more: at once
        when no hop started, when the hop ends otherwise (perhaps after this returns)."""
        hop: asyncio.Task[T] | None = None
        try:
            client = await self._client_now()
            if client is None:
                return None
            hop = self._hop(fn, client)
            if on_done is not None:
                hop.add_done_callback(lambda _: on_done())
            return await self._outcome(what, hop)
        finally:
            if hop is None and on_done is not None:
                on_done()

    async def _batch(
        self, method: str, *args: Any, on_done: Callable[[], None] | None = None
    ) -> list[int] | None:
        """Call a ``batch_*`` client method (see :meth:`_with_client`)."""
        return await self._with_client(
            method, lambda client: list(getattr(client, method)(*args)), on_done
        )

    def name(self, key: PageKey) -> str:
        """The Mooncake object key of a page."""
        return f"{self.options['key_prefix']}/{key.hex()}"

    def _check_keys(self, keys: Sequence[PageKey]) -> None:
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise KVTierUsageError(f"key {i} must be {KEY_BYTES} bytes, got {k!r:.60}")

    # -- the keyed, two-phase interface --------------------------------------------------------

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        self._check_keys(keys)
        self._check_open()
        if not keys:
            return []
        found = await self._batch("batch_is_exist", [self.name(k) for k in keys])
        assert self._staging is not None
        out: list[Reservation | None] = []
        for i, key in enumerate(keys):
            if found is None or found[i] < 0:
                out.append(None)
            elif found[i] == 1:
                out.append(Reservation(key, -1, present=True))
            elif self.used_pages() < self.capacity_pages and self._staging.free:
                slot = self._staging.free.pop()
                self._pending[slot] = (key, namespace, False)
                out.append(Reservation(key, slot))
            else:
                out.append(None)
        return out

    def _pending_of(self, r: Reservation) -> tuple[PageKey, str, bool] | None:
        p = self._pending.get(r.handle)
        return p if p is not None and p[0] == r.key else None

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        self._check_open()
        staging = self._staging
        assert staging is not None
        todo = [i for i, r in enumerate(reservations)
                if not r.present and self._pending_of(r) is not None]  # fmt: skip

        def fill() -> None:
            for i in todo:
                r = reservations[i]
                key, ns, _ = self._pending[r.handle]
                slot = staging.view(r.handle)
                slot[: self.page_bytes] = bufs[i]
                slot[self.page_bytes :] = np.frombuffer(encode_header(key, ns, bufs[i]), np.uint8)

        await self.run_blocking(fill)
        for i in todo:
            r = reservations[i]
            key, ns, _ = self._pending[r.handle]
            self._pending[r.handle] = (key, ns, True)
        filled = set(todo)
        return [r.present or i in filled for i, r in enumerate(reservations)]

    def _release(self, slot: int) -> None:
        if self._pending.pop(slot, None) is not None:
            assert self._staging is not None
            self._staging.free.append(slot)

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self._check_open()
        ok = [r.present for r in reservations]
        todo: list[int] = []
        for i, r in enumerate(reservations):
            p = None if r.present else self._pending_of(r)
            if p is not None and p[2]:
                todo.append(i)
            elif p is not None:
                self._release(r.handle)
        if not todo:
            return ok
        staging = self._staging
        assert staging is not None
        slots = [reservations[i].handle for i in todo]
        names = [self.name(reservations[i].key) for i in todo]
        ptrs = [staging.ptr(slot) for slot in slots]
        try:
            codes = await self._batch(
                "batch_upsert_from", names, ptrs, [self._slot_bytes] * len(todo),
                on_done=functools.partial(staging.free.extend, slots),  # once no thread sends them
            )  # fmt: skip
        finally:
            for slot in slots:
                self._pending.pop(slot, None)
        for j, i in enumerate(todo):
            r = reservations[i]
            if codes is not None and codes[j] == 0:
                self._committed.add(r.key)
                ok[i] = True
        return ok

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        """Reserve, write and commit in one executor hop per batch: copy into staging
        slots, then ``batch_put_from`` (Mooncake's ``put`` keeps an existing object, which
        is what putting a committed key must do). Keys this process knows are committed
        answer ``True`` without a call; capacity is checked before sending."""
        self._check_keys(keys)
        bufs = check_buffers(data, len(keys), self.page_bytes)
        self._check_open()
        staging = self._staging
        assert staging is not None
        ok = [False] * len(keys)
        first: dict[PageKey, int] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            if key in self._committed:
                ok[i] = True
            elif key not in first and self.used_pages() + len(todo) < self.capacity_pages:
                first[key] = i
                todo.append(i)
        while todo:
            slots = [staging.free.pop() for _ in range(min(len(todo), len(staging.free)))]
            if not slots:
                break  # every staging slot is in use by pending reservations
            batch, todo = todo[: len(slots)], todo[len(slots) :]
            for slot, i in zip(slots, batch, strict=True):
                self._pending[slot] = (keys[i], namespace, True)

            def send(client: Any, batch: list[int] = batch, slots: list[int] = slots) -> list[int]:
                for slot, i in zip(slots, batch, strict=True):
                    view = staging.view(slot)
                    view[: self.page_bytes] = bufs[i]
                    header = encode_header(keys[i], namespace, bufs[i])
                    view[self.page_bytes :] = np.frombuffer(header, np.uint8)
                names = [self.name(keys[i]) for i in batch]
                ptrs = [staging.ptr(slot) for slot in slots]
                return list(client.batch_put_from(names, ptrs, [self._slot_bytes] * len(batch)))

            try:
                # the slots go back once no thread fills or sends them
                codes = await self._with_client(
                    "batch_put_from", send, on_done=functools.partial(staging.free.extend, slots)
                )
            finally:
                for slot in slots:
                    self._pending.pop(slot, None)
            for j, i in enumerate(batch):
                if codes is not None and codes[j] in (0, OBJECT_ALREADY_EXISTS):
                    ok[i] = True
                    if codes[j] == 0:
                        self._committed.add(keys[i])
        for i, key in enumerate(keys):
            if key in first and first[key] != i:
                ok[i] = ok[first[key]]  # the same key twice in one batch
        return ok

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self._check_open()
        for r in reservations:
            if not r.present and self._pending_of(r) is not None:
                self._release(r.handle)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read and verify each page into ``out[i]``; ``False`` for absent, unverifiable
        or unreachable pages.

        Batches go through the registered read slots, one at a time: fetched and verified
        in one hop bounded by ``op_timeout_s``, then copied out. A fetch past its deadline
        is a miss and never writes into ``out`` later; it keeps the read slots (later reads
        wait for it at most ``op_timeout_s``, then miss) until its thread is done.
        """
        self._check_keys(keys)
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        self._check_open()
        reads = self._reads
        assert reads is not None
        ok = [False] * len(keys)
        if not keys:
            return ok
        lock = self._read_lock
        try:
            async with asyncio.timeout(self.options["op_timeout_s"]):
                await lock.acquire()
        except TimeoutError:
            self.health.failed("the read slots are still held by a read past its deadline")
            return ok
        hop: asyncio.Task[Any] | None = None  # the last hop that used the read slots
        try:
            for start in range(0, len(keys), reads.count):
                chunk = list(range(start, min(start + reads.count, len(keys))))
                client = await self._client_now()
                if client is None:
                    break
                hop = self._hop(self._fetch, client, reads, [keys[i] for i in chunk])
                checked = await self._outcome("batch_get_into", hop)
                if checked is None:
                    break
                targets = [(j, bufs[i]) for j, i in enumerate(chunk) if checked[j] is None]
                if len(targets) * self.page_bytes >= _OFFLOAD_COPY_BYTES:
                    hop = self._hop(self._copy_out, reads, targets)
                    await asyncio.shield(hop)
                else:  # an executor hop costs more than copying this little
                    self._copy_out(reads, targets)
                for i, problem in zip(chunk, checked, strict=True):
                    if problem is None:
                        ok[i] = True
                    elif problem == "absent":
                        self._committed.discard(keys[i])
                    elif problem.startswith(TRANSIENT):  # a miss; the page stays
                        self.transient_read_failures += 1
                    else:
                        self.checksum_failures += 1
                        log.warning("mooncake page %s failed verification: %s",
                                    keys[i].hex(), problem)  # fmt: skip
        finally:
            if hop is None or hop.done():
                lock.release()
            else:  # the slots are in use until that thread returns
                hop.add_done_callback(lambda _: lock.release())
        return ok

    def _fetch(self, client: Any, reads: _Slots, keys: list[PageKey]) -> list[str | None]:
        """Fetch ``keys`` into the first read slots and verify them (worker thread): per
        key ``None`` when the slot holds the verified page, else ``"absent"`` or what
        failed verification."""
        got = list(
            client.batch_get_into(
                [self.name(k) for k in keys],
                [reads.ptr(j) for j in range(len(keys))],
                [self._slot_bytes] * len(keys),
            )
        )
        expired = [j for j, code in enumerate(got) if code == LEASE_EXPIRED]
        if expired:  # a transfer outlived its lease: once more, under a new lease
            again = client.batch_get_into(
                [self.name(keys[j]) for j in expired],
                [reads.ptr(j) for j in expired],
                [self._slot_bytes] * len(expired),
            )
            for j, code in zip(expired, again, strict=True):
                got[j] = code
        problems: list[str | None] = []
        for j, key in enumerate(keys):
            if got[j] == OBJECT_NOT_FOUND:
                problems.append("absent")
                continue
            if got[j] < 0:
                problems.append(f"{TRANSIENT}{got[j]}")
                continue
            slot = reads.view(j)
            try:
                if got[j] != self._slot_bytes:
                    raise IntegrityError(f"object is {got[j]} bytes")
                verify_page(slot[self.page_bytes :], key, slot[: self.page_bytes])
            except IntegrityError as exc:
                problems.append(str(exc))
                continue
            problems.append(None)
        return problems

    def _copy_out(self, reads: _Slots, targets: list[tuple[int, np.ndarray]]) -> None:
        """Copy verified pages from read slots to the caller's buffers (worker thread)."""
        for j, buf in targets:
            np.copyto(buf, reads.view(j)[: self.page_bytes])

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_keys(keys)
        self._check_open()
        if not keys:
            return []
        found = await self._batch("batch_is_exist", [self.name(k) for k in keys])
        # no answer (the master is down) or an error code is not "gone": answering False
        # would make the cache forget pages the store still holds
        unanswered = len(keys) if found is None else sum(1 for f in found if f not in (0, 1))
        if found is None or unanswered:
            raise TierIOError(
                f"mooncake store: no answer for {unanswered} of {len(keys)} keys "
                "(batch_is_exist failed)"
            )
        for k, f in zip(keys, found, strict=True):
            if f == 0:
                self._committed.discard(k)
        return [f == 1 for f in found]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove pages; keys under a lease are retried until ``op_timeout_s``.

        Any access (``get``, ``contains``, even a failed check) grants a lease, so the
        retry loop only calls ``remove`` (which does not extend it).
        """
        self._check_keys(keys)
        self._check_open()
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        deadline = time.monotonic() + self.options["op_timeout_s"]
        while todo:
            codes = await self._batch("batch_remove", [self.name(keys[i]) for i in todo])
            if codes is None:
                break
            retry = []
            for i, code in zip(todo, codes, strict=True):
                if code == 0:
                    out[i] = True
                if code in (0, OBJECT_NOT_FOUND):
                    self._committed.discard(keys[i])
                else:
                    retry.append(i)
            todo = retry
            if not todo or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self._RETRY_REMOVE_EVERY_S)  # a lease is still held
        return out

    async def keys(self) -> list[PageKey]:
        """Keys committed by this process that still exist (Mooncake cannot list keys)."""
        self._check_open()
        known = sorted(self._committed)
        present = await self.contains(known) if known else []
        return [k for k, p in zip(known, present, strict=True) if p]

    def used_pages(self) -> int:
        return len(self._committed) + len(self._pending)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            master=self.options["master"],
            outages=self.health.outages,
            failed_batches=self.health.failed_batches,
            down=self.health.down,
            down_reason=self.health.reason,
            checksum_failures=self.checksum_failures,
            transient_read_failures=self.transient_read_failures,
        )
        return out


def _close_after(client: Any, hops: list[asyncio.Task[Any]]) -> None:
    """Close ``client`` on a daemon thread once every one of ``hops`` has returned."""
    left = set(hops)

    def one_done(hop: asyncio.Task[Any]) -> None:
        left.discard(hop)
        if not left:
            threading.Thread(target=client.close, name="kvtier-mooncake-close", daemon=True).start()

    for hop in hops:
        hop.add_done_callback(one_done)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a hop's exception as seen (a hop past its deadline has no one awaiting it)."""
    if not task.cancelled():
        task.exception()


def _settle(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
