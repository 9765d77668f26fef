"""Conformance cases for reservations past the happy path: aborted after a write,
``present`` ones (a reservation of a committed key), a key reserved twice, bytes-like
input and variable-length blobs out of bounds.

Each one is a way a backend written from the guide passed the kit while breaking the
contract (a docs-only audit wrote one variant per rule): an aborted write served, a
committed page deleted by the abort of a present reservation (the base ``put`` aborts
every reservation it took when its write is cancelled, present ones too), a key only
reserved answered ``present``, ``write`` refusing bytes, a blob too long truncated.
"""

from __future__ import annotations

import numpy as np

from kvtier.backend import Backend, Reservation, StoreBackend
from kvtier.errors import KVTierUsageError
from kvtier.testing.case import CaseContext, expect, read_back
from kvtier.testing.kit import CaseSkipped, ConformanceError


async def _reserved(
    ctx: CaseContext, b: Backend, n: int
) -> tuple[list[Reservation], list[np.ndarray]]:
    """``b``'s reservations of ``n`` new keys (all given) and ``n`` pages."""
    res = await b.reserve(ctx.keys(n))
    expect(all(r is not None for r in res), f"reserve of {n} keys in an empty backend failed")
    return [r for r in res if r is not None], ctx.pages(n, b.page_bytes)


async def aborted_writes_never_served(ctx: CaseContext) -> None:
    """Pages written into reservations that are then aborted are never visible; the
    reservation next to them still commits."""
    b = await ctx.backend()
    taken, data = await _reserved(ctx, b, 2)
    keys = [r.key for r in taken]
    expect(await b.write(taken, data) == [True, True], "write of reserved pages failed")
    await b.abort(taken[:1])
    expect(await b.contains(keys[:1]) == [False], "an aborted page is visible to contains()")
    ok, _ = await read_back(b, keys[:1])
    expect(
        ok == [False],
        "get() served a page whose reservation was aborted after its write (only committed "
        "pages may be served)",
    )
    expect(await b.commit(taken[1:]) == [True], "commit of a written page failed")
    ok, out = await read_back(b, keys)
    expect(ok == [False, True], f"after abort of one and commit of the other, get answered {ok}")
    expect(np.array_equal(out[1], data[1]), "the committed page reads back wrong")


async def present_reservations_change_nothing(ctx: CaseContext) -> None:
    """A reservation of a committed key (``present``) changes nothing: writing other
    bytes into it leaves the page, aborting it keeps the page (a cancelled ``put``
    aborts every reservation it took, present ones too), and committing it answers
    ``True`` only while the page is there. A shared store (``Backend.shared``: a pool
    whose pages other servers delete at any time, the pipeline checks them again) is not
    asked the last."""
    b = await ctx.backend()
    keys = ctx.keys(1)
    first, second = ctx.pages(2, b.page_bytes)
    expect(await b.put(keys, [first]) == [True], "put of one page failed")
    used = b.used_pages()
    r = (await b.reserve(keys))[0]
    expect(r is not None and r.present, "reserve of a committed key is not 'present'")
    assert r is not None
    await b.write([r], [second])
    await b.abort([r])
    ok, out = await read_back(b, keys)
    expect(
        ok == [True],
        "abort of a 'present' reservation removed the committed page (it must leave it be)",
    )
    expect(
        np.array_equal(out[0], first),
        "write into a 'present' reservation changed the committed page's bytes",
    )
    expect(b.used_pages() == used, f"used_pages() {b.used_pages()} after a present abort, "
           f"expected {used}")  # fmt: skip
    again = (await b.reserve(keys))[0]
    expect(again is not None and again.present, "reserve of a committed key is not 'present'")
    assert again is not None
    expect(await b.delete(keys) == [True], "delete of a committed page failed")
    if await b.commit([again]) == [True] and not b.shared:
        expect(
            await b.contains(keys) == [True],
            "commit of a 'present' reservation answered True for a key deleted meanwhile: "
            "after True the page must be visible",
        )


async def reserved_key_is_not_present(ctx: CaseContext) -> None:
    """A key reserved but not committed is not ``present`` to a second reserve: present
    promises a committed page (the caller skips its write and commit)."""
    b = await ctx.backend()
    taken, _ = await _reserved(ctx, b, 1)
    second = (await b.reserve([taken[0].key]))[0]
    try:
        expect(
            second is None or not second.present,
            "reserve of a key only reserved (not committed) answered 'present': its caller "
            "skips write and commit, and the page never appears if the first reservation "
            "is aborted",
        )
    finally:
        await b.abort([taken[0]] + ([second] if second is not None else []))


async def write_takes_bytes_like(ctx: CaseContext) -> None:
    """``write`` accepts bytes-like input (``bytes``, ``bytearray``, ``memoryview``)
    as well as numpy arrays, as the backend guide says."""
    b = await ctx.backend()
    taken, data = await _reserved(ctx, b, 3)
    bufs = [bytes(data[0]), bytearray(data[1]), memoryview(data[2].tobytes())]
    try:
        ok = await b.write(taken, bufs)
    except KVTierUsageError as exc:
        raise ConformanceError(
            f"write() refused bytes-like buffers ({exc}); bytes-like objects are accepted for input"
        ) from exc
    expect(ok == [True] * 3, f"write of bytes-like buffers answered {ok}")
    expect(await b.commit(taken) == [True] * 3, "commit of written pages failed")
    got, out = await read_back(b, [r.key for r in taken])
    expect(got == [True] * 3, "pages written from bytes-like buffers missed")
    for i, kind in enumerate(("bytes", "bytearray", "memoryview")):
        expect(np.array_equal(out[i], data[i]), f"a page written from {kind} reads back wrong")


async def bad_blobs_rejected(ctx: CaseContext) -> None:
    """A variable-length store's ``write_blobs`` raises :class:`KVTierUsageError` for a
    blob longer than a page or empty, instead of keeping part of it."""
    b = await ctx.backend()
    if not isinstance(b, StoreBackend) or not b.variable_length:
        raise CaseSkipped("not a variable-length store")
    taken, _ = await _reserved(ctx, b, 1)
    try:
        for n, what in ((b.page_bytes + 1, "longer than a page"), (0, "empty")):
            blob = np.ones(n, np.uint8)
            try:
                await b.write_blobs(taken, [blob])
            except KVTierUsageError:
                continue
            except Exception as exc:
                raise ConformanceError(
                    f"write_blobs of a blob {what} ({n} bytes) raised {exc!r}, expected "
                    "KVTierUsageError"
                ) from exc
            raise ConformanceError(
                f"write_blobs accepted a blob {what} ({n} bytes); expected KVTierUsageError "
                "(validate with kvtier.backend.check_blobs)"
            )
    finally:
        await b.abort(taken)
