"""The one slot book: free slots handed out and taken back, a slot under a copy held back
until the copy ends; a fixed space (arenas) and a growing one (the NVMe store's slabs)."""

from __future__ import annotations

from kvtier.keys import PageKey
from kvtier.slots import FreeSlots, SlotBook


def test_a_fixed_space_hands_out_the_last_freed_slot_and_runs_out() -> None:
    free = FreeSlots([2, 1, 0])
    assert [free.take(), free.take()] == [0, 1]
    free.release(0)
    assert free.take() == 0  # last freed first
    assert free.take() == 2
    assert free.take() is None  # full


def test_a_growing_space_hands_out_the_lowest_slot_then_new_ones() -> None:
    free = FreeSlots([5, 3], lowest_first=True, next_new=7)
    assert [free.take(), free.take(), free.take(), free.take()] == [3, 5, 7, 8]
    free.release(5)
    free.release(4)
    assert free.take() == 4 and free.take() == 5 and free.take() == 9


def test_a_slot_freed_under_a_copy_is_held_back_until_the_copy_ends() -> None:
    free = FreeSlots(lowest_first=True, next_new=0)
    slot = free.take()
    assert slot == 0
    free.begin_io([slot])
    free.begin_io([slot])  # two copies on it
    free.release(slot)
    assert free.draining == 1 and free.take() == 1  # not handed out again
    free.end_io([slot])
    assert free.draining == 1  # one copy still runs
    free.end_io([slot])
    assert free.draining == 0 and free.take() == 0


def test_the_arena_book_counts_draining_slots_as_used() -> None:
    book = SlotBook(2)
    key = PageKey(bytes(range(16)))
    slot, present = book.take(key) or (-1, True)
    assert not present and book.commit(slot, key, present)
    book.begin_io([slot])
    assert book.delete(key) and book.used() == 1 and book.draining == 1
    book.end_io([slot])
    assert book.used() == 0
