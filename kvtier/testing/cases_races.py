"""Conformance cases about calls that overlap other work or outlive a backend: the loop
kept free during a large batch, a ``get`` still reading while its pages are deleted and
their room reused, puts racing for the last free room, and threads left running after
``close``."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time

import numpy as np

from kvtier.testing.case import (
    LOOP_HOLD_FLOOR_S,
    MAX_FILL_PAGES,
    CaseContext,
    empty_pages,
    expect,
    read_back,
)
from kvtier.testing.kit import CaseSkipped, ConformanceError

#: Pages a case keeps in flight at most (enough to overlap, small enough to stay quick).
IN_FLIGHT_PAGES = 64
#: Puts that race for the last free room (more than the room left).
RACING_PUTS = 8
#: Open / use / close cycles after a warm-up one, and how long their threads may take to end.
CYCLES = 3
THREADS_SETTLE_S = 2.0


def describe_diff(got: np.ndarray, want: np.ndarray) -> str:
    """Where two pages differ: how many bytes, and the first offset."""
    differ = np.flatnonzero(got != want)
    if differ.size == 0:
        return "no byte differs"
    return f"{differ.size} of {want.size} bytes differ, the first at offset {int(differ[0])}"


async def get_during_delete_keeps_its_bytes(ctx: CaseContext) -> None:
    """A ``get`` in flight while its keys are deleted and other pages are put into the
    room they freed: each key it answers a hit for holds that key's page (a miss is fine).
    A slot, block or file a read still copies from must not be reused before the read is
    over. Checked after 0 to 3 loop turns of the ``get``."""
    b = await ctx.backend()
    n = min(b.capacity_pages, IN_FLIGHT_PAGES)
    for turns in range(4):
        old, new = ctx.keys(n), ctx.keys(n)
        old_pages, new_pages = ctx.pages(n, b.page_bytes), ctx.pages(n, b.page_bytes)
        expect(await b.put(old, old_pages) == [True] * n, f"put of {n} pages failed")
        out = empty_pages(b, n)
        reading = asyncio.ensure_future(b.get(old, out))
        for _ in range(turns):
            await asyncio.sleep(0)
        try:
            await b.delete(old)
            await b.put(new, new_pages)  # into the freed room; False where it is still read
        finally:
            hits = await reading
        wrong = [
            i for i, hit in enumerate(hits) if hit and not np.array_equal(out[i], old_pages[i])
        ]
        if wrong:
            first = wrong[0]
            taken = any(np.array_equal(out[first], p) for p in new_pages)
            held = "another key's page put meanwhile" if taken else "bytes of no page"
            raise ConformanceError(
                f"a get() of {n} keys, deleted after {turns} loop turns of it and their room "
                f"filled by {n} other pages, answered a hit for {len(wrong)} keys whose "
                f"buffers hold other bytes (key {first}: {held}; "
                f"{describe_diff(out[first], old_pages[first])}): room a read still copies "
                "from must not be reused before the read is over"
            )
        await b.delete(new)


async def puts_race_for_the_last_room(ctx: CaseContext) -> None:
    """:data:`RACING_PUTS` single-page puts at once into a backend with room for 2: at
    most 2 succeed, at least 1 does, and ``used_pages()`` and ``keys()`` never pass the
    capacity (a ``reserve`` takes the room it checked before it awaits anything)."""
    b = await ctx.backend()
    n = b.capacity_pages
    if n > MAX_FILL_PAGES:
        raise CaseSkipped(f"capacity {n} pages is too large to fill in a test")
    room = min(2, n)
    fill = n - room
    keys = ctx.keys(fill + RACING_PUTS)
    (page,) = ctx.pages(1, b.page_bytes)
    if fill:
        expect(await b.put(keys[:fill], [page] * fill) == [True] * fill, f"put of {fill} failed")
    racing = keys[fill:]
    answers = await asyncio.gather(*(b.put([k], [page]) for k in racing))
    won = sum(a == [True] for a in answers)
    used, listed = b.used_pages(), len(await b.keys())
    expect(
        won <= room and used <= n and listed <= n,
        f"{len(racing)} puts at once with room for {room} pages: {won} answered True, "
        f"used_pages() {used}, keys() lists {listed}, capacity {n} (a reserve that awaits "
        "between its room check and taking the room lets every racer in)",
    )
    expect(won >= 1, f"{len(racing)} puts at once with room for {room} pages: none succeeded")
    ok, _ = await read_back(b, [k for k, a in zip(racing, answers, strict=True) if a == [True]])
    expect(all(ok), "a page whose racing put answered True is not served")


def _new_threads(before: set[int | None]) -> list[threading.Thread]:
    """Threads started since ``before`` that still run (the loop's own default executor,
    whose threads are named ``asyncio_N`` and shared by everyone, aside)."""
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and not t.name.startswith("asyncio")
    ]


async def close_stops_threads(ctx: CaseContext) -> None:
    """``close()`` stops the threads ``open()`` and the calls started: after a warm-up
    cycle (a pool started once per process is fine), :data:`CYCLES` open / put / get /
    delete / close cycles leave at most one thread running."""

    async def cycle() -> None:
        b = await ctx.backend()
        keys = ctx.keys(2)
        expect(await b.put(keys, ctx.pages(2, b.page_bytes)) == [True] * 2, "put failed")
        ok, _ = await read_back(b, keys)
        expect(ok == [True] * 2, "get of 2 committed pages missed")
        await b.delete(keys)
        await b.close()

    await cycle()
    before = {t.ident for t in threading.enumerate()}
    for _ in range(CYCLES):
        await cycle()
    deadline = time.monotonic() + THREADS_SETTLE_S
    while len(left := _new_threads(before)) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    names = ", ".join(sorted({t.name for t in left}))
    expect(
        len(left) <= 1,
        f"{len(left)} threads started during {CYCLES} open/close cycles still run "
        f"{THREADS_SETTLE_S:g} s after close() ({names}): close() must stop what its "
        "backend started (an override of close() must call super().close())",
    )


class _Heartbeat:
    """A task that records a timestamp every time the loop runs it."""

    def __init__(self) -> None:
        self.stop = False
        self.ticks: list[float] = []

    async def run(self) -> None:
        while not self.stop:
            self.ticks.append(time.perf_counter())
            await asyncio.sleep(0)


async def loop_not_blocked(ctx: CaseContext) -> None:
    """While a full-capacity put, then get, contains and delete run, the loop keeps
    serving other tasks: the longest stretch it is held is at most half the call's
    duration or
    :data:`LOOP_HOLD_FLOOR_S` plus the GIL switch interval, whichever is more (with tiny
    pages the loop's own bookkeeping is most of a call; a worker thread holding the GIL
    can delay the loop by a switch interval). A call too short to let a heartbeat run is
    fine within that bound. A heuristic on a busy machine, so the best of several attempts
    counts."""
    b = await ctx.backend()
    n = min(b.capacity_pages, 256)
    keys = ctx.keys(n)
    data = ctx.pages(n, b.page_bytes)
    out = empty_pages(b, n)
    worst = ""
    for _attempt in range(5):
        held: list[str] = []
        for op in ("put", "get", "contains", "delete"):
            beat = _Heartbeat()
            hb = asyncio.create_task(beat.run())
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            if op == "put":
                ok = await b.put(keys, data)
            elif op == "get":
                ok = await b.get(keys, out)
            elif op == "contains":
                ok = await b.contains(keys)
            else:
                ok = await b.delete(keys)
            t1 = time.perf_counter()
            beat.stop = True
            await hb
            expect(ok == [True] * n, f"full-capacity {op} failed")
            during = [t for t in beat.ticks if t0 <= t <= t1]
            gap = max(y - x for x, y in itertools.pairwise([t0, *during, t1]))
            allowed = max(0.5 * (t1 - t0), LOOP_HOLD_FLOOR_S + sys.getswitchinterval())
            if gap > allowed:
                held.append(
                    f"{op} held the loop {gap * 1e3:.2f} ms of {(t1 - t0) * 1e3:.2f} ms "
                    f"({len(during)} heartbeats ran meanwhile)"
                )
        same = all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
        expect(same, "wrong bytes read")
        if not held:
            return
        worst = "; ".join(held)
    raise ConformanceError(f"blocking work seems to run on the event loop: {worst}")
