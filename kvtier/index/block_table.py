"""Block tables: per sequence, logical page number -> page, with forks and versions.

Pure bookkeeping on the event-loop thread (pages and the working pool are in
:mod:`kvtier.index.pages`): it decides which pages a sequence points to, when a page must
be copied, published or freed; the caller (:mod:`kvtier.sequences`) moves the bytes.

Reference counts and copy-on-write
    Every holder of a page counts: each block table that points to it and each snapshot
    that does. A page is written only while exactly one table holds it; a write to a page
    with more holders first copies it (:meth:`BlockTables.append`). So a page's contents,
    once shared, never change, and ``Page.filled`` is the same for every holder. A
    working page whose count drops to zero gives its slot back at once; a published page
    stays in the cache (the prefix cache keeps it for reuse until evicted).

Versions (speculative decoding)
    ``snapshot`` records a table (holding its pages); ``rollback`` restores it exactly and
    drops every page written since; ``commit`` accepts what was written since (optionally
    only the first ``keep`` tokens). Versions form a stack per sequence: rolling back or
    committing a version consumes it and every newer one. Tokens past the oldest live snapshot are
    *unverified*: pages holding any are never reported by :meth:`BlockTables.publishable`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.pages import (
    PAD_SLOT,
    BlockTable,
    Page,
    PageWrite,
    SequenceFinishedError,
    SequenceLengthError,
    SlotPool,
    UnknownSequenceError,
    Version,
    VersionError,
    check_int,
    check_token_ids,
    pack_slots,
)
from kvtier.keys import PageKey

__all__ = [
    "PAD_SLOT",
    "BlockTable",
    "BlockTables",
    "Page",
    "PageWrite",
    "SequenceFinishedError",
    "SequenceLengthError",
    "SlotPool",
    "UnknownSequenceError",
    "VersionError",
    "check_token_ids",
    "pack_slots",
]


class BlockTables:
    """The block tables of every sequence of one namespace, with page reference counts.

    Args:
        page_tokens: tokens per page.
        pool: the working pool pages are allocated from.
        copy_page: ``copy_page(src_slot, dst_slot, tokens)`` copies the first ``tokens``
            token positions of one working slot into another (copy-on-write).
        max_tokens: the longest a sequence may grow (``None``: unbounded).
    """

    def __init__(
        self,
        page_tokens: int,
        pool: SlotPool,
        copy_page: Callable[[int, int, int], None],
        max_tokens: int | None = None,
    ) -> None:
        if page_tokens <= 0:
            raise KVTierUsageError(f"page_tokens must be > 0, got {page_tokens}")
        if max_tokens is not None and max_tokens <= 0:
            raise KVTierUsageError(f"max_tokens must be > 0, got {max_tokens}")
        self.page_tokens = page_tokens
        self.pool = pool
        self.max_tokens = max_tokens
        self._copy_page = copy_page
        self._tables: dict[int, BlockTable] = {}
        self._finished: set[int] = set()  # freed ids, for a clear error on reuse
        self._seq_ids = itertools.count(1)
        self._pids = itertools.count(1)
        self._vids = itertools.count(1)
        #: Pages copied on write (a shared partial page written or cut).
        self.cow_copies = 0
        #: Stored pages still holding a working slot: a holder may yet cut inside them.
        self._stored_with_slot: dict[int, Page] = {}

    # -- lookup --------------------------------------------------------------------------

    def table(self, seq_id: int) -> BlockTable:
        """The table of ``seq_id``; :class:`SequenceFinishedError` if it was freed,
        :class:`UnknownSequenceError` if there never was one."""
        try:
            return self._tables[seq_id]
        except (KeyError, TypeError):
            # an unhashable id is unknown, not a TypeError from the set lookup below
            if isinstance(seq_id, int | np.integer) and seq_id in self._finished:
                raise SequenceFinishedError(
                    f"sequence {seq_id} is finished (freed): it cannot be used or forked"
                ) from None
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}") from None

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    # -- references ----------------------------------------------------------------------

    def _ref(self, pages: Iterable[Page]) -> None:
        for p in pages:
            p.refs += 1

    def _unref(self, pages: Iterable[Page]) -> int:
        """Drop one reference from each page; returns working pages freed."""
        freed = 0
        for p in pages:
            p.refs -= 1
            if p.refs < 0:
                raise AssertionError(f"{p!r}: reference count below zero")
            if p.refs == 0 and p.slot != PAD_SLOT:
                self.pool.free(p.slot)
                p.slot = PAD_SLOT
                self._stored_with_slot.pop(p.pid, None)
                freed += 1
        return freed

    def _new_page(self) -> Page:
        page = Page(next(self._pids), self.pool.alloc())
        page.refs = 1
        return page

    # -- lifecycle -----------------------------------------------------------------------

    def create(self) -> int:
        """A new empty sequence; returns its id."""
        seq_id = next(self._seq_ids)
        self._tables[seq_id] = BlockTable(seq_id)
        return seq_id

    def append(self, seq_id: int, tokens: Any) -> list[PageWrite]:
        """Append token ids; returns the writes of their KV into working slots.

        Pages are allocated as they fill. A partial last page held by anyone else (a fork,
        a snapshot) is first copied to a fresh slot. All-or-nothing: on
        :class:`CapacityError` (pool exhausted) or :class:`SequenceLengthError` the table
        is unchanged.
        """
        table = self.table(seq_id)
        ids = check_token_ids(tokens)
        n = len(ids)
        if n == 0:
            return []
        cow = self._check_append(table, n)
        pt = self.page_tokens
        start = table.num_tokens
        if cow:
            old = table.pages[-1]
            copy = self._new_page()
            self._copy_page(old.slot, copy.slot, old.filled)
            copy.filled = old.filled
            table.pages[-1] = copy
            self._unref([old])
            self.cow_copies += 1
        writes: list[PageWrite] = []
        pos = start
        src = 0
        while src < n:
            lp = pos // pt
            if lp == len(table.pages):
                table.pages.append(self._new_page())
            page = table.pages[lp]
            off = pos % pt
            count = min(pt - off, n - src)
            writes.append(PageWrite(page, page.slot, off, src, count))
            page.filled = off + count
            pos += count
            src += count
        table.tokens.extend(ids)
        return writes

    def check_append(self, seq_id: int, n: int) -> None:
        """Raise what :meth:`append` of ``n`` tokens to ``seq_id`` would raise
        (:class:`SequenceLengthError`, :class:`CapacityError`, unknown or finished
        sequence) without changing anything."""
        table = self.table(seq_id)
        if n:
            self._check_append(table, n)

    def _check_append(self, table: BlockTable, n: int) -> bool:
        """Check an append of ``n`` tokens; returns whether it copies the last page."""
        if self.max_tokens is not None and table.num_tokens + n > self.max_tokens:
            raise SequenceLengthError(
                f"sequence {table.seq_id}: appending {n} tokens to {table.num_tokens} "
                f"exceeds the maximum length of {self.max_tokens}"
            )
        start = table.num_tokens
        cow = start % self.page_tokens != 0 and table.pages[-1].refs > 1
        new_pages = -(-(start + n) // self.page_tokens) - len(table.pages)
        needed = new_pages + (1 if cow else 0)
        if needed > self.pool.capacity - self.pool.in_use:
            raise CapacityError(
                f"sequence {table.seq_id}: appending {n} tokens needs {needed} working slots, "
                f"{self.pool.capacity - self.pool.in_use} of {self.pool.capacity} are free"
            )
        return cow

    def adopt(self, seq_id: int, tokens: Any, keys: Sequence[PageKey]) -> None:
        """Start an empty sequence with pages already stored in the cache (a cached
        prefix): ``keys[i]`` holds ``tokens[i*page_tokens:(i+1)*page_tokens]``.

        Raises :class:`KVTierUsageError` unless the sequence is empty, has no versions,
        and ``tokens`` fills exactly ``len(keys)`` pages.
        """
        table = self.table(seq_id)
        ids = check_token_ids(tokens)
        if table.tokens or table.versions:
            raise KVTierUsageError(
                f"sequence {seq_id} is not empty: a cached prefix can only start a sequence"
            )
        if len(ids) != len(keys) * self.page_tokens:
            raise KVTierUsageError(
                f"{len(keys)} cached pages hold {len(keys) * self.page_tokens} tokens, "
                f"got {len(ids)}"
            )
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            raise SequenceLengthError(
                f"sequence {seq_id}: a cached prefix of {len(ids)} tokens exceeds the "
                f"maximum length of {self.max_tokens}"
            )
        for key in keys:
            page = Page(next(self._pids), PAD_SLOT)
            page.key = key
            page.filled = self.page_tokens
            page.refs = 1
            table.pages.append(page)
        table.tokens.extend(ids)

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page (and the version stack) of ``seq_id``."""
        src = self.table(seq_id)
        child = BlockTable(next(self._seq_ids), list(src.pages), list(src.tokens))
        self._ref(child.pages)
        for v in src.versions:
            child.versions.append(Version(v.vid, v.num_tokens, list(v.pages)))
            self._ref(v.pages)
        self._tables[child.seq_id] = child
        return child.seq_id

    def free(self, seq_id: int) -> int:
        """Finish ``seq_id``: drop its pages and versions. Returns working pages freed.
        Any later use of the id (freeing twice, forking) raises
        :class:`SequenceFinishedError`."""
        table = self.table(seq_id)
        freed = self._unref(table.pages)
        for v in table.versions:
            freed += self._unref(v.pages)
        table.pages.clear()
        table.versions.clear()
        del self._tables[seq_id]
        self._finished.add(seq_id)
        self._release_stored_slots()
        return freed

    # -- versions ------------------------------------------------------------------------

    def snapshot(self, seq_id: int) -> int:
        """Record the table before a speculative step; returns the version id."""
        table = self.table(seq_id)
        v = Version(next(self._vids), table.num_tokens, list(table.pages))
        self._ref(v.pages)
        table.versions.append(v)
        return v.vid

    def _version_index(self, table: BlockTable, vid: int, verb: str) -> int:
        for i, v in enumerate(table.versions):
            if v.vid == vid:
                return i
        raise VersionError(
            f"cannot {verb} sequence {table.seq_id} to version {vid!r}: it is not a live "
            f"version (already committed or rolled back, or never taken); live versions: "
            f"{table.live_versions()}"
        )

    def rollback(self, seq_id: int, vid: int) -> int:
        """Restore the table as of version ``vid``; consumes it and every newer version.

        Returns the number of working pages freed (pages written after the snapshot).
        """
        table = self.table(seq_id)
        i = self._version_index(table, vid, "roll back")
        v = table.versions[i]
        dropped = table.versions[i:]
        del table.versions[i:]
        freed = self._unref(table.pages)
        table.pages = v.pages  # the snapshot's references move to the table
        for later in dropped[1:]:
            freed += self._unref(later.pages)
        del table.tokens[v.num_tokens :]
        self._release_stored_slots()
        return freed

    def commit(self, seq_id: int, vid: int, keep: int | None = None) -> int:
        """Accept the tokens appended since version ``vid`` (only the first ``keep`` of
        them when given: the rest are dropped as by a rollback). Consumes ``vid`` and
        every newer version. Returns working pages freed. Raises (see
        :meth:`check_commit`) before changing anything."""
        table = self.table(seq_id)
        i, cut = self._check_commit(table, vid, keep)
        freed = 0 if cut is None else self._truncate(table, cut)
        dropped = table.versions[i:]
        del table.versions[i:]
        for d in dropped:
            freed += self._unref(d.pages)
        self._release_stored_slots()
        return freed

    def check_commit(self, seq_id: int, vid: int, keep: int | None = None) -> None:
        """Raise what :meth:`commit` would raise without changing anything: unknown or
        finished sequence, :class:`VersionError`, a bad ``keep``, :class:`CapacityError`
        (cutting inside a shared page needs a working slot for the copy)."""
        self._check_commit(self.table(seq_id), vid, keep)

    def _check_commit(
        self, table: BlockTable, vid: int, keep: int | None
    ) -> tuple[int, int | None]:
        """The version's index and the token count to cut to (``None``: no cut)."""
        i = self._version_index(table, vid, "commit")
        since = table.num_tokens - table.versions[i].num_tokens
        if keep is None or check_int(keep, "commit keep") == since:
            return i, None
        if not 0 <= keep <= since:
            raise KVTierUsageError(
                f"commit keep={keep} must lie in [0, {since}] (tokens appended since version {vid})"
            )
        cut = table.versions[i].num_tokens + int(keep)
        self._check_cut(table, cut)
        return i, cut

    def _check_cut(self, table: BlockTable, num_tokens: int) -> str | None:
        """How cutting ``table`` to ``num_tokens`` changes its last kept page: ``None``
        (it stays), ``"shrink"`` (this table is its only holder: in place) or ``"copy"``
        (shared or stored: this table gets its own copy, since every holder must see the
        same fill). Raises :class:`KVTierUsageError` for a cut inside a page whose only
        copy is stored and :class:`CapacityError` when the copy finds no working slot."""
        keep_pages = -(-num_tokens // self.page_tokens)
        if not keep_pages:
            return None
        last = table.pages[keep_pages - 1]
        if last.filled == num_tokens - (keep_pages - 1) * self.page_tokens:
            return None
        if last.refs == 1 and last.key is None:
            return "shrink"
        if last.slot == PAD_SLOT:
            raise KVTierUsageError(
                f"cannot cut sequence {table.seq_id} to {num_tokens} tokens: that falls "
                "inside a stored page; cut at a page boundary"
            )
        # the pages cut off give their slots back before the copy takes one
        frees = sum(1 for p in table.pages[keep_pages:] if p.refs == 1 and p.slot != PAD_SLOT)
        if self.pool.capacity - self.pool.in_use + frees < 1:
            raise CapacityError(
                f"sequence {table.seq_id}: cutting to {num_tokens} tokens inside a shared "
                f"page needs a working slot for its copy; all {self.pool.capacity} are in use"
            )
        return "copy"

    def _truncate(self, table: BlockTable, num_tokens: int) -> int:
        """Cut the table to ``num_tokens`` (see :meth:`_check_cut`, which raises before
        anything changes). Returns working pages freed."""
        mode = self._check_cut(table, num_tokens)
        keep_pages = -(-num_tokens // self.page_tokens)
        gone = table.pages[keep_pages:]
        del table.pages[keep_pages:]
        del table.tokens[num_tokens:]
        freed = self._unref(gone)
        if mode is None:
            return freed
        last = table.pages[-1]
        fill = num_tokens - (keep_pages - 1) * self.page_tokens
        if mode == "shrink":
            last.filled = fill
        else:
            copy = self._new_page()
            self._copy_page(last.slot, copy.slot, fill)
            copy.filled = fill
            table.pages[-1] = copy
            freed += self._unref([last])
            self.cow_copies += 1
        return freed

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Cut a sequence without live versions to ``num_tokens`` tokens (e.g. to
        recompute pages a fault lost). Returns working pages freed."""
        table = self.table(seq_id)
        if table.versions:
            raise VersionError(
                f"sequence {seq_id} has live versions {table.live_versions()}: commit or "
                "roll them back before truncating"
            )
        num_tokens = check_int(num_tokens, "truncate num_tokens")
        if not 0 <= num_tokens <= table.num_tokens:
            raise KVTierUsageError(
                f"truncate to {num_tokens!r} tokens: must lie in [0, {table.num_tokens}]"
            )
        return self._truncate(table, num_tokens)

    # -- publishing ----------------------------------------------------------------------

    def publishable(self, seq_id: int) -> list[tuple[int, Page]]:
        """``(logical page, page)`` of each full, verified, unpublished page of
        ``seq_id``, in order: what may now be stored in the cache. Every page before the
        first of them is published, so their keys chain from that page's key."""
        table = self.table(seq_id)
        limit = table.verified_tokens // self.page_tokens
        out: list[tuple[int, Page]] = []
        for lp in range(limit):
            page = table.pages[lp]
            if page.key is None:
                out.append((lp, page))
        return out

    def mark_published(self, page: Page, key: PageKey) -> None:
        """``page`` is now stored in the cache as ``key``: its working slot is freed
        as soon as no holder may still cut inside it (see :meth:`_release_stored_slots`)."""
        if page.filled != self.page_tokens:
            raise KVTierUsageError(f"{page!r} is not full; only full pages are published")
        page.key = key
        if page.slot == PAD_SLOT:
            return
        if page.refs == 1:  # only the publishing table, where it is verified
            self.pool.free(page.slot)
            page.slot = PAD_SLOT
            return
        self._stored_with_slot[page.pid] = page
        self._release_stored_slots()

    def _release_stored_slots(self) -> None:
        """Give back the working slot of each stored page that no holder may cut inside.

        A cut (a commit keeping fewer tokens) only falls past a sequence's verified
        tokens, and needs the page's bytes for the copy it makes: so a stored page keeps
        its slot while some sequence holds it (in its table or a snapshot) past that
        sequence's verified tokens. Scans the tables only while such pages exist."""
        if not self._stored_with_slot:
            return
        pt = self.page_tokens
        needed: set[int] = set()
        for t in self._tables.values():
            first_unverified = t.verified_tokens // pt
            for pages in (t.pages, *(v.pages for v in t.versions)):
                for p in pages[first_unverified:]:
                    needed.add(p.pid)
        for pid in [pid for pid in self._stored_with_slot if pid not in needed]:
            page = self._stored_with_slot.pop(pid)
            self.pool.free(page.slot)
            page.slot = PAD_SLOT

    # -- packing -------------------------------------------------------------------------

    def pack(
        self,
        seq_ids: Sequence[int],
        slot_of: Callable[[Page], int],
        max_pages: int | None = None,
    ) -> np.ndarray:
        """The int32 ``[len(seq_ids), max_pages]`` table of slots, padded with
        :data:`PAD_SLOT`. ``slot_of`` maps a page to its top-tier slot."""
        tables = [self.table(s) for s in seq_ids]
        width = max((len(t.pages) for t in tables), default=0)
        if max_pages is None:
            max_pages = width
        elif max_pages < width:
            raise KVTierUsageError(f"max_pages={max_pages} < longest table ({width} pages)")
        return pack_slots([[slot_of(p) for p in t.pages] for t in tables], max_pages)

    def live_pages(self) -> dict[int, Page]:
        """Every page held by a table or snapshot, by pid (for invariant checks)."""
        out: dict[int, Page] = {}
        for t in self._tables.values():
            for p in t.pages:
                out[p.pid] = p
            for v in t.versions:
                for p in v.pages:
                    out[p.pid] = p
        return out
