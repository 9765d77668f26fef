"""Conformance cases about who owns a page's bytes: the caller's buffer is the caller's
once ``write`` or ``get`` returns (and once a ``get`` of a backend that promises
``get_finishes_before_raising`` is cancelled), a key committed twice, even by two writes
in flight at once, holds one whole page, and a delete does not touch a page still in
flight."""

from __future__ import annotations

import asyncio

import numpy as np

from kvtier.backend import Backend
from kvtier.testing.case import CaseContext, cancel_after, empty_pages, expect, read_back
from kvtier.testing.kit import CaseSkipped

#: How long a cancelled ``get`` is watched for late writes into the caller's buffers.
LATE_WRITE_WATCH_S = 0.05
#: Rounds of cancelling after 0, 1, 2, 3 loop turns (whether a late write lands is a race
#: with the copy: one round missed a late write about one run in twenty).
CANCEL_ROUNDS = 5
#: The byte the case fills the buffers with once a cancelled ``get`` is over.
MARK = 0x5A
#: Rounds of two writes of one key in flight at once, the second started after 0 to 3
#: loop turns (a mix is a race with the copies, so one round may miss it).
RACE_ROUNDS = 3


async def write_keeps_no_reference(ctx: CaseContext) -> None:
    """After ``put`` (and after ``write``, before ``commit``) returns, the caller may reuse
    its buffer at once: changing it must not change what ``get`` serves."""
    b = await ctx.backend()
    keys = ctx.keys(2)
    data = ctx.pages(2, b.page_bytes)
    other = ctx.pages(2, b.page_bytes)
    kept = [d.copy() for d in data]
    expect(await b.put(keys[:1], data[:1]) == [True], "put of 1 page failed")
    data[0][:] = other[0]  # the caller reuses its buffer
    ok, (page,) = await read_back(b, keys[:1])
    expect(ok == [True], "get of a committed page missed")
    expect(
        np.array_equal(page, kept[0]),
        "changing the caller's buffer after put() changed the stored page: write() kept a "
        "reference to it (copy the bytes, or write them out, before returning)",
    )
    res = await b.reserve(keys[1:])
    expect(res[0] is not None, "reserve of 1 key in a backend with room failed")
    taken = [r for r in res if r is not None]
    expect(await b.write(taken, data[1:]) == [True], "write of a reserved page failed")
    data[1][:] = other[1]  # reused between write and commit
    expect(await b.commit(taken) == [True], "commit of a written page failed")
    ok, (page,) = await read_back(b, keys[1:])
    expect(
        ok == [True] and np.array_equal(page, kept[1]),
        "changing the caller's buffer between write() and commit() changed the stored page",
    )


async def racing_commits_keep_one_page(ctx: CaseContext) -> None:
    """Two reservations of one absent key (two puts racing), written with different
    bytes (equal keys mean equal tokens, but KV computed in different batches may differ
    in its last bits): both commits succeed and the key holds one page, whose bytes are
    the whole of one of the two writes, never a mix. The writes run one after the other,
    then (:data:`RACE_ROUNDS` times, on new keys) in flight at once, the second started
    0 to 3 loop turns after the first, as two caches sharing a store do."""
    b = await ctx.backend()
    for turns in [None, *[t for _round in range(RACE_ROUNDS) for t in range(4)]]:
        await _race_one_key(b, ctx, turns)


async def _race_one_key(b: Backend, ctx: CaseContext, turns: int | None) -> None:
    """One key reserved twice and written with two pages: in turn (``turns`` None), or
    the second write started ``turns`` loop turns after the first, both in flight."""
    key = ctx.keys(1)
    first, second = ctx.pages(2, b.page_bytes)
    used = b.used_pages()
    r1 = await b.reserve(key)
    r2 = await b.reserve(key)
    expect(r1[0] is not None and r2[0] is not None, "reserve of an absent key failed")
    a, c = r1[0], r2[0]
    assert a is not None and c is not None
    if c.present:  # the backend saw the first reservation: nothing races
        await b.abort([a])
        return
    how = "one after the other" if turns is None else f"in flight at once ({turns} turns apart)"
    if turns is None:
        written = [await b.write([a], [first]), await b.write([c], [second])]
    else:
        one = asyncio.ensure_future(b.write([a], [first]))
        for _ in range(turns):
            await asyncio.sleep(0)
        written = list(await asyncio.gather(one, b.write([c], [second])))
    expect(written == [[True], [True]], f"writes of two reservations of one key, {how}, failed")
    expect(await b.commit([a]) == [True], "commit of the first reservation failed")
    expect(await b.commit([c]) == [True], "commit of a key committed meanwhile must succeed")
    ok, (page,) = await read_back(b, key)
    expect(ok == [True], "get of a key committed twice missed")
    expect(
        np.array_equal(page, first) or np.array_equal(page, second),
        f"a key committed twice, its two writes {how}, serves bytes that are neither "
        "write's: a mix of the two (each reservation must write to its own room)",
    )
    held = b.used_pages() - used
    expect(held == 1, f"one key committed twice holds {held} pages, not 1")
    expect(await b.delete(key) == [True], "delete of a key committed twice failed")


