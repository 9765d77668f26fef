"""Links: batched page movers between two tiers, chosen per (source, destination) medium.

A :class:`Link` moves a batch of pages from a source tier into space already reserved in
a destination tier. How the bytes reach the destination depends on where they live
(:class:`~kvtier.backend.Medium`), so the first step is a *reader* registered per medium
pair (:func:`register_link`); the destination's ``write`` is the second step. Built in:

* ``host`` arena -> anything: the destination writes straight from the source's slot
  views (zero-copy on the source side);
* a store or a ``device`` arena -> a ``host`` arena: the source reads straight into the
  reserved slot views (the arena's ``write`` then skips the copy);
* ``file`` -> ``device`` (the GPUDirect Storage path): a store that reads into device
  memory (``reads_to_device``) fills the reserved device slots directly; others read into
  one host staging buffer per batch;
* anything else: through host staging buffers allocated per batch.

Each backend call covers the whole batch (one executor hop per batch, never per page).
:meth:`Link.transfer` answers per page whether it was written; once the batch is
committed, :meth:`Link.account` records the pages that landed, their bytes and the
seconds from the first read to the commit, so bandwidth per link comes free (a remote
store sends at commit: nothing has moved before). A link never raises
for I/O trouble: failures are per-page ``False`` results and the failing tier is marked
(logged once per outage). :class:`~kvtier.transfer.gate.PriorityGate` bounds the batches
in flight on each link.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from kvtier.backend import ArenaBackend, Backend, Medium, Reservation
from kvtier.keys import PageKey
from kvtier.metrics import CacheMetrics
from kvtier.transfer.gate import QUEUE_NAMES, Priority, PriorityGate
from kvtier.transfer.tier import Tier, backend_failure

__all__ = [
    "QUEUE_NAMES",
    "Link",
    "Priority",
    "PriorityGate",
    "Reader",
    "reader_for",
    "register_link",
]

#: Reads a batch out of ``src`` for reservations of ``dst``: one buffer per page (``None``
#: where the source does not give it). Raises for a call that failed as a whole.
Reader = Callable[
    [Backend, Backend, Sequence[PageKey], Sequence[Reservation]], Awaitable[list[Any | None]]
]

_READERS: dict[tuple[str, str], Reader] = {}


def register_link(src_medium: str, dst_medium: str, reader: Reader) -> None:
    """Use ``reader`` for batches from a ``src_medium`` backend to a ``dst_medium`` one
    (``"*"`` as the destination matches any). The most specific pair wins: (source
    medium, destination medium), then (source medium, ``"*"``), then (source kind,
    destination medium), then (source kind, destination kind), then (source kind,
    ``"*"``); kinds are ``arena``/``store``."""
    _READERS[(str(src_medium), str(dst_medium))] = reader


def reader_for(src: Backend, dst: Backend) -> Reader:
    """The reader registered for this pair of backends (see :func:`register_link`)."""
    for pair in (
        (str(src.medium), str(dst.medium)),
        # a device arena to a store: staged (before this, ("arena", "*") took it, and its
        # slot views do not exist: an hbm tier right above a disk tier could not write)
        (str(src.medium), "*"),
        (str(src.kind), str(dst.medium)),
        (str(src.kind), str(dst.kind)),
        (str(src.kind), "*"),
    ):
        reader = _READERS.get(pair)
        if reader is not None:
            return reader
    return _staged


async def _from_slots(
    src: Backend, dst: Backend, keys: Sequence[PageKey], res: Sequence[Reservation]
) -> list[Any | None]:
    """A host arena's slot views, no copy (staged for an arena without host views)."""
    assert isinstance(src, ArenaBackend)
    if not src.host_addressable:
        return await _staged(src, dst, keys, res)
    out: list[Any | None] = []
    for key in keys:
        slot = src.slot_of(key)
        out.append(src.view(slot) if slot is not None else None)
    return out


async def _into_views(
    src: Backend, dst: Backend, keys: Sequence[PageKey], res: Sequence[Reservation]
) -> list[Any | None]:
    """Read straight into the reservations' host views when they all have one."""
    if not all(r.view is not None for r in res):
        return await _staged(src, dst, keys, res)
    targets: list[Any] = [r.view for r in res]
    got = await src.get(keys, targets)
    return [t if hit else None for t, hit in zip(targets, got, strict=True)]


