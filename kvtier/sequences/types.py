"""What the sequence manager works with: the cache it needs, what it hands out, its
counters and errors, and the private keys of its working pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.backend import Reservation
from kvtier.errors import TierIOError
from kvtier.index.directory import Directory
from kvtier.keys import Namespace, PageKey, PrivateKeys
from kvtier.spec import KVSpec

#: Namespace label recorded for working-pool reservations (visible in the directory).
WORKING_NAMESPACE = "kvtier-working-pool"
#: Private keys of the working pool (see :class:`~kvtier.keys.PrivateKeys`).
WORKING_KEYS = PrivateKeys(b"\xffkvtier-wk")


class PageCache(Protocol):
    """What the manager needs of :class:`kvtier.cache.KVCache` (the facade satisfies it)."""

    spec: KVSpec
    namespace: Namespace
    directory: Directory

    @property
    def tiers(self) -> Sequence[Any]:
        """Tiers, top first; each has ``name`` and ``backend``."""

    @property
    def is_open(self) -> bool:
        """Whether the cache is open (not yet closing)."""

    def check_usable(self) -> None:
        """Raise :class:`~kvtier.errors.KVTierUsageError` unless the cache is open and
        this call comes from the thread and event loop that opened it."""

    def release(self, keys: Sequence[PageKey]) -> Any:
        """Unpin keys pinned by :meth:`load` (the result may be awaited)."""

    async def store_pages(
        self,
        keys: Sequence[PageKey],
        pages: Any,
        parents: Sequence[PageKey | None] | None = None,
    ) -> list[bool]:
        """Store pages under explicit keys in the top tier."""

    async def lookup(self, tokens: Any) -> Any:
        """The longest cached prefix of ``tokens`` (``.keys``)."""

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> Any:
        """Bring keys to the top tier (``.slots``, ``.missing``), pinned."""

    async def reserve_private(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation]:
        """Top-tier slots never committed (making room per policy); ``CapacityError``
        when there is none."""

    async def release_private(self, reservations: Sequence[Reservation]) -> None:
        """Give slots taken by :meth:`reserve_private` back."""


class PageFaultError(TierIOError):
    """Pages a sequence needs could not be brought back to the top tier.

    Attributes:
        missing: for each sequence id, the logical page numbers that are lost (the engine
            recomputes them, e.g. after :meth:`SequenceManager.truncate`).
    """

    def __init__(self, missing: dict[int, list[int]]) -> None:
        self.missing = missing
        detail = "; ".join(f"sequence {s}: pages {pages}" for s, pages in missing.items())
        super().__init__(f"page fault could not bring back {detail}")


@dataclass
class ResidentBatch:
    """What :meth:`SequenceManager.ensure_resident` hands out.

    The table stays valid (its slots pinned or held by the working pool) until
    :meth:`SequenceManager.release`, as long as these sequences are not changed meanwhile
    (an append, rollback, commit, truncate or free may reuse working slots).

    Attributes:
        seq_ids: the sequences, in table row order.
        block_table: int32 ``[len(seq_ids), max_pages]`` of top-tier slots, padded -1.
        seq_lens: tokens of each sequence.
        pinned: stored keys pinned for this batch (given back by ``release``).
        owner: the manager that made it (only it may release it).
    """

    seq_ids: list[int]
    block_table: np.ndarray
    seq_lens: list[int]
    pinned: list[PageKey] = field(default_factory=list)
    released: bool = False
    owner: Any = field(default=None, repr=False, compare=False)


@dataclass
class SequenceStats:
    """Counters of one manager (plain data)."""

    pages_published: int = 0
    publish_failures: int = 0
    pages_adopted: int = 0
    rollbacks: int = 0
    pages_discarded: int = 0
    cow_copies: int = 0
    resident_calls: int = 0
    pages_loaded: int = 0
    fault_errors: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)
