"""One batch, step by step: reserve, copy, commit (or abort); and deleting pages.

:func:`commit_batch` brings a batch into a tier whose room the caller already claimed:
it reserves every page in the directory and the backend, copies the bytes over the link
(or writes the caller's buffers), commits, and keeps the directory true whatever
happens. A page becomes visible only after its bytes were written and the backend
committed it; a batch that fails or is interrupted is aborted, never half-visible.

:func:`forget` deletes pages (marked ``evicting``) from a tier's backend and index;
:func:`purge_vanished` forgets pages a store no longer holds. Backends' I/O failures
become per-page ``False`` results and mark the tier failing (logged once per outage);
usage errors propagate, since they are bugs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvtier.backend import Reservation
from kvtier.errors import KVTierUsageError
from kvtier.index.directory import PageState
from kvtier.keys import PageKey
from kvtier.transfer.links import Link
from kvtier.transfer.mover import Mover
from kvtier.transfer.tier import Tier, backend_failure


async def commit_batch(
    mover: Mover,
    src: Tier | None,
    dst: Tier,
    keys: list[PageKey],
    claim: int,
    data: Sequence[np.ndarray] | None,
    parents: Sequence[PageKey | None] | None,
    namespace: str,
    evicting: bool,
    link: Link | None,
) -> list[bool]:
    """Bring ``keys`` into ``dst`` from ``src`` (over ``link``) or from ``data``.

    ``claim`` pages of room are held in ``dst`` by the caller; they become reservations
    (or are given back). ``True`` where the page is committed in ``dst`` afterwards;
    a page another batch is writing into ``dst`` (or evicting from it) is skipped with
    ``False`` and the caller waits for that batch. With ``evicting``, source pages being
    evicted may be copied (the write-down of a victim).
    """
    d = mover.directory
    planner = mover.planner
    src_states = (PageState.COMMITTED, PageState.EVICTING) if evicting else (PageState.COMMITTED,)
    ok = [False] * len(keys)
    todo: list[int] = []
    for i, k in enumerate(keys):
        state = d.state(k, dst.name)
        if state is not None:
            ok[i] = state is PageState.COMMITTED
        elif src is not None and d.state(k, src.name) not in src_states:
            pass
        else:
            todo.append(i)
    fut = mover.op_future()
    for i in todo:
        k = keys[i]
        d.reserve(k, dst.name, namespace, parents[i] if parents is not None else None)
        dst.reserving += 1
        mover.begin_op(k, dst, fut)
        if src is not None:
            d.begin_copy(k, src.name)
    dst.claimed -= claim  # the claim became reservations (or is not needed)
    open_res: dict[int, Reservation] = {}
    reserved_dir = set(todo)
    try:
        if not todo:
            return ok
        tkeys = [keys[i] for i in todo]
        try:
            res = await _reserve_by_namespace(mover, dst, tkeys, namespace)
        except BaseException as exc:
            if not backend_failure(exc):
                raise
            dst.record_failure("reserve", len(todo), exc)
            mover.metrics.failed.inc(dst.name, by=len(todo))  # none is reserved: none stored
            res = [None] * len(todo)
        got: list[tuple[int, Reservation]] = []
        for i, r in zip(todo, res, strict=True):
            if r is None:
                d.abort(keys[i], dst.name)
                reserved_dir.discard(i)
            else:
                got.append((i, r))
                open_res[i] = r
        if not got:
            return ok
        started = time.perf_counter()
        if link is not None:
            written = await link.transfer([keys[i] for i, _ in got], [r for _, r in got])
        else:
            assert data is not None
            written = await _write_user(mover, dst, [r for _, r in got], [data[i] for i, _ in got])
        failed = [r for (_, r), w in zip(got, written, strict=True) if not w]
        if failed:
            await abort_quietly(dst, failed)
            for (i, _), w in zip(got, written, strict=True):
                if not w:
                    open_res.pop(i, None)
        to_commit = [(i, r) for (i, r), w in zip(got, written, strict=True) if w]
        committed: list[bool] = [False] * len(to_commit)
        if to_commit:
            try:
                committed = await dst.backend.commit([r for _, r in to_commit])
            except BaseException as exc:
                if not backend_failure(exc):
                    raise
                dst.record_failure("commit", len(to_commit), exc)
                # the outcome is unknown (a reply lost after the work was done): pages the
                # backend holds are committed; aborting them would leave them held and
                # counted by the backend and known to no one
                committed = await _held(dst, [keys[i] for i, _ in to_commit])
                await abort_quietly(
                    dst, [r for (_, r), c in zip(to_commit, committed, strict=True) if not c]
                )
        if link is not None:
            link.account(len(got), sum(committed), time.perf_counter() - started)
        for (i, _), c in zip(to_commit, committed, strict=True):
            open_res.pop(i, None)
            k = keys[i]
            reserved_dir.discard(i)
            if c:
                d.commit(k, dst.name)
                entry = d.get(k)
                parent = parents[i] if parents is not None else None
                if parent is None and entry is not None:
                    parent = entry.parent  # a page moving between tiers keeps its parent
                planner.landed(dst.index, k, parent)
                ok[i] = True
            else:
                d.abort(k, dst.name)
        for i, _ in got:
            if not ok[i] and i in reserved_dir:
                d.abort(keys[i], dst.name)
                reserved_dir.discard(i)
        stored = sum(1 for i in todo if ok[i])
        if stored:
            mover.metrics.stored.inc(dst.name, by=stored)
            dst.record_success()
        if len(todo) - stored:
            mover.metrics.failed.inc(dst.name, by=len(todo) - stored)
        return ok
    finally:
        try:
            if open_res:  # an exception cut the batch short: nothing half-visible
                await abort_quietly(dst, list(open_res.values()))
        finally:  # whatever that await raises: an operation left open hangs its waiters
            for i in reserved_dir:
                if d.state(keys[i], dst.name) is PageState.RESERVED:
                    d.abort(keys[i], dst.name)
            dst.reserving -= len(todo)
            for i in todo:
                if src is not None:
                    d.end_copy(keys[i], src.name)
                mover.end_op(keys[i], dst)
            mover.changed(dst, *([src] if src is not None else []))


async def _reserve_by_namespace(
    mover: Mover, dst: Tier, keys: list[PageKey], namespace: str
) -> list[Reservation | None]:
    """Reserve ``keys`` in ``dst``, each under its own namespace label: ``namespace`` when
    given (fresh pages), else the one the directory recorded when the page was first
    stored (pages moving between tiers), so stores label every page. When a later
    group's call raises, the earlier groups' reservations are aborted first."""
    if namespace:
        return await dst.backend.reserve(keys, namespace)
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        entry = mover.directory.get(k)
        groups.setdefault(entry.namespace if entry is not None else "", []).append(i)
    out: list[Reservation | None] = [None] * len(keys)
    try:
        for label, idx in groups.items():
            got = await dst.backend.reserve([keys[i] for i in idx], label)
            for i, r in zip(idx, got, strict=True):
                out[i] = r
    except BaseException:
        taken = [r for r in out if r is not None]
        if taken:
            await abort_quietly(dst, taken)
        raise
    return out


async def _write_user(
    mover: Mover, dst: Tier, reservations: list[Reservation], bufs: list[np.ndarray]
) -> list[bool]:
    """Write the caller's buffers into ``reservations`` (a store from the engine)."""
    start = time.perf_counter()
    try:
        written = await dst.backend.write(reservations, bufs)
    except BaseException as exc:
        if not backend_failure(exc):
            raise
        dst.record_failure("write", len(reservations), exc)
        return [False] * len(reservations)
    moved = sum(written)
    mover.metrics.record_transfer(
        f"in->{dst.name}", moved, moved * dst.backend.page_bytes, time.perf_counter() - start
    )
    return list(written)