async def _staged(
    src: Backend, dst: Backend, keys: Sequence[PageKey], res: Sequence[Reservation]
) -> list[Any | None]:
    """Read into host staging buffers allocated for this batch."""
    staging = np.empty((len(keys), dst.page_bytes), dtype=np.uint8)
    targets = list(staging)
    got = await src.get(keys, targets)
    return [t if hit else None for t, hit in zip(targets, got, strict=True)]


async def _file_to_device(
    src: Backend, dst: Backend, keys: Sequence[PageKey], res: Sequence[Reservation]
) -> list[Any | None]:
    """The GPUDirect Storage path: a store that reads into device memory
    (``reads_to_device = True``) fills the reserved device slots directly; any other store
    goes through one host staging buffer (the device arena's ``write`` copies it up)."""
    device_view = getattr(dst, "device_view", None)
    if not getattr(src, "reads_to_device", False) or device_view is None:
        return await _staged(src, dst, keys, res)
    targets: list[Any] = [device_view(r.handle) for r in res]
    got = await src.get(keys, targets)
    return [t if hit else None for t, hit in zip(targets, got, strict=True)]


register_link(Medium.HOST, "*", _from_slots)
register_link("arena", "*", _from_slots)
register_link(Medium.DEVICE, Medium.HOST, _into_views)
register_link(Medium.DEVICE, "*", _staged)
register_link("store", Medium.HOST, _into_views)
register_link(Medium.FILE, Medium.DEVICE, _file_to_device)
register_link("store", "store", _staged)


class Link:
    """Moves batches of pages from ``src`` to reserved space in ``dst``.

    Args:
        src: source tier (pages committed there, protected by the caller while copied).
        dst: destination tier (space reserved by the caller).
        metrics: where transfers are recorded, as ``"src->dst"``.
        max_inflight: batches in flight at once on this link.
    """

    def __init__(self, src: Tier, dst: Tier, metrics: CacheMetrics, max_inflight: int) -> None:
        self.src = src
        self.dst = dst
        self.name = f"{src.name}->{dst.name}"
        self.metrics = metrics
        self.gate = PriorityGate(max_inflight, metrics)
        self.reader = reader_for(src.backend, dst.backend)

    async def transfer(
        self, keys: Sequence[PageKey], reservations: Sequence[Reservation]
    ) -> list[bool]:
        """Copy each page into its reservation (``write``, not commit); ``True`` where it
        was written. The caller then records the batch with :meth:`account` once it is
        committed.

        Never raises for I/O failures (they are ``False`` and mark the tier that failed);
        usage errors (wrong buffers) propagate, since they are bugs.
        """
        n = len(keys)
        if n == 0:
            return []
        ok = [False] * n
        bufs: list[Any | None] = [None] * n
        try:
            bufs = await self.reader(self.src.backend, self.dst.backend, keys, reservations)
            if not self.src.is_arena:
                missed = [keys[i] for i in range(n) if bufs[i] is None]
                if missed and len(missed) == n:
                    self.metrics.failed.inc(self.src.name, by=n)
                    await self.src.record_all_missed("get", missed)
                else:
                    self._health(self.src, "get", len(missed), n)
        except BaseException as exc:  # a failing tier is a miss, never a crash
            if not backend_failure(exc):
                raise
            self.src.record_failure("get", n, exc)
            self.metrics.failed.inc(self.src.name, by=n)
            bufs = [None] * n
        idx = [i for i in range(n) if bufs[i] is not None]
        if idx:
            try:
                written = await self.dst.backend.write(
                    [reservations[i] for i in idx], [bufs[i] for i in idx]
                )
                for i, w in zip(idx, written, strict=True):
                    ok[i] = w
                self._health(self.dst, "write", len(idx) - sum(written), len(idx))
            except BaseException as exc:
                if not backend_failure(exc):
                    raise
                self.dst.record_failure("write", len(idx), exc)
                self.metrics.failed.inc(self.dst.name, by=len(idx))
        return ok

    def account(self, pages: int, moved: int, seconds: float) -> None:
        """Record one batch over this link: ``pages`` were sent, ``moved`` of them landed
        (committed in the destination: a store that sends at commit, as the remote one
        does, has moved nothing before), in ``seconds`` from the first read to the
        commit."""
        nbytes = moved * self.dst.backend.page_bytes
        self.metrics.record_transfer(self.name, moved, nbytes, seconds)
        if moved < pages:
            self.metrics.link_failed.inc(self.name, by=pages - moved)

    def _health(self, tier: Tier, op: str, failed: int, total: int) -> None:
        if failed:
            self.metrics.failed.inc(tier.name, by=failed)
        if total and failed == total:
            tier.record_failure(op, failed)
        elif failed < total:
            tier.record_success()
