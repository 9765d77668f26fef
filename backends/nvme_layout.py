"""Where a page lives inside the NVMe store's slab files, and aligned host buffers.

A store is a directory of preallocated *slab* files cut into equal *slots*. Every slot
starts on a 4 KiB boundary, so O_DIRECT and GPUDirect Storage can move pages without
bounce buffers. A slot holds one page::

    [ payload, page_bytes ][ page header, 64 bytes ][ zero padding to 4 KiB ]

The header (:mod:`kvtier.pageformat`) follows the payload so that the payload itself
starts aligned. The part of the payload that fills whole 4 KiB blocks is the *body*; the
rest of the payload, the header and the padding form the *tail block(s)*. With O_DIRECT a
writer sends the body straight from the caller's buffer (when that buffer is aligned) and
the tail from a small aligned staging buffer.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kvtier.pageformat import HEADER_SIZE

#: Alignment of slots, and of buffers and lengths for O_DIRECT.
BLOCK = 4096


def round_up(n: int, to: int = BLOCK) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of ``nbytes`` whose first byte is 4 KiB-aligned.

    Backed by an anonymous mmap (page-aligned by construction); the array keeps the
    mapping alive. Use it for page buffers that should reach the disk without a copy.
    """
    if nbytes <= 0:
        raise ValueError(f"aligned buffer size must be positive, got {nbytes}")
    region = mmap.mmap(-1, round_up(nbytes))
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)


def is_aligned(arr: np.ndarray) -> bool:
    """Whether the array's data starts on a 4 KiB boundary."""
    return int(arr.ctypes.data) % BLOCK == 0


@dataclass(frozen=True)
class SlotLayout:
    """The geometry of one store: slot size and where each slot lives.

    Attributes:
        page_bytes: payload bytes per page.
        slots_per_slab: slots in each slab file.
    """

    page_bytes: int
    slots_per_slab: int

    @classmethod
    def for_page(cls, page_bytes: int, slab_bytes: int, max_slots: int | None = None) -> SlotLayout:
        """The layout for ``page_bytes`` pages in slabs of about ``slab_bytes`` bytes, and
        of at most ``max_slots`` slots (a small store does not preallocate a big slab)."""
        slot = cls(page_bytes, 1).slot_bytes
        per_slab = max(1, slab_bytes // slot)
        if max_slots is not None:
            per_slab = max(1, min(per_slab, max_slots))
        return cls(page_bytes, per_slab)

    @property
    def body_bytes(self) -> int:
        """Payload bytes that fill whole 4 KiB blocks."""
        return self.page_bytes // BLOCK * BLOCK

    @property
    def tail_payload_bytes(self) -> int:
        """Payload bytes after the body (less than one block)."""
        return self.page_bytes - self.body_bytes

    @property
    def tail_bytes(self) -> int:
        """Size of the tail block(s): rest of the payload, header, padding."""
        return round_up(self.tail_payload_bytes + HEADER_SIZE)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot takes in a slab file (a multiple of 4 KiB)."""
        return self.body_bytes + self.tail_bytes

    @property
    def slab_bytes(self) -> int:
        """Size of one full slab file."""
        return self.slots_per_slab * self.slot_bytes

    def locate(self, slot: int) -> tuple[int, int]:
        """``(slab index, byte offset in that slab)`` of a slot."""
        slab, index = divmod(slot, self.slots_per_slab)
        return slab, index * self.slot_bytes

    def header_offset(self, slot: int) -> int:
        """Byte offset of a slot's page header inside its slab."""
        return self.locate(slot)[1] + self.page_bytes
