"""The conformance cases: one function per rule of :mod:`kvtier.backend`'s contract.

Each case gets a :class:`CaseContext`, opens a fresh (emptied) backend through it, and
fails with :class:`~kvtier.testing.kit.ConformanceError` saying what broke.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvtier.backend import ArenaBackend, Backend, BackendClosedError, Reservation
from kvtier.errors import KVTierUsageError
from kvtier.testing.case import (
    MAX_FILL_PAGES,
    Case,
    CaseContext,
    empty_pages,
    expect,
    read_back,
)
from kvtier.testing.cases_ownership import (
    cancelled_get_stops_writing,
    delete_spares_reservations,
    get_stops_writing_when_it_returns,
    racing_commits_keep_one_page,
    write_keeps_no_reference,
)
from kvtier.testing.cases_races import (
    close_stops_threads,
    describe_diff,
    get_during_delete_keeps_its_bytes,
    loop_not_blocked,
    puts_race_for_the_last_room,
)
from kvtier.testing.cases_reservations import (
    aborted_writes_never_served,
    bad_blobs_rejected,
    present_reservations_change_nothing,
    reserved_key_is_not_present,
    write_takes_bytes_like,
)
from kvtier.testing.cases_stores import short_blobs, survives_reopen
from kvtier.testing.kit import CaseSkipped, ConformanceError, build


async def _expect_usage_error(what: str, call: Callable[[], Awaitable[Any]]) -> None:
    try:
        await call()
    except KVTierUsageError:
        return
    except Exception as exc:
        raise ConformanceError(f"{what}: raised {exc!r}, expected KVTierUsageError") from exc
    raise ConformanceError(f"{what}: accepted, expected KVTierUsageError")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b))


# -- lifecycle --------------------------------------------------------------------------


async def open_close_idempotent(ctx: CaseContext) -> None:
    b = await ctx.backend()
    await b.open()  # second open: no error, nothing lost
    keys = ctx.keys(1)
    expect(await b.put(keys, ctx.pages(1, b.page_bytes)) == [True], "put after open failed")
    await b.open()
    expect(await b.contains(keys) == [True], "a second open() lost a committed page")
    await b.close()
    await b.close()


async def closed_raises(ctx: CaseContext) -> None:
    fresh = await build(ctx.factory)
    page = np.zeros(fresh.page_bytes, dtype=np.uint8)
    k = ctx.keys(1)
    fake = Reservation(k[0], 0)

    async def all_calls(b: Backend, when: str) -> None:
        calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("reserve", lambda: b.reserve(k)),
            ("write", lambda: b.write([fake], [page])),
            ("commit", lambda: b.commit([fake])),
            ("abort", lambda: b.abort([fake])),
            ("put", lambda: b.put(k, [page])),
            ("get", lambda: b.get(k, [page])),
            ("contains", lambda: b.contains(k)),
            ("exists", lambda: b.exists(k)),
            ("delete", lambda: b.delete(k)),
            ("keys", lambda: b.keys()),
        ]
        for name, call in calls:
            try:
                await call()
            except BackendClosedError:
                continue
            except Exception as exc:
                raise ConformanceError(
                    f"{name}() {when} raised {exc!r}, expected BackendClosedError"
                ) from exc
            raise ConformanceError(f"{name}() {when} did not raise BackendClosedError")

    await all_calls(fresh, "before open()")
    b = await ctx.backend()
    await b.close()
    await all_calls(b, "after close()")


# -- the keyed interface ----------------------------------------------------------------


async def round_trip(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(5)
    data = ctx.pages(5, b.page_bytes)
    expect(await b.put(keys, data) == [True] * 5, "put of 5 pages into an empty backend failed")
    expect(b.used_pages() == 5, f"used_pages() is {b.used_pages()} after 5 puts, expected 5")
    ok, out = await read_back(b, keys)
    expect(ok == [True] * 5, f"get of 5 committed pages answered {ok}")
    for i in range(5):
        expect(
            _same(out[i], data[i]),
            f"page {i} read back differs from what was put: {describe_diff(out[i], data[i])}",
        )
    expect(await b.contains(keys) == [True] * 5, "contains() misses committed pages")
    listed = await b.keys()
    expect(set(listed) == set(keys), "keys() differs from the committed keys")
    expect(len(listed) == len(keys), f"keys() lists {len(listed)} keys for 5 committed pages")
    # bytes-like buffers are accepted too
    more = ctx.keys(1)
    expect(await b.put(more, [bytes(data[0])]) == [True], "put of a bytes buffer failed")
    ok, out = await read_back(b, more)
    expect(ok == [True] and _same(out[0], data[0]), "bytes buffer did not round-trip")


async def per_item_results(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(4)
    data = ctx.pages(4, b.page_bytes)
    expect(await b.put(keys[0::2], data[0::2]) == [True, True], "put of 2 pages failed")
    ok, out = await read_back(b, keys)
    expect(ok == [True, False, True, False], f"mixed get answered {ok}, expected T,F,T,F")
    expect(
        _same(out[0], data[0]) and _same(out[2], data[2]), "hits in a mixed get hold wrong bytes"
    )
    expect(await b.contains(keys) == [True, False, True, False], "mixed contains() per item wrong")
    # one key twice in a batch (two requests sharing a prefix): both buffers are filled
    ok, out = await read_back(b, [keys[0], keys[2], keys[0]])
    expect(ok == [True, True, True], f"get of a key twice in a batch answered {ok}")
    expect(
        _same(out[0], data[0]) and _same(out[2], data[0]),
        "get of a key twice in a batch did not fill both buffers with its page",
    )


async def uncommitted_invisible(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(2)
    data = ctx.pages(2, b.page_bytes)
    res = await b.reserve(keys)
    expect(all(r is not None for r in res), "reserve of 2 keys in an empty backend failed")
    taken = [r for r in res if r is not None]
    expect(b.used_pages() == 2, f"used_pages() {b.used_pages()} does not count reservations")
    for phase in ("reserved", "written"):
        expect(await b.contains(keys) == [False, False], f"{phase} page visible to contains()")
        expect(await b.exists(keys) == 0, f"{phase} page counted by exists()")
        expect(await b.keys() == [], f"{phase} page listed by keys()")
        ok, _ = await read_back(b, keys)
        expect(ok == [False, False], f"{phase} page served by get()")
        if phase == "reserved":
            expect(await b.write(taken, data) == [True, True], "write of reserved pages failed")
    expect(await b.commit(taken[:1]) == [True], "commit of a written page failed")
    expect(await b.contains(keys) == [True, False], "only the committed page may be visible")
    ok, out = await read_back(b, keys[:1])
    expect(ok == [True] and _same(out[0], data[0]), "committed page reads back wrong")
    await b.abort(taken[1:])


async def abort_frees_space(ctx: CaseContext) -> None:
    b = await ctx.backend()
    n = b.capacity_pages
    if n > MAX_FILL_PAGES:
        raise CaseSkipped(f"capacity {n} pages is too large to fill in a test")
    keys = ctx.keys(n + 1)
    res = await b.reserve(keys[:n])
    expect(all(r is not None for r in res), f"could not reserve all {n} pages of capacity")
    expect(await b.reserve(keys[n:]) == [None], "reserve beyond capacity did not answer None")
    taken = [r for r in res if r is not None]
    await b.abort(taken[:1])
    expect(b.used_pages() == n - 1, f"used_pages() {b.used_pages()} after abort, expected {n - 1}")
    again = await b.reserve(keys[n:])
    expect(again[0] is not None, "space given back by abort() cannot be reserved again")
    rest = [r for r in again if r is not None] + taken[1:]
    await b.abort(rest)
    expect(b.used_pages() == 0, f"used_pages() {b.used_pages()} after aborting everything")
    expect(await b.contains(keys) == [False] * (n + 1), "an aborted key is visible")
    # an aborted reservation can no longer be written nor committed
    expect(
        await b.write(taken[:1], ctx.pages(1, b.page_bytes)) == [False],
        "write into an aborted reservation answered True (write must answer False where "
        "nothing was written)",
    )
    expect(await b.commit(taken[:1]) == [False], "commit of an aborted reservation succeeded")
    expect(await b.contains(keys[:1]) == [False], "an aborted key became visible at commit")


async def put_existing_is_noop(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(1)
    first, second = ctx.pages(2, b.page_bytes)
    expect(await b.put(keys, [first]) == [True], "first put failed")
    used = b.used_pages()
    expect(await b.put(keys, [second]) == [True], "put of a committed key did not succeed")
    expect(b.used_pages() == used, "put of a committed key took more space")
    ok, out = await read_back(b, keys)
    expect(ok == [True] and _same(out[0], first), "put of a committed key changed its bytes")
    res = await b.reserve(keys)
    expect(res[0] is not None and res[0].present, "reserve of a committed key is not 'present'")
    # the same key twice in one batch
    dup = ctx.keys(1) * 2
    expect(await b.put(dup, [first, first]) == [True, True], "one key twice in a batch failed")
    expect(b.used_pages() == used + 1, "one key twice in a batch took two pages")


async def exists_counts_prefix(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(4)
    data = ctx.pages(4, b.page_bytes)
    expect(await b.put([keys[0], keys[2], keys[3]], [data[0], data[2], data[3]]) == [True] * 3,
           "put of 3 pages failed")  # fmt: skip
    expect(await b.exists(keys) == 1, "exists() with the 2nd key missing is not 1")
    expect(await b.exists(keys[1:]) == 0, "exists() with the 1st key missing is not 0")
    expect(await b.exists(keys[2:]) == 2, "exists() of 2 present keys is not 2")
    expect(await b.exists([]) == 0, "exists([]) is not 0")


async def delete_removes(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(2)
    data = ctx.pages(2, b.page_bytes)
    expect(await b.put(keys[:1], data[:1]) == [True], "put failed")
    ok, _ = await read_back(b, keys[:1])  # a read first: caches it fills must not outlive delete
    expect(ok == [True], "get of a committed page missed")
    expect(await b.delete(keys) == [True, False], "delete of [present, missing] is not [T, F]")
    expect(await b.contains(keys[:1]) == [False], "deleted key still contained")
    ok, _ = await read_back(b, keys[:1])
    expect(ok == [False], "deleted key still served")
    expect(b.used_pages() == 0, f"used_pages() {b.used_pages()} after deleting everything")
    expect(await b.delete(keys[:1]) == [False], "second delete of a key answered True")
    expect(await b.put(keys[:1], data[1:]) == [True], "put after delete failed")
    ok, out = await read_back(b, keys[:1])
    expect(
        ok == [True] and _same(out[0], data[1]),
        "a key put again after delete (with other bytes) serves the bytes of before the delete"
        if ok == [True] and _same(out[0], data[0])
        else "a key put again after delete reads wrong",
    )


async def capacity_honoured(ctx: CaseContext) -> None:
    b = await ctx.backend()
    n = b.capacity_pages
    if n > MAX_FILL_PAGES:
        raise CaseSkipped(f"capacity {n} pages is too large to fill in a test")
    keys = ctx.keys(n + 2)
    data = ctx.pages(1, b.page_bytes) * (n + 2)
    ok = await b.put(keys, data)
    expect(ok == [True] * n + [False] * 2, f"put of capacity+2 pages answered {ok.count(True)} "
           f"True of {n + 2}, expected the first {n}")  # fmt: skip
    expect(b.used_pages() == n, f"used_pages() {b.used_pages()} at capacity {n}")
    expect(await b.reserve(keys[-1:]) == [None], "reserve when full did not answer None")
    expect(await b.delete(keys[:1]) == [True], "delete when full failed")
    expect(await b.put(keys[-1:], data[:1]) == [True], "put after freeing one page failed")


async def bad_buffers_rejected(ctx: CaseContext) -> None:
    b = await ctx.backend()
    pb = b.page_bytes
    k = ctx.keys(1)
    bad: list[tuple[str, Any]] = [
        ("a buffer one byte short", np.zeros(pb - 1, dtype=np.uint8)),
        ("a buffer one byte long", np.zeros(pb + 1, dtype=np.uint8)),
        ("a float32 buffer", np.zeros(max(1, pb // 4), dtype=np.float32)),
        ("a 2-D buffer", np.zeros((1, pb), dtype=np.uint8)),
        ("a non-contiguous buffer", np.zeros(2 * pb, dtype=np.uint8)[::2]),
        ("a list", [0] * pb),
    ]
    for what, buf in bad:
        await _expect_usage_error(f"put of {what}", functools.partial(b.put, k, [buf]))
        expect(b.used_pages() == 0, f"a rejected put of {what} left space taken")
    good = ctx.pages(1, pb)
    await _expect_usage_error("put of 2 buffers for 1 key", lambda: b.put(k, good * 2))
    res = [r for r in await b.reserve(k) if r is not None]
    expect(len(res) == 1, "reserve of one key in an empty backend failed")
    for what, buf in bad[:4]:
        await _expect_usage_error(f"write of {what}", functools.partial(b.write, res, [buf]))
    await b.abort(res)
    expect(await b.put(k, good) == [True], "put failed")
    await _expect_usage_error(
        "get into a too-small buffer", lambda: b.get(k, [np.zeros(pb - 1, dtype=np.uint8)])
    )
    ro = np.zeros(pb, dtype=np.uint8)
    ro.flags.writeable = False
    await _expect_usage_error("get into a read-only buffer", lambda: b.get(k, [ro]))
    await _expect_usage_error("get with 2 buffers for 1 key", lambda: b.get(k, empty_pages(b, 2)))
    ok, out = await read_back(b, k)
    expect(ok == [True] and _same(out[0], good[0]), "a rejected call damaged a committed page")


async def missing_keys_miss(ctx: CaseContext) -> None:
    b = await ctx.backend()
    keys = ctx.keys(3)
    ok, _ = await read_back(b, keys)
    expect(ok == [False] * 3, f"get of never-stored keys answered {ok}")
    expect(await b.contains(keys) == [False] * 3, "contains() of never-stored keys not False")


async def empty_batches(ctx: CaseContext) -> None:
    b = await ctx.backend()
    expect(await b.reserve([]) == [], "reserve([]) is not []")
    expect(await b.write([], []) == [], "write([], []) is not []")
    expect(await b.commit([]) == [], "commit([]) is not []")
    await b.abort([])
    expect(await b.get([], []) == [], "get([], []) is not []")
    expect(await b.contains([]) == [], "contains([]) is not []")
    expect(await b.delete([]) == [], "delete([]) is not []")
    expect(await b.put([], []) == [], "put([], []) is not []")
    expect(await b.exists([]) == 0, "exists([]) is not 0")


async def concurrent_calls(ctx: CaseContext) -> None:
    b = await ctx.backend()
    n = min(b.capacity_pages // 2, 32)
    expect(n >= 1, "capacity too small for the concurrency case (needs >= 2 pages)")
    keys = ctx.keys(n)
    data = ctx.pages(n, b.page_bytes)
    # every key put by two tasks at once: both succeed, one copy is kept
    puts = [b.put([keys[i]], [data[i]]) for i in range(n)] * 2
    results = await asyncio.gather(*puts)
    expect(all(r == [True] for r in results), f"concurrent puts answered {results}")
    expect(b.used_pages() == n, f"used_pages() {b.used_pages()} after {n} distinct keys")

    async def read_one(i: int) -> bool:
        out = empty_pages(b, 1)
        ok = await b.get([keys[i]], out)
        return ok == [True] and _same(out[0], data[i])

    reads = await asyncio.gather(*(read_one(i) for i in range(n) for _ in range(2)))
    expect(all(reads), f"{reads.count(False)} of {len(reads)} concurrent gets wrong")
    deleted = await asyncio.gather(*(b.delete([k]) for k in keys))
    expect(all(d == [True] for d in deleted), "concurrent deletes of distinct keys failed")
    expect(b.used_pages() == 0, "space left taken after concurrent deletes")


# -- arenas -----------------------------------------------------------------------------


async def arena_zero_copy(ctx: CaseContext) -> None:
    b = await ctx.backend()
    if not isinstance(b, ArenaBackend):
        raise CaseSkipped("not an arena")
    if not b.host_addressable:
        raise CaseSkipped("slots live in device memory: no numpy views (host_addressable=False)")
    keys = ctx.keys(3)
    data = ctx.pages(3, b.page_bytes)
    expect(await b.put(keys[:1], data[:1]) == [True], "put failed")
    slot = b.slot_of(keys[0])
    expect(slot is not None, "slot_of() of a committed key is None")
    assert slot is not None
    expect(b.slot_of(keys[1]) is None, "slot_of() of a missing key is not None")
    view = b.view(slot)
    expect(view.dtype == np.uint8 and view.shape == (b.page_bytes,), "view() has wrong shape")
    expect(_same(view, data[0]), "view() of the slot does not show the page")
    tensor = b.tensor(slot)
    expect(tensor.data_ptr() == view.ctypes.data, "tensor() and view() are different memory")
    expect(np.shares_memory(b.view(slot), view), "two views of one slot do not share memory")
    tensor[0] = (int(view[0]) + 1) % 256
    expect(int(view[0]) == int(tensor[0]), "a write through tensor() is not seen through view()")
    ok, out = await read_back(b, keys[:1])
    expect(ok == [True] and int(out[0][0]) == int(tensor[0]), "get() misses a write via tensor()")
    # slot stable while committed, across other puts and deletes
    expect(await b.put(keys[1:], data[1:]) == [True, True], "put of 2 more pages failed")
    expect(await b.delete(keys[1:2]) == [True], "delete failed")
    expect(b.slot_of(keys[0]) == slot, "slot of a committed key moved")
    # fill in place through the reservation's view: write() must accept it (no copy needed)
    res = await b.reserve(keys[1:2])
    r = res[0]
    expect(r is not None and r.view is not None, "arena reservation carries no slot view")
    assert r is not None and r.view is not None
    r.view[:] = data[1]
    expect(await b.write([r], [r.view]) == [True], "write of the slot's own view failed")
    expect(await b.commit([r]) == [True], "commit failed")
    ok, out = await read_back(b, keys[1:2])
    expect(ok == [True] and _same(out[0], data[1]), "page filled in place reads back wrong")


CASES: tuple[Case, ...] = (
    Case("open_close_idempotent", "open() and close() may be called twice", open_close_idempotent),
    Case("closed_raises", "use before open / after close raises BackendClosedError", closed_raises),
    Case("round_trip", "put pages read back byte for byte", round_trip),
    Case("per_item_results", "a batch answers item by item (hits and misses)", per_item_results),
    Case("uncommitted_invisible", "reserved/written pages are invisible", uncommitted_invisible),
    Case("abort_frees_space", "abort gives reserved space back", abort_frees_space),
    Case("put_existing_is_noop", "put of a committed key is a no-op", put_existing_is_noop),
    Case(
        "aborted_writes_never_served",
        "a page written and then aborted is never served",
        aborted_writes_never_served,
    ),
    Case(
        "present_reservations_change_nothing",
        "writing, aborting or committing a 'present' reservation leaves the page as it is",
        present_reservations_change_nothing,
    ),
    Case(
        "reserved_key_is_not_present",
        "a key reserved, not committed, is not 'present' to a second reserve",
        reserved_key_is_not_present,
    ),
    Case("write_takes_bytes_like", "write accepts bytes-like buffers", write_takes_bytes_like),
    Case(
        "write_keeps_no_reference",
        "the caller's buffer may be reused after write",
        write_keeps_no_reference,
    ),
    Case(
        "racing_commits_keep_one_page",
        "a key committed twice holds one page, one write's bytes",
        racing_commits_keep_one_page,
    ),
    Case(
        "get_stops_writing_when_it_returns",
        "once get returns, nothing writes into the caller's buffers",
        get_stops_writing_when_it_returns,
    ),
    Case(
        "cancelled_get_stops_writing",
        "a cancelled get of a backend with get_finishes_before_raising writes no more",
        cancelled_get_stops_writing,
    ),
    Case("exists_counts_prefix", "exists() counts the leading present keys", exists_counts_prefix),
    Case("delete_removes", "delete removes committed keys, per item", delete_removes),
    Case(
        "delete_spares_reservations",
        "delete of a reserved, uncommitted key answers False and leaves it be",
        delete_spares_reservations,
    ),
    Case("capacity_honoured", "reserve answers None when full", capacity_honoured),
    Case("bad_buffers_rejected", "bad buffers raise KVTierUsageError", bad_buffers_rejected),
    Case("missing_keys_miss", "get of missing keys answers False", missing_keys_miss),
    Case("empty_batches", "empty batches are fine", empty_batches),
    Case("concurrent_calls", "concurrent calls on one loop stay correct", concurrent_calls),
    Case("loop_not_blocked", "a large batch does not block the event loop", loop_not_blocked),
    Case(
        "get_during_delete_keeps_its_bytes",
        "a get's hits hold their keys' pages though the keys are deleted and room reused",
        get_during_delete_keeps_its_bytes,
    ),
    Case(
        "puts_race_for_the_last_room",
        "puts racing for the last room never pass the capacity",
        puts_race_for_the_last_room,
    ),
    Case("close_stops_threads", "close() stops the threads a backend started", close_stops_threads),
    Case("arena_zero_copy", "arena views/tensors are zero-copy, slots stable", arena_zero_copy),
    Case("survives_reopen", "committed pages survive close and reopen", survives_reopen),
    Case("short_blobs", "variable-length stores keep blobs shorter than a page", short_blobs),
    Case(
        "bad_blobs_rejected",
        "write_blobs refuses empty blobs and blobs over a page",
        bad_blobs_rejected,
    ),
)
