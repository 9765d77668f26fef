"""Slot bookkeeping shared by the memory arenas (DRAM, HBM).

An arena holds ``capacity`` page slots. :class:`SlotBook` tracks which key is committed
in which slot, which slots are reserved (taken, written, not yet visible) and which are
free, and keeps a slot that a copy is still reading or writing from being reused until
that copy has really ended (its worker thread returned, not merely its awaiting task
cancelled): otherwise a late copy could overwrite a new page or read a reused slot. It
moves no bytes and never blocks: arenas call it on the event-loop thread around their
copies. The contract it serves is :mod:`kvtier.backend`'s two-phase put.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.keys import PageKey


class SlotBook:
    """Keys -> slots for one arena of ``capacity`` slots (all free at first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.committed: dict[PageKey, int] = {}
        self.reserved: dict[int, PageKey] = {}
        # Popped from the end: slot 0 is handed out first.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._busy: dict[int, int] = {}  # slot -> copies in flight
        self._draining: set[int] = set()  # freed while busy: free once idle

    def slot_of(self, key: PageKey) -> int | None:
        """The slot of a committed key, or ``None``."""
        return self.committed.get(key)

    def take(self, key: PageKey) -> tuple[int, bool] | None:
        """Reserve a slot for ``key``: ``(slot, present)``. A committed key answers its
        own slot with ``present=True`` (nothing taken); ``None`` when no slot is free."""
        slot = self.committed.get(key)
        if slot is not None:
            return slot, True
        if not self._free:
            return None
        slot = self._free.pop()
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
            self._free.append(slot)
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
        if self._busy.get(slot):
            self._draining.add(slot)
        else:
            self._free.append(slot)

    def begin_io(self, slots: Sequence[int]) -> None:
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
                self._free.append(slot)

    def used(self) -> int:
        """Slots committed, reserved, or released but still under a copy."""
        return len(self.committed) + len(self.reserved) + len(self._draining)

    @property
    def draining(self) -> int:
        """Released slots still under a copy."""
        return len(self._draining)
