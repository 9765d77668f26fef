"""What every slot arena shares: the keyed two-phase interface over a :class:`SlotBook`.

A memory arena (the DRAM arena, the HBM arena, a plugin's) keeps ``capacity_pages``
slots in one preallocated buffer. Which key sits in which slot, which slots are reserved
or free, and which freed slot a copy still uses is the slot book's job
(:class:`~kvtier.slots.SlotBook`); :class:`SlotArena` puts it behind the backend contract:
``reserve``, ``commit``, ``abort``, ``contains``, ``delete``, ``keys``, ``slot_of`` and
``used_pages``, plus slot-number checking. A subclass allocates its memory, keeps
``self.slots`` (a fresh book at open and close), and implements the copies: ``write``,
``get`` and the slot views. It may give each reservation a writable view of its slot
(:meth:`SlotArena.reservation_view`) so that a store can read straight into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.backend import ArenaBackend, Reservation
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.slots import SlotBook


class SlotArena(ArenaBackend):
    """An arena whose slots are kept by a :class:`SlotBook` (see the module docstring)."""

    #: The slot book (replaced by a fresh one at open and close).
    slots: SlotBook

    def ready(self) -> None:
        """Raise :class:`~kvtier.backend.BackendClosedError` unless open (subclasses
        whose memory outlives ``open`` may check more)."""
        self._check_open()

    def reservation_view(self, slot: int) -> np.ndarray | None:
        """The writable host view a reservation of ``slot`` carries (``None``: none, e.g.
        device memory)."""
        return None

    def check_slot(self, slot: int) -> None:
        """``slot`` is a slot number of this arena; :class:`KVTierUsageError` otherwise."""
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise KVTierUsageError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.capacity_pages:
            raise KVTierUsageError(f"slot {slot} out of range [0, {self.capacity_pages})")

    def slot_of(self, key: PageKey) -> int | None:
        return self.slots.slot_of(key)

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        """A free slot per key (``None`` when the arena is full). Committed keys get a
        ``present`` reservation; others carry :meth:`reservation_view` of their slot."""
        self.ready()
        out: list[Reservation | None] = []
        for key in keys:
            taken = self.slots.take(key)
            if taken is None:
                out.append(None)
            elif taken[1]:
                out.append(Reservation(key, taken[0], present=True))
            else:
                out.append(Reservation(key, taken[0], view=self.reservation_view(taken[0])))
        return out

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Publish slots. A key committed meanwhile by another reservation keeps its
        first slot; the duplicate's slot is freed and the commit still succeeds."""
        self.ready()
        return [self.slots.commit(r.handle, r.key, r.present) for r in reservations]

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self.ready()
        for r in reservations:
            self.slots.abort(r.handle, r.key, r.present)

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self.ready()
        return [self.slots.slot_of(k) is not None for k in keys]

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove committed keys. The caller guarantees none is pinned for zero-copy use;
        a slot a copy in flight still reads is reused only once that copy finished (until
        then it counts in :meth:`used_pages`)."""
        self.ready()
        return [self.slots.delete(key) for key in keys]

    async def keys(self) -> list[PageKey]:
        self.ready()
        return list(self.slots.committed)

    def used_pages(self) -> int:
        return self.slots.used()
