"""The sequence manager: block tables of one namespace on top of a KVCache (see
:mod:`kvtier.sequences`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.attention import page_tensor, torch_dtype
from kvtier.backend import ArenaBackend, Reservation
from kvtier.errors import CapacityError, KVTierUsageError, TierIOError
from kvtier.index.block_table import (
    PAD_SLOT,
    BlockTables,
    Page,
    SlotPool,
    check_token_ids,
)
from kvtier.keys import ROOT_KEY, Namespace, PageKey, page_keys
from kvtier.log import get_logger
from kvtier.sequences.types import (
    WORKING_KEYS,
    WORKING_NAMESPACE,
    PageCache,
    PageFaultError,
    ResidentBatch,
    SequenceStats,
)
from kvtier.spec import KVSpec

_log = get_logger("kvtier.sequences")


class SequenceManager:
    """Block tables of one namespace over a KVCache. See the module docstring.

    Create with :meth:`open` (reserves the working pool); :meth:`close` gives it back.

    Args:
        cache: an open :class:`kvtier.cache.KVCache` whose top tier is an arena.
        working_pages: slots of the top tier reserved for running sequences.
        max_tokens: longest sequence allowed (``None``: unbounded).
    """

    def __init__(self, cache: PageCache, working_pages: int, max_tokens: int | None = None) -> None:
        if isinstance(working_pages, bool) or not isinstance(working_pages, int):
            raise KVTierUsageError(f"working_pages must be an int, got {working_pages!r}")
        if working_pages < 1:
            raise KVTierUsageError(f"working_pages must be >= 1, got {working_pages}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise KVTierUsageError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        top = cache.tiers[0]
        if not isinstance(top.backend, ArenaBackend):
            raise KVTierUsageError(
                f"the top tier {top.name!r} must be a memory arena to hold running sequences"
            )
        self.cache = cache
        self.spec: KVSpec = cache.spec
        self.namespace: Namespace = cache.namespace
        self.top_tier: str = top.name
        self.arena: ArenaBackend = top.backend
        self.working_pages = working_pages
        self.max_tokens = max_tokens
        self.stats = SequenceStats()
        self._reservations: list[Reservation] = []
        self._tables: BlockTables | None = None
        self._lock = asyncio.Lock()
        self._dtype = torch_dtype(self.spec)

    @classmethod
    async def open(
        cls, cache: PageCache, working_pages: int, max_tokens: int | None = None
    ) -> SequenceManager:
        """Build a manager and reserve its working pool in the cache's top tier.

        Raises :class:`CapacityError` when the top tier cannot give ``working_pages``.
        """
        self = cls(cache, working_pages, max_tokens)
        await self._reserve_pool()
        return self

    async def _reserve_pool(self) -> None:
        keys = [WORKING_KEYS.next() for _ in range(self.working_pages)]
        try:
            got = await self.cache.reserve_private(keys, WORKING_NAMESPACE)
        except CapacityError as exc:
            raise CapacityError(
                f"top tier {self.top_tier!r} cannot give the {self.working_pages} working "
                f"pages asked for: {exc}"
            ) from None
        self._reservations = got
        self._tables = BlockTables(
            self.spec.page_tokens,
            SlotPool(r.handle for r in got),
            self._copy_page,
            self.max_tokens,
        )

    async def close(self) -> None:
        """Free every sequence and give the working pool back. Idempotent, and a no-op
        but for its own state once the cache has closed (which took the pool back).

        Raises:
            KVTierUsageError: called from another thread or event loop than the cache's.
        """
        async with self._lock:
            if self._tables is None:
                return
            if self.cache.is_open:
                self.cache.check_usable()
            for seq in self._tables.seq_ids():
                self._tables.free(seq)
            self._tables = None
            reservations, self._reservations = self._reservations, []
            if self.cache.is_open:
                await self.cache.release_private(reservations)

    async def __aenter__(self) -> SequenceManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def tables(self) -> BlockTables:
        """The block tables (read-only use). Every operation reads them before it changes
        anything, so this is where a call is checked.

        Raises:
            KVTierUsageError: the manager or its cache is closed, or the call comes from
                another thread or event loop than the cache's.
        """
        if self._tables is None:
            raise KVTierUsageError("SequenceManager is closed (or was never opened)")
        self.cache.check_usable()
        return self._tables

    # -- bytes ---------------------------------------------------------------------------

    def page(self, slot: int) -> torch.Tensor:
        """The top-tier page in ``slot`` as a ``page_shape`` tensor (no copy)."""
        return page_tensor(self.arena.tensor(slot), self.spec)

    def _page_rows(self, slots: list[int]) -> list[np.ndarray]:
        """The pages in ``slots`` as host rows for :meth:`KVCache.store_pages`: the slots'
        own views in a host arena (no copy; the tier's write then skips it), one
        device-to-host copy of them all in an arena without host views (``hbm``)."""
        if self.arena.host_addressable:
            return [self.arena.view(slot) for slot in slots]
        on_device = torch.stack([self.arena.tensor(slot) for slot in slots])
        return list(on_device.cpu().numpy())

    def _copy_page(self, src: int, dst: int, tokens: int) -> None:
        self.page(dst)[:, :, :tokens] = self.page(src)[:, :, :tokens]

    def _check_kv(self, kv: Any, n: int) -> torch.Tensor:
        if isinstance(kv, np.ndarray) and (kv.dtype.kind not in "biufc" or not kv.dtype.isnative):
            raise KVTierUsageError(
                f"kv must hold numbers in native byte order, got a numpy array of {kv.dtype}"
            )
        t = torch.from_numpy(kv) if isinstance(kv, np.ndarray) else kv
        if not isinstance(t, torch.Tensor):
            raise KVTierUsageError(f"kv must be a torch tensor or numpy array, got {type(kv)}")
        # append copies only after the block table took the tokens: a tensor the copy
        # cannot read would leave tokens whose KV was never written (and publish them)
        if t.layout != torch.strided:
            raise KVTierUsageError(f"kv must be a dense (strided) tensor, got {t.layout}")
        if t.device.type == "meta":
            raise KVTierUsageError("kv is a meta tensor: it holds no data")
        s = self.spec
        want = (s.num_layers, s.kv_factor, n, s.num_kv_heads, s.head_dim)
        if tuple(t.shape) != want:
            raise KVTierUsageError(
                f"kv for {n} tokens must have shape [layers, kv, tokens, heads, dim] = "
                f"{list(want)}, got {list(t.shape)}"
            )
        if t.dtype != self._dtype:
            raise KVTierUsageError(f"kv must have dtype {self._dtype}, got {t.dtype}")
        return t

    # -- lifecycle -----------------------------------------------------------------------

    def create(self) -> int:
        """A new empty sequence; returns its id."""
        return self.tables.create()

    async def append(self, seq_id: int, tokens: Any, kv: Any) -> None:
        """Append tokens and their KV (``[layers, kv, len(tokens), heads, dim]``, the spec
        dtype). Full pages outside any speculative step are stored in the cache at once.
        All-or-nothing on bad input or :class:`CapacityError` (working pool full)."""
        async with self._lock:
            ids = check_token_ids(tokens)
            self._write_append(seq_id, ids, self._check_kv(kv, len(ids)))
            await self._publish(seq_id)

    def _prepare_append(self, seq_id: int, tokens: Any, kv: Any) -> tuple[list[int], torch.Tensor]:
        """Validate an append without changing anything: raises what :meth:`append`
        would raise before writing (bad ids or KV, unknown sequence, too long, no room)."""
        ids = check_token_ids(tokens)
        t = self._check_kv(kv, len(ids))
        self.tables.check_append(seq_id, len(ids))
        return ids, t

    def _write_append(self, seq_id: int, ids: list[int], t: torch.Tensor) -> None:
        """Append checked ids and KV to the table and the working slots (no await)."""
        tables = self.tables
        before = tables.cow_copies
        for w in tables.append(seq_id, ids):
            self.page(w.slot)[:, :, w.offset : w.offset + w.count] = t[
                :, :, w.src_start : w.src_start + w.count
            ]
        self.stats.cow_copies += tables.cow_copies - before

    async def adopt_prefix(self, seq_id: int, tokens: Any) -> int:
        """Start the empty sequence ``seq_id`` with the longest cached prefix of
        ``tokens`` (prefix reuse: a shared system prompt, an earlier turn). Returns the
        number of tokens adopted; the engine appends the rest with their KV. Adopted
        pages are stored pages: :meth:`ensure_resident` faults them in."""
        async with self._lock:
            ids = check_token_ids(tokens)
            self.tables.table(seq_id)  # unknown id -> clear error before any I/O
            found = await self.cache.lookup(np.asarray(ids, dtype=np.int64))
            keys = list(found.keys)
            if self.max_tokens is not None:
                keys = keys[: self.max_tokens // self.spec.page_tokens]
            n = len(keys) * self.spec.page_tokens
            self.tables.adopt(seq_id, ids[:n], keys)
            self.stats.pages_adopted += len(keys)
            return n

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing all pages of ``seq_id`` (copy-on-write)."""
        return self.tables.fork(seq_id)

    def snapshot(self, seq_id: int) -> int:
        """Record ``seq_id`` before a speculative step; returns the version id."""
        return self.tables.snapshot(seq_id)

    async def rollback(self, seq_id: int, version: int) -> int:
        """Restore the version exactly; returns working pages freed."""
        async with self._lock:
            return self._rollback_tables(seq_id, version)

    def _rollback_tables(self, seq_id: int, version: int) -> int:
        freed = self.tables.rollback(seq_id, version)
        self.stats.rollbacks += 1
        self.stats.pages_discarded += freed
        return freed

    async def commit(self, seq_id: int, version: int, keep: int | None = None) -> int:
        """Accept what was appended since the version (the first ``keep`` tokens only,
        when given); newly verified full pages are stored. Returns working pages freed."""
        async with self._lock:
            freed = self._commit_tables(seq_id, version, keep)
            await self._publish(seq_id)
            return freed

    def _commit_tables(self, seq_id: int, version: int, keep: int | None) -> int:
        """The table part of :meth:`commit` (no await); the caller then publishes."""
        tables = self.tables
        before = tables.cow_copies
        freed = tables.commit(seq_id, version, keep)
        self.stats.cow_copies += tables.cow_copies - before
        self.stats.pages_discarded += freed
        return freed

    async def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Cut a sequence without live versions to ``num_tokens`` tokens, e.g. to
        recompute pages a fault lost (cut at a page boundary inside stored pages).
        Returns working pages freed."""
        async with self._lock:
            return self.tables.truncate(seq_id, num_tokens)

    async def free(self, seq_id: int) -> int:
        """Finish a sequence; its working pages go back to the pool (stored pages stay
        cached). Returns working pages freed."""
        async with self._lock:
            return self.tables.free(seq_id)

    # -- publishing ----------------------------------------------------------------------

    async def _publish(self, seq_id: int) -> None:
        tables = self.tables
        todo = tables.publishable(seq_id)
        if not todo:
            return
        table = tables.table(seq_id)
        pt = self.spec.page_tokens
        first = todo[0][0]
        parent = table.pages[first - 1].key if first else ROOT_KEY
        if parent is None:  # pragma: no cover - publishable() guarantees order
            raise AssertionError("publishing a page whose parent is not stored")
        last = todo[-1][0]
        keys = page_keys(table.tokens[first * pt : (last + 1) * pt], self.namespace, parent)
        by_lp = dict(zip(range(first, last + 1), keys, strict=True))
        pages = [p for _, p in todo]
        page_keys_ = [by_lp[lp] for lp, _ in todo]
        parents = [by_lp.get(lp - 1, parent) for lp, _ in todo]
        views = self._page_rows([p.slot for p in pages])
        try:
            ok = await self.cache.store_pages(page_keys_, views, parents=parents)
        except (CapacityError, TierIOError) as exc:
            # The top tier cannot take them now (pinned full, failing): the pages stay in
            # the working pool, whole and usable, and are stored by a later call.
            self.stats.publish_failures += 1
            _log.info("pages not stored yet", seq_id=seq_id, pages=len(pages), cause=str(exc))
            return
        for page, key, stored in zip(pages, page_keys_, ok, strict=True):
            if not stored:
                self.stats.publish_failures += 1
                break  # keep order: later pages chain from this one
            tables.mark_published(page, key)
            self.stats.pages_published += 1

    async def publish_pending(self, seq_id: int) -> int:
        """Store the full verified pages of ``seq_id`` that an earlier store could not
        take (every append and commit also retries them). Returns pages stored."""
        async with self._lock:
            before = self.stats.pages_published
            await self._publish(seq_id)
            return self.stats.pages_published - before

    # -- page faults ---------------------------------------------------------------------

    async def ensure_resident(self, seq_ids: Sequence[int]) -> ResidentBatch:
        """Bring every page of ``seq_ids`` to the top tier, pinned; returns the table.

        One batched load (pinning) for all stored pages. Raises
        :class:`PageFaultError` (naming the lost pages) or :class:`CapacityError`; in
        both cases nothing stays pinned.
        """
        if isinstance(seq_ids, str | bytes) or not hasattr(seq_ids, "__iter__"):
            raise KVTierUsageError(
                f"seq_ids must be a sequence of sequence ids, got {type(seq_ids).__name__}"
            )
        async with self._lock:
            tables = self.tables
            ids = list(seq_ids)
            bad = [s for s in ids if isinstance(s, bool) or not isinstance(s, int | np.integer)]
            if bad:
                raise KVTierUsageError(f"sequence ids must be ints, got {bad[0]!r:.40}")
            if len(set(ids)) != len(ids):
                raise KVTierUsageError(f"sequence ids repeat in {ids}")
            rows = [tables.table(s) for s in ids]
            wanted: list[PageKey] = []
            seen: set[PageKey] = set()
            # Stored pages come from the cache, pinned, even while a working copy lingers
            # (another sequence's commit may give that slot back while the table is out).
            for t in rows:
                for p in t.pages:
                    if p.key is not None and p.key not in seen:
                        seen.add(p.key)
                        wanted.append(p.key)
            slot_of_key: dict[PageKey, int] = {}
            missing_keys: set[PageKey] = set()
            if wanted:
                result = await self.cache.load(wanted, pin=True)
                pinned = [k for k, s in zip(wanted, result.slots, strict=True) if s is not None]
                for k, s in zip(wanted, result.slots, strict=True):
                    if s is None:
                        missing_keys.add(k)
                    else:
                        slot_of_key[k] = s
                missing_keys.update(result.missing)
                if missing_keys:
                    # load pins every key asked for, found or not
                    await self.cache.release(wanted)
                    missing = {
                        s: [i for i, p in enumerate(t.pages) if p.key in missing_keys]
                        for s, t in zip(ids, rows, strict=True)
                    }
                    missing = {s: lps for s, lps in missing.items() if lps}
                    self.stats.fault_errors += 1
                    raise PageFaultError(missing)
                self.stats.pages_loaded += len(wanted)
            else:
                pinned = []

            def slot_of(p: Page) -> int:
                return p.slot if p.key is None else slot_of_key[p.key]

            table = tables.pack(ids, slot_of)
            self.stats.resident_calls += 1
            return ResidentBatch(ids, table, [t.num_tokens for t in rows], pinned, owner=self)

    @contextlib.asynccontextmanager
    async def resident(self, seq_ids: Sequence[int]) -> AsyncIterator[ResidentBatch]:
        """``async with manager.resident(seqs) as batch:``: :meth:`ensure_resident`, and
        :meth:`release` on the way out."""
        batch = await self.ensure_resident(seq_ids)
        try:
            yield batch
        finally:
            await self.release(batch)

    async def release(self, batch: ResidentBatch) -> None:
        """Unpin what :meth:`ensure_resident` pinned. Releasing twice, or through another
        manager, raises (and changes nothing)."""
        if not isinstance(batch, ResidentBatch):
            raise KVTierUsageError(
                f"release needs the ResidentBatch ensure_resident returned, got "
                f"{type(batch).__name__}"
            )
        if batch.owner is not None and batch.owner is not self:
            raise KVTierUsageError(
                "this resident batch was made by another SequenceManager: release it there"
            )
        if batch.released:
            raise KVTierUsageError("this resident batch was already released")
        if batch.pinned:
            await self.cache.release(batch.pinned)
        batch.released = True

    # -- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if a page is leaked or freed while referenced: every
        working slot in use is held by a live page, and every live page's count equals
        its holders."""
        tables = self.tables
        live = tables.live_pages()
        holders: dict[int, int] = dict.fromkeys(live, 0)
        for s in tables.seq_ids():
            t = tables.table(s)
            for p in t.pages:
                holders[p.pid] += 1
            for v in t.versions:
                for p in v.pages:
                    holders[p.pid] += 1
        for pid, p in live.items():
            if p.refs != holders[pid]:
                raise AssertionError(f"{p!r} counts {p.refs} holders, has {holders[pid]}")
            if p.slot == PAD_SLOT and p.key is None:
                raise AssertionError(f"{p!r} has neither a working slot nor a key")
        used = {p.slot for p in live.values() if p.slot != PAD_SLOT}
        if used != set(tables.pool.used()):
            raise AssertionError(
                f"working slots in use {sorted(tables.pool.used())} != held {sorted(used)}"
            )