async def _late_writes(out: list[np.ndarray]) -> int:
    """Fill the caller's buffers with :data:`MARK`, wait :data:`LATE_WRITE_WATCH_S`, and
    count the buffers something wrote into meanwhile."""
    for o in out:
        o[:] = MARK
    await asyncio.sleep(LATE_WRITE_WATCH_S)
    return sum(not (o == MARK).all() for o in out)


async def get_stops_writing_when_it_returns(ctx: CaseContext) -> None:
    """Once ``get`` returns, the caller's buffers are the caller's: nothing the backend
    started (a thread, a straggling copy) writes into them any more. The cache gives such
    a buffer (a DRAM slot) to the next page at once, so a late write serves another
    page's bytes as it. Watched for :data:`LATE_WRITE_WATCH_S` after each of
    :data:`CANCEL_ROUNDS` gets."""
    b = await ctx.backend()
    n = min(b.capacity_pages, 16)
    keys = ctx.keys(n)
    expect(await b.put(keys, ctx.pages(n, b.page_bytes)) == [True] * n, "put failed")
    for _round in range(CANCEL_ROUNDS):
        out = empty_pages(b, n)
        expect(await b.get(keys, out) == [True] * n, "get of committed pages missed")
        late = await _late_writes(out)  # the caller reuses its buffers at once
        expect(
            late == 0,
            f"get() wrote into {late} of the caller's buffers after it had returned: wait "
            "for every copy it started before returning (a cache reuses those buffers for "
            "other pages at once)",
        )


async def delete_spares_reservations(ctx: CaseContext) -> None:
    """``delete`` removes committed pages only: for a key that is reserved and written but
    not committed (another writer's page in flight, on a store two caches share) it answers
    ``False`` and leaves the reservation as it was; its commit then succeeds and the page
    is served."""
    b = await ctx.backend()
    key = ctx.keys(1)
    (data,) = ctx.pages(1, b.page_bytes)
    res = await b.reserve(key)
    expect(res[0] is not None, "reserve of 1 key in a backend with room failed")
    taken = [r for r in res if r is not None]
    expect(await b.write(taken, [data]) == [True], "write of a reserved page failed")
    expect(
        await b.delete(key) == [False],
        "delete() of a key that is reserved but not committed answered True: only a "
        "committed page can be deleted",
    )
    expect(
        await b.commit(taken) == [True],
        "commit failed after a delete() of the same key: delete() must leave a reservation "
        "in flight alone",
    )
    ok, (page,) = await read_back(b, key)
    expect(ok == [True] and np.array_equal(page, data), "the page committed after a delete() "
           "of its key reads back wrong or not at all")  # fmt: skip


async def cancelled_get_stops_writing(ctx: CaseContext) -> None:
    """A backend that sets ``get_finishes_before_raising`` (the cache then awaits its
    ``get`` directly, with no shield): a ``get`` cancelled after 0 to 3 loop turns has
    stopped writing into the caller's buffers when it raises or returns
    (:data:`CANCEL_ROUNDS` times each)."""
    b = await ctx.backend()
    if not b.get_finishes_before_raising:
        raise CaseSkipped("get_finishes_before_raising is not set: the cache shields its gets")
    n = min(b.capacity_pages, 64)
    keys = ctx.keys(n)
    expect(await b.put(keys, ctx.pages(n, b.page_bytes)) == [True] * n, "put failed")
    for turns in [t for _round in range(CANCEL_ROUNDS) for t in range(4)]:
        out = empty_pages(b, n)
        await cancel_after(b.get(keys, out), turns)
        late = await _late_writes(out)  # the caller's own bytes, once get() is over
        expect(
            late == 0,
            f"a get() cancelled after {turns} loop turns wrote into {late} of the caller's "
            "buffers after it had returned: get_finishes_before_raising promises it waits "
            "for the work it started (or set it False)",
        )
