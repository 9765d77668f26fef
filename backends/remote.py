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
for one deadline each. A ``contains`` asked less than ``op_timeout_s`` after a failed
batch, while the server has not answered since, raises at once instead of waiting a second
deadline (the cache asks it right after a read that missed). A cancelled call returns only
once no thread writes into its buffers any more. The client reconnects by itself on the
next call. An outage is logged once when it starts and once when it ends
(:class:`~kvtier.health.Health`); a server refusing writes (out of memory)
is logged once per episode. A server that is down when the store opens is not an error:
the store opens and misses until the server is up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kvtier.backend import (
    BackendClosedError,
    Reservation,
    check_blobs,
    check_buffers,
)
from kvtier.errors import TierIOError
from kvtier.keys import PageKey
from kvtier.pageformat import HEADER_SIZE

from .remote_base import RedisStoreBase, log
from .remote_datapath import (
    Fetched,
    GetItem,
    SetItem,
    byte_view,
    fetch_pages,
)
from .remote_replies import (
    NO_REPLY,
    Pending,
    access_denied,
    as_reply,
    check_value,
    describe,
    failed,
    is_connection_error,
    parse_page_name,
    with_deadline,
)
from .remote_wire import ReplyError

__all__ = ["RedisStore"]


class RedisStore(RedisStoreBase):
    """A remote page store on Valkey/Redis.

    Options (see :class:`~kvtier.backends.remote_options.RemoteOptions`): ``url``,
    ``cluster``, ``key_prefix``, ``ttl_s``, ``batch_pages``, ``max_inflight``,
    ``op_timeout_s``, ``connect_timeout_s``, ``retry_interval_s``, ``username``,
    ``password``, ``tls``, ``tls_ca_certs``, ``tls_certfile``, ``tls_keyfile``,
    ``tls_verify``. Unknown or invalid options raise :class:`~kvtier.errors.ConfigError`
    naming the option.

    A ``get`` returns, cancelled or not, only once nothing writes into the caller's
    buffers any more (the data path waits for its aborted threads, and copies on the
    executor are waited for), so the cache awaits it without a task and shield.
    """

    get_finishes_before_raising: ClassVar[bool] = True

    # -- the keyed, two-phase interface ----------------------------------------------------

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """``present`` reservations for keys already committed on the server; new ones
        while the client-side capacity lasts; ``None`` when full or the server did not
        answer for the key. Raises :class:`~kvtier.errors.TierIOError` when it answered
        for none of them (down, frozen, refusing), or at once, asking nothing, while the
        server is down and a batch timed out less than ``op_timeout_s`` ago: the cache then
        counts the pages as failed and the tier as failing, not as a full tier."""
        self._check_keys(keys)
        self._check_open()
        self._refuse_if_failed_recently(len(keys), self._failed_recently(timed_out=True))
        found = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        )
        self._refuse_denied(found)
        if found and all(failed(r) for r in found):
            why = describe(found[0])
            raise TierIOError(
                f"remote store {self.health.name}: no answer for {len(keys)} of {len(keys)} "
                f"keys to reserve ({why})"
            )
        out: list[Reservation | None] = []
        for key, reply in zip(keys, found, strict=True):
            if failed(reply):
                out.append(None)
                continue
            handle = self._next_handle
            self._next_handle += 1
            if reply:
                out.append(Reservation(key, handle, present=True))
            elif self.used_pages() < self.capacity_pages:
                self._pending[handle] = Pending(key, namespace)
                out.append(Reservation(key, handle))
            else:
                out.append(None)
        return out

    def _refuse_if_failed_recently(self, n: int, ago: float | None) -> None:
        """Raise :class:`~kvtier.errors.TierIOError` at once, sending nothing, when the
        server is down and a batch failed ``ago`` seconds ago (:meth:`_failed_recently`;
        for a write-down's reserve only a timeout counts, so a restarted server is asked
        at once): a question sent now would wait out a deadline for an answer it cannot
        use (the batches count as skipped)."""
        if n and ago is not None:
            self.health.skipped_batches += -(-n // self._step)
            raise TierIOError(
                f"remote store {self.health.name}: no answer for {n} of {n} keys (not asked: "
                f"the server is down ({self.health.reason}) and a batch failed {ago:.2f} s "
                f"ago, within op_timeout_s={self.options.op_timeout_s:g})"
            )

    def _pending_of(self, r: Reservation) -> Pending | None:
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
        todo: list[tuple[int, Pending]] = []
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
        """Mark the ``SET`` replies of ``items`` in ``ok``; log refused writes once.

        Raises:
            TierIOError: the server refuses this client (``NOAUTH`` or ``NOPERM``:
                :meth:`_refuse_denied`): a failing tier naming the cause, not a full
                server.
        """
        refusals: list[BaseException | ReplyError] = []
        self._refuse_denied(replies)
        for (i, key), reply in zip(items, replies, strict=True):
            if reply is NO_REPLY or is_connection_error(reply):
                continue  # its batch or node failed (the store's health has it)
            if isinstance(reply, ReplyError | BaseException):
                refusals.append(reply)
                continue
            ok[i] = True
            if reply:  # stored now (an NX put answers None for a page already there)
                self._committed.add(key)
        if refusals:
            self.health.refused(len(refusals), describe(refusals[0]))

    def _refuse_denied(self, replies: Sequence[Any]) -> None:
        """Raise :class:`TierIOError` naming the fix when a reply says the server refuses
        this client (:data:`ACCESS_DENIED`): no password, or an ACL denying the prefix."""
        denied = next((r for r in map(as_reply, replies) if access_denied(r)), None)
        if denied is None:
            return
        prefix = self.options.key_prefix
        fix = (
            f"its ACL must let this user read and write keys '{prefix}:*' (ACL SETUSER ... "
            f"'~{prefix}:*' +@write +@read), or set 'key_prefix' to one it may use"
            if isinstance(denied, ReplyError) and denied.prefix == "NOPERM"
            else "give the server's password in the tier's 'password' option or in the URL"
        )
        raise TierIOError(f"remote store {self.health.name} refuses this client: {denied} ({fix})")

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
            return await self._cpu(lambda: [check_value(it, v, sized) for it, v in
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
            if isinstance(reply, ReplyError) and reply.prefix == "WRONGTYPE":
                # a list, hash, ... under our page's name: no page, and it would stay a
                # "cached" page for lookups and block every store of the key
                bad.append((i, f"the key holds another type of value ({reply})"))
                continue
            if failed(reply):
                continue  # batch failed
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
        """Which keys are committed on the server.

        Raises :class:`~kvtier.errors.TierIOError` when the server did not answer for
        some key (down, frozen, refusing): ``False`` would tell the cache the page is
        gone, and it would forget pages the server still holds.

        While the server is down and a batch failed less than ``op_timeout_s`` ago, nothing
        is sent: it raises at once (the batches count as skipped). The cache asks this right
        after a read or delete that missed; asking a frozen server would make that one call
        wait a second deadline for an answer it cannot use.
        """
        self._check_keys(keys)
        self._check_open()
        self._refuse_if_failed_recently(len(keys), self._failed_recently())
        replies = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.exists(self.page_name(k)))
        )
        unanswered = [r for r in replies if failed(r)]
        if unanswered:
            why = describe(unanswered[0])
            raise TierIOError(
                f"remote store {self.health.name}: no answer for {len(unanswered)} of "
                f"{len(keys)} keys ({why})"
            )
        for key, reply in zip(keys, replies, strict=True):
            if reply != 1:
                self._committed.discard(key)  # gone: evicted, expired or deleted
        return [reply == 1 for reply in replies]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed keys; ``True`` where this call removed one."""
        self._check_keys(keys)
        replies = await self._batched(
            len(keys), self._pipelined(keys, lambda pipe, k: pipe.delete(self.page_name(k)))
        )
        out: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            if failed(reply):
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
                k = parse_page_name(name, prefix)
                if k is not None:
                    found.append(k)

        with self._using_client() as client:
            try:
                await with_deadline(scan(client), 30 * self.options.op_timeout_s)
            except BackendClosedError:
                raise
            except Exception as exc:
                self._failed(describe(exc))
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