async def _held(tier: Tier, keys: list[PageKey]) -> list[bool]:
    """Which of ``keys`` the backend holds committed (``False`` where it cannot say)."""
    try:
        held = await tier.backend.contains(keys)
    except Exception:
        return [False] * len(keys)
    return [bool(h) for h in held] if len(held) == len(keys) else [False] * len(keys)


async def abort_quietly(tier: Tier, reservations: list[Reservation]) -> None:
    """Abort ``reservations``; a failing backend is recorded, not raised."""
    try:
        await tier.backend.abort(reservations)
    except BaseException as exc:
        if not backend_failure(exc) and not isinstance(exc, KVTierUsageError):
            raise
        tier.record_failure("abort", len(reservations), exc)


async def forget(mover: Mover, tier: Tier, keys: list[PageKey]) -> set[PageKey]:
    """Delete ``keys`` (marked ``evicting``) from ``tier``'s backend and drop them from the
    index. Pages the backend may still hold after a failed delete (it answered ``False``
    or raised, and ``contains`` still finds them or cannot say: an outage) go back to
    ``committed`` and are returned: forgetting them would leave them counted by the
    backend and unreachable, and a delete reported done that was not. A later eviction or
    delete tries them again; a read of one that fails is a miss."""
    d = mover.directory
    try:
        gone = await tier.backend.delete(keys)
    except BaseException as exc:
        if not backend_failure(exc):
            raise
        tier.record_failure("delete", len(keys), exc)
        gone = [False] * len(keys)
    lingering: set[PageKey] = set()
    failed = [k for k, g in zip(keys, gone, strict=True) if not g]
    if failed:
        try:
            held = await tier.backend.contains(failed)
        except BaseException as exc:  # the tier is down: keep the entries (as purge_vanished)
            if not backend_failure(exc):
                raise
            tier.record_failure("contains", len(failed), exc)
            held = [True] * len(failed)
        lingering = {k for k, h in zip(failed, held, strict=True) if h}
        if lingering:
            tier.record_failure("delete", len(lingering))
    for k in keys:
        if k in lingering:
            d.cancel_evict(k, tier.name)
        else:
            d.remove(k, tier.name)
            mover.planner.left(tier.index, k)
    return lingering


async def purge_vanished(
    mover: Mover, tier: Tier, keys: list[PageKey], present: list[bool] | None = None
) -> None:
    """Forget pages a store no longer holds (e.g. dropped after a failed checksum);
    ``present``: what the store's ``contains`` just answered for ``keys``, if the caller
    asked it (else it is asked here)."""
    if tier.is_arena:
        return
    if present is None:
        try:
            present = await tier.backend.contains(keys)
        except BaseException as exc:
            if not backend_failure(exc) and not isinstance(exc, KVTierUsageError):
                raise
            return  # the tier is down: keep the entries, they may come back
    d = mover.directory
    for k, here in zip(keys, present, strict=True):
        entry = d.get(k)
        if (
            not here
            and d.state(k, tier.name) is PageState.COMMITTED
            and entry is not None
            and not entry.inflight.get(tier.name)
        ):
            d.remove(k, tier.name)
            mover.planner.left(tier.index, k)
    mover.changed(tier)
