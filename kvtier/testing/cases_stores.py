"""Conformance cases for stores: committed pages (and deletes, and puts after a delete)
survive close and reopen;
a variable-length store keeps blobs shorter than a page (what a codec writes)."""

from __future__ import annotations

import numpy as np

from kvtier.backend import Reservation, StoreBackend
from kvtier.keys import PageKey
from kvtier.testing.case import CaseContext, empty_pages, expect, read_back
from kvtier.testing.cases_races import describe_diff
from kvtier.testing.kit import CaseSkipped


def _keys_diff(listed: list[PageKey], want: list[PageKey]) -> str:
    extra = len(set(listed) - set(want))
    missing = len(set(want) - set(listed))
    return f"lists {len(listed)} keys: {missing} committed ones missing, {extra} others"


async def survives_reopen(ctx: CaseContext) -> None:
    if not ctx.persistent:
        raise CaseSkipped("backend not declared persistent")
    b = await ctx.backend()
    keys = ctx.keys(6)  # 0-2 kept, 3 deleted, 4 reserved only, 5 put, deleted, put again
    data = ctx.pages(7, b.page_bytes)
    expect(await b.put(keys[:4], data[:4]) == [True] * 4, "put failed")
    expect(await b.delete(keys[3:4]) == [True], "delete of a committed page failed")
    pending: list[Reservation] = [r for r in await b.reserve(keys[4:5]) if r is not None]
    await b.write(pending, data[4:5][: len(pending)])
    expect(await b.put(keys[5:], data[5:6]) == [True], "put failed")
    expect(await b.delete(keys[5:]) == [True], "delete of a committed page failed")
    expect(await b.put(keys[5:], data[6:]) == [True], "put of a key again after its delete failed")
    await b.close()
    again = await ctx.backend(clear=False)
    listed = await again.keys()
    kept = [*keys[:3], keys[5]]
    hint = ""
    if not listed:
        hint = (
            " (nothing came back: does the factory point at the same store on every call? "
            "Or does a delete's record outlive a later put of the key? The kit's keys repeat "
            "from case to case, so earlier cases deleted these keys)"
        )
    elif keys[5] not in listed:
        hint = (
            " (a page put again after its delete did not come back: the delete's record "
            "must not outlive a later put of the key)"
        )
    if keys[3] in listed:
        hint = " (a page deleted before close() came back: delete() must be durable too)"
    expect(set(listed) == set(kept), f"keys() after reopen {_keys_diff(listed, kept)}{hint}")
    expect(again.used_pages() == 4, f"used_pages() {again.used_pages()} after reopen, expected 4")
    ok, out = await read_back(again, keys)
    expect(ok == [True, True, True, False, False, True], f"get after reopen answered {ok}")
    for i, want in ((0, data[0]), (1, data[1]), (2, data[2]), (5, data[6])):
        stale = i == 5 and np.array_equal(out[5], data[5])
        expect(
            np.array_equal(out[i], want),
            f"page {i} differs after reopen: {describe_diff(out[i], want)}"
            + (" (the bytes of before its delete)" if stale else ""),
        )


async def short_blobs(ctx: CaseContext) -> None:
    """A store with ``variable_length``: ``write_blobs`` keeps blobs of 1 to page_bytes
    bytes and ``get_sized`` answers each one's length and bytes; plain ``get`` serves
    whole pages only (a shorter blob is a miss there)."""
    b = await ctx.backend()
    if not isinstance(b, StoreBackend) or not b.variable_length:
        raise CaseSkipped("not a variable-length store")
    pb = b.page_bytes
    sizes = [1, 17, pb // 2 + 3, pb - 1, pb]
    sizes = [n for n in sizes if 1 <= n <= pb]
    keys = ctx.keys(len(sizes))
    blobs = [p[:n].copy() for p, n in zip(ctx.pages(len(sizes), pb), sizes, strict=True)]
    res = await b.reserve(keys)
    expect(all(r is not None for r in res), "reserve in an empty store failed")
    taken = [r for r in res if r is not None]
    expect(await b.write_blobs(taken, blobs) == [True] * len(keys), "write_blobs failed")
    expect(await b.commit(taken) == [True] * len(keys), "commit of written blobs failed")
    out = empty_pages(b, len(keys))
    lengths = await b.get_sized(keys, out)
    expect(lengths == sizes, f"get_sized answered lengths {lengths}, expected {sizes}")
    for i, n in enumerate(sizes):
        expect(np.array_equal(out[i][:n], blobs[i]), f"blob {i} ({n} bytes) reads back wrong")
    ok, _ = await read_back(b, keys)
    expect(ok == [n == pb for n in sizes], f"plain get of short blobs answered {ok}")
    missing = ctx.keys(1)
    expect(await b.get_sized(missing, empty_pages(b, 1)) == [None], "get_sized of a missing key")
