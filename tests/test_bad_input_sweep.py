"""Every public KVCache call with each of 28 bad values in each argument: the call either
works (some values are legal there, e.g. an empty key list) or raises a KVTierError (a
usage error naming the argument), never a TypeError, ValueError or AttributeError from
deep inside; and the cache serves its pages afterwards."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from cache_kit import PAGE, config, open_cache

from kvtier.cache import KVCache
from kvtier.errors import KVTierError
from kvtier.keys import PageKey

BAD: list[Any] = [
    None, 1, -1, 1.5, math.nan, math.inf, "x", b"x", b"\0" * 16, [], [None], [1, 2], ["a"],
    [b"\0" * 15], [b"\0" * 16], np.zeros(3), np.zeros((2, 2)), np.array([1.5]),
    np.array(["a"]), {"a": 1}, object(), [PageKey(b"\1" * 16)] * 3, np.zeros(4, np.int64),
    list(range(1000)), True, 10**30, -(10**30), "",
]  # fmt: skip


def _calls(c: KVCache, keys: list[PageKey]) -> dict[str, Callable[[Any], Any]]:
    tokens, pages = np.arange(8), np.zeros((2, PAGE), np.uint8)
    out = np.zeros((2, PAGE), np.uint8)
    return {
        "store(tokens)": lambda a: c.store(a, pages),
        "store(pages)": lambda a: c.store(tokens, a),
        "store(parent)": lambda a: c.store(tokens, pages, a),
        "store_pages(keys)": lambda a: c.store_pages(a, pages),
        "store_pages(pages)": lambda a: c.store_pages(keys, a),
        "lookup": lambda a: c.lookup(a),
        "load": lambda a: c.load(a),
        "load(pin)": lambda a: c.load(keys, a),
        "read(keys)": lambda a: c.read(a, out),
        "read(out)": lambda a: c.read(keys, a),
        "prefetch(keys)": lambda a: c.prefetch(a, 1.0),
        "prefetch(deadline)": lambda a: c.prefetch(keys, a),
        "delete": lambda a: c.delete(a),
        "demote(tier)": lambda a: c.demote(a, keys),
        "demote(keys)": lambda a: c.demote("dram", a),
        "hint(kind)": lambda a: c.hint(a, keys, 1.0),
        "hint(keys)": lambda a: c.hint("ttl", a, 1.0),
        "hint(value)": lambda a: c.hint("ttl", keys, a),
        "page_keys": lambda a: c.page_keys(a),
        "page_keys(parent)": lambda a: c.page_keys(tokens, a),
        "reserve_private": lambda a: c.reserve_private(a),
        "release_private": lambda a: c.release_private(a),
    }


async def test_every_call_refuses_bad_values_with_a_kvtier_error(tmp_path: Any) -> None:
    async with open_cache(config(tmp_path)) as cache:
        data = np.arange(2 * PAGE, dtype=np.uint64).astype(np.uint8).reshape(2, PAGE)
        keys = (await cache.store(np.arange(8), data)).keys
        escaped: list[str] = []
        for name, call in _calls(cache, keys).items():
            for value in BAD:
                try:
                    got = call(value)
                    if asyncio.iscoroutine(got):
                        got = await asyncio.wait_for(got, 10)
                    if name.startswith("load") and got is not None:
                        cache.release(list(dict.fromkeys(value if name == "load" else keys)))
                except KVTierError:
                    pass
                except Exception as exc:  # the point of the test
                    escaped.append(f"{name} with {value!r:.30}: {type(exc).__name__}: {exc}")
        assert escaped == []
        out = np.zeros_like(data)
        assert await cache.read(keys, out) == [True, True]
        assert np.array_equal(out, data)
        assert cache.stats()["tiers"][0]["pinned_pages"] == 0


@pytest.mark.parametrize("value", [math.nan, -1.0, "soon"])
async def test_a_bad_deadline_is_named(tmp_path: Any, value: Any) -> None:
    async with open_cache(config(tmp_path)) as cache:
        with pytest.raises(KVTierError, match="deadline"):
            await cache.prefetch([PageKey(b"\0" * 16)], value)
