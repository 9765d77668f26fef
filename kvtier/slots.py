"""Slot bookkeeping: the one slot book of the arenas (DRAM, HBM) and the NVMe store.

:class:`FreeSlots` hands out free slots and takes them back, holding back a slot freed
while a copy still reads or writes it until that copy has really ended (its worker thread
returned, not merely its awaiting task cancelled): otherwise a late copy could overwrite a
new page or read a reused slot. It serves a fixed slot space (an arena: last freed first)
and a growing one (the NVMe store's slab files: lowest first, new slots past the highest
ever used). :class:`SlotBook` builds an arena's book on it.

An arena holds ``capacity`` page slots. :class:`SlotBook` tracks which key is committed
in which slot, which slots are reserved (taken, written, not yet visible) and which are
free, and keeps a slot that a copy is still reading or writing from being reused until
that copy has really ended (its worker thread returned, not merely its awaiting task
cancelled): otherwise a late copy could overwrite a new page or read a reused slot. It
moves no bytes and never blocks: arenas call it on the event-loop thread around their
copies. The contract it serves is :mod:`kvtier.backend`'s two-phase put.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvtier.keys import PageKey


class FreeSlots:
    """The free slots of a slot space, with slots under a copy held back until it ends.

    Args:
        free: the slots free at first.
        lowest_first: hand out the lowest free slot (a heap); else the last freed one
            (``free`` is then handed out from its end).
        next_new: for a growing space, the first slot never used: when no freed slot is
            left, :meth:`take` hands out this one and counts up (``None``: a fixed space,
            :meth:`take` answers ``None`` when nothing is free).
    """

    def __init__(
        self, free: Iterable[int] = (), *, lowest_first: bool = False, next_new: int | None = None
    ) -> None:
        self._free = list(free)
        self._lowest = lowest_first
        if lowest_first:
            heapq.heapify(self._free)
        self.next_new = next_new
        self._busy: dict[int, int] = {}  # slot -> copies in flight
        self._draining: set[int] = set()  # freed while busy: free once idle

    def take(self) -> int | None:
        """A free slot (see the class docstring), or ``None`` when a fixed space is full."""
        if self._free:
            return heapq.heappop(self._free) if self._lowest else self._free.pop()
        if self.next_new is None:
            return None
        slot = self.next_new
        self.next_new += 1
        return slot

    def release(self, slot: int) -> None:
        """``slot`` is free; handed out again once no copy into or out of it is running."""
        if self._busy.get(slot):
            self._draining.add(slot)
        elif self._lowest:
            heapq.heappush(self._free, slot)
        else:
            self._free.append(slot)

    def begin_io(self, slots: Iterable[int]) -> None:
        """Mark ``slots`` as being copied into or out of (pair with :meth:`end_io`, called
        when the copy has really finished)."""
        for slot in slots:
            self._busy[slot] = self._busy.get(slot, 0) + 1

    def end_io(self, slots: Iterable[int]) -> None:
        """Copies of ``slots`` ended; slots released meanwhile become free."""
        for slot in slots:
            left = self._busy.pop(slot, 1) - 1
            if left > 0:
                self._busy[slot] = left
            elif slot in self._draining:
                self._draining.discard(slot)
                self.release(slot)

    @property
    def draining(self) -> int:
        """Released slots still under a copy."""
        return len(self._draining)


class SlotBook:
    """Keys -> slots for one arena of ``capacity`` slots (all free at first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.committed: dict[PageKey, int] = {}
        self.reserved: dict[int, PageKey] = {}
        # handed out from the end: slot 0 first
        self._free = FreeSlots(range(capacity - 1, -1, -1))

    def slot_of(self, key: PageKey) -> int | None:
        """The slot of a committed key, or ``None``."""
        return self.committed.get(key)

    def take(self, key: PageKey) -> tuple[int, bool] | None:
        """Reserve a slot for ``key``: ``(slot, present)``. A committed key answers its
        own slot with ``present=True`` (nothing taken); ``None`` when no slot is free."""
        slot = self.committed.get(key)
        if slot is not None:
            return slot, True
        slot = self._free.take()
        if slot is None:
            return None
        self.reserved[slot] = key
        return slot, False

    def is_live(self, slot: int, key: PageKey) -> bool:
        """Whether ``slot`` is still reserved for ``key`` (not aborted or committed)."""
        return self.reserved.get(slot) == key

    def commit(self, slot: int, key: PageKey, present: bool) -> bool:
        """Publish a reservation. A key committed meanwhile through another reservation
        keeps its first slot (this one is freed) and the commit still succeeds; ``False``
        for a reservation that is no longer live."""
        if present:
            return key in self.committed
        if not self.is_live(slot, key):
            return False
        del self.reserved[slot]
        if key in self.committed:
            self._free.release(slot)
        else:
            self.committed[key] = slot
        return True

    def abort(self, slot: int, key: PageKey, present: bool) -> None:
        """Give a live reservation's slot back (no-op otherwise); reused once no copy
        into it is still running."""
        if not present and self.is_live(slot, key):
            del self.reserved[slot]
            self._release(slot)

    def delete(self, key: PageKey) -> bool:
        """Uncommit ``key``; its slot is reused once no copy out of it is still running."""
        slot = self.committed.pop(key, None)
        if slot is None:
            return False
        self._release(slot)
        return True

    def _release(self, slot: int) -> None:
        self._free.release(slot)

    def begin_io(self, slots: Sequence[int]) -> None:
        """Mark ``slots`` as being copied into or out of (pair with :meth:`end_io`, called
        when the copy has really finished)."""
        self._free.begin_io(slots)

    def end_io(self, slots: Iterable[int]) -> None:
        """Copies of ``slots`` ended; slots released meanwhile become free."""
        self._free.end_io(slots)

    def used(self) -> int:
        """Slots committed, reserved, or released but still under a copy."""
        return len(self.committed) + len(self.reserved) + self._free.draining

    @property
    def draining(self) -> int:
        """Released slots still under a copy."""
        return self._free.draining
