"""The pieces of a block table: pages, the working slot pool, one sequence's table,
the copies an append asks for, and token-id checking and slot packing.

:mod:`kvtier.index.block_table` builds the bookkeeping of every sequence from these (and
re-exports them, so ``from kvtier.index.block_table import Page`` keeps working).

Pages
    A :class:`Page` is either *working* (it holds a slot of the working pool: the top
    tier's memory that running sequences write into) or *published* (full, verified,
    stored in the cache under its content key; its working slot is given back, once no
    sequence holding it unverified could still cut inside it and need its bytes). Working
    pages are private: they are never in the directory, never written down the
    hierarchy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.keys import PageKey

#: Value of an unused entry in a packed block table.
PAD_SLOT = -1


class UnknownSequenceError(KVTierUsageError):
    """A sequence id that was never created."""


class SequenceFinishedError(KVTierUsageError):
    """An operation on a finished (freed) sequence."""


class VersionError(KVTierUsageError):
    """A version that does not exist for this sequence or was already consumed."""


class SequenceLengthError(KVTierUsageError):
    """An append would take a sequence past its configured maximum length."""


class Page:
    """One page a block table points to. See the module docstring.

    Attributes:
        pid: unique id, stable for the page's life.
        slot: working-pool slot, or :data:`PAD_SLOT` once published.
        key: content key once published, else ``None``.
        filled: tokens written (the same for every holder).
        refs: holders (tables and snapshots).
    """

    __slots__ = ("filled", "key", "pid", "refs", "slot")

    def __init__(self, pid: int, slot: int) -> None:
        self.pid = pid
        self.slot = slot
        self.key: PageKey | None = None
        self.filled = 0
        self.refs = 0

    @property
    def published(self) -> bool:
        return self.key is not None

    def __repr__(self) -> str:
        where = f"key={self.key.hex()[:8]}" if self.key else f"slot={self.slot}"
        return f"Page({self.pid}, {where}, filled={self.filled}, refs={self.refs})"


class SlotPool:
    """The working pool: a fixed set of slot ids handed out and given back.

    Raises :class:`CapacityError` when empty, naming the pool size.
    """

    def __init__(self, slots: Iterable[int]) -> None:
        self._all = list(slots)
        if len(set(self._all)) != len(self._all):
            raise KVTierUsageError("SlotPool: duplicate slot ids")
        self._free = list(reversed(self._all))
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return len(self._all)

    @property
    def in_use(self) -> int:
        return len(self._used)

    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def alloc(self) -> int:
        if not self._free:
            raise CapacityError(
                f"working pool exhausted: all {len(self._all)} slots hold pages of live "
                "sequences (free or finish sequences, or give the pool more slots)"
            )
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise KVTierUsageError(f"SlotPool: slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)


@dataclass
class Version:
    vid: int
    num_tokens: int
    pages: list[Page]


@dataclass
class BlockTable:
    """The table of one sequence (read it; change it only through :class:`BlockTables`).

    Attributes:
        seq_id: the sequence.
        pages: logical page number -> page.
        tokens: token ids, ``num_tokens`` of them.
        versions: live snapshots, oldest first.
    """

    seq_id: int
    pages: list[Page] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    versions: list[Version] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def verified_tokens(self) -> int:
        """Tokens before the oldest live snapshot (all of them without one)."""
        return self.versions[0].num_tokens if self.versions else len(self.tokens)

    def live_versions(self) -> list[int]:
        return [v.vid for v in self.versions]


@dataclass(frozen=True)
class PageWrite:
    """A copy the caller performs: ``count`` tokens from ``src_start`` of the appended
    chunk into page ``page`` (working slot ``slot``) at token offset ``offset``."""

    page: Page
    slot: int
    offset: int
    src_start: int
    count: int


def check_int(value: Any, what: str) -> int:
    """``value`` as an int (numpy integers accepted); :class:`KVTierUsageError` naming
    ``what`` for anything else (bools, floats, strings, ``None``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise KVTierUsageError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_token_ids(tokens: Any) -> list[int]:
    """Token ids as a list of ints; :class:`KVTierUsageError` for the wrong dtype/shape.

    Accepts a list or tuple of Python ints, or a 1-D numpy array / torch tensor of an
    integer dtype. Floats, bools and values outside ``[0, 2**32)`` are rejected.
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        if getattr(tokens, "is_meta", False):
            raise KVTierUsageError("token ids are a meta tensor: it holds no data")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise KVTierUsageError(f"token ids must be 1-D, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise KVTierUsageError(f"token ids must have an integer dtype, got {tokens.dtype}")
        out = [int(t) for t in tokens.tolist()]
    elif isinstance(tokens, list | tuple):
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise KVTierUsageError(f"token ids must be integers, got {type(t).__name__} {t!r}")
        out = [int(t) for t in tokens]
    else:
        raise KVTierUsageError(
            f"token ids must be a list, numpy array or torch tensor, got {type(tokens).__name__}"
        )
    if out and (min(out) < 0 or max(out) > 0xFFFFFFFF):
        raise KVTierUsageError("token ids must lie in [0, 2**32)")
    return out


def pack_slots(rows: Sequence[Sequence[int]], max_pages: int) -> np.ndarray:
    """Pack per-sequence slot lists into an int32 ``[len(rows), max_pages]`` array,
    padded with :data:`PAD_SLOT`."""
    out = np.full((len(rows), max_pages), PAD_SLOT, dtype=np.int32)
    for i, row in enumerate(rows):
        if len(row) > max_pages:
            raise KVTierUsageError(f"row {i} has {len(row)} pages, more than {max_pages}")
        out[i, : len(row)] = row
    return out
