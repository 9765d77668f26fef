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


#: Pages :func:`survives_reopen` commits beside its six keys (in batches of 1, 2, 4, ...),
#: fewer when the backend holds fewer.
BULK_PAGES = 64


async def survives_reopen(ctx: CaseContext) -> None:
    """Committed pages (six keys with deletes, a reservation never committed and a put
    after a delete, then up to :data:`BULK_PAGES` more in growing batches) come back
    after close and reopen, byte for byte; deleted and uncommitted ones do not."""
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
    bulk_keys = ctx.keys(max(0, min(BULK_PAGES, b.capacity_pages - 6)))
    bulk = ctx.pages(len(bulk_keys), b.page_bytes)
    start, size = 0, 1
    while start < len(bulk_keys):
        batch = slice(start, start + size)
        n = len(bulk_keys[batch])
        expect(await b.put(bulk_keys[batch], bulk[batch]) == [True] * n, "put failed")
        start, size = start + n, size * 2
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
    lost = len(set(bulk_keys) - set(listed))
    if lost and not hint:
        hint = (
            f" ({lost} of {len(bulk_keys)} pages committed in batches of 1, 2, 4, ... are "
            "gone: every page whose commit() answered True must survive close())"
        )
    kept += bulk_keys
    expect(set(listed) == set(kept), f"keys() after reopen {_keys_diff(listed, kept)}{hint}")
    expect(
        again.used_pages() == len(kept),
        f"used_pages() {again.used_pages()} after reopen, expected {len(kept)}",
    )
    ok, out = await read_back(again, bulk_keys)
    bad = [
        i
        for i, (hit, page) in enumerate(zip(ok, out, strict=True))
        if not hit or (page != bulk[i]).any()
    ]
    expect(not bad, f"{len(bad)} of {len(bulk_keys)} committed pages read back wrong or not at "
           f"all after reopen (the first: page {bad[:1]})")  # fmt: skip
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
