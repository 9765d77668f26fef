"""Every public KVCache and SequenceManager call with each of 33 bad values in each
argument: the call either works (some values are legal there, e.g. an empty key list) or
raises a KVTierError (a usage error naming the argument), never a TypeError, ValueError or
AttributeError from deep inside; and the cache (or the block tables) serve what they held
before, afterwards."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from cache_kit import PAGE, config, open_cache

from kvtier.cache import KVCache
from kvtier.errors import KVTierError
from kvtier.keys import PageKey
from kvtier.sequences import SequenceManager

BAD: list[Any] = [
    None, 1, -1, 1.5, math.nan, math.inf, "x", b"x", b"\0" * 16, [], [None], [1, 2], ["a"],
    [b"\0" * 15], [b"\0" * 16], np.zeros(3), np.zeros((2, 2)), np.array([1.5]),
    np.array(["a"]), {"a": 1}, object(), [PageKey(b"\1" * 16)] * 3, np.zeros(4, np.int64),
    list(range(1000)), True, 10**30, -(10**30), "", torch.zeros(3), [-1], 99999,
    np.zeros((2, 2, 4, 2, 8), ">f2"), np.array([object()]),
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

        async def after(name: str, value: Any, got: Any) -> None:
            if name.startswith("load"):  # it worked: give its pins back
                cache.release(list(dict.fromkeys(value if name == "load" else keys)))

        assert await _escapes(_calls(cache, keys), after) == []
        out = np.zeros_like(data)
        assert await cache.read(keys, out) == [True, True]
        assert np.array_equal(out, data)
        assert cache.stats()["tiers"][0]["pinned_pages"] == 0


async def _escapes(calls: dict[str, Callable[[Any], Any]], after: Any = None) -> list[str]:
    """Each call with each bad value; what escaped as something other than a KVTierError.
    ``after(name, result)`` cleans up after a call that worked."""
    escaped: list[str] = []
    for name, call in calls.items():
        for value in BAD:
            try:
                got = call(value)
                if asyncio.iscoroutine(got):
                    got = await asyncio.wait_for(got, 10)
                if after is not None:
                    await after(name, value, got)
            except KVTierError:
                pass
            except Exception as exc:  # the point of the test
                escaped.append(f"{name} with {value!r:.30}: {type(exc).__name__}: {exc}")
    return escaped


async def test_every_sequence_call_refuses_bad_values_with_a_kvtier_error(tmp_path: Any) -> None:
    async with open_cache(config(tmp_path, dram_pages=64)) as cache:
        m = await SequenceManager.open(cache, 16)
        seq = m.create()
        spec = cache.spec
        tokens = list(range(spec.page_tokens))

        def kv() -> torch.Tensor:
            return torch.ones(tuple(spec.page_shape), dtype=torch.float16)

        await m.append(seq, tokens, kv())
        version = m.snapshot(seq)
        calls: dict[str, Callable[[Any], Any]] = {
            "append(seq_id)": lambda a: m.append(a, tokens, kv()),
            "append(tokens)": lambda a: m.append(seq, a, kv()),
            "append(kv)": lambda a: m.append(seq, tokens, a),
            "adopt_prefix(seq_id)": lambda a: m.adopt_prefix(a, tokens),
            "adopt_prefix(tokens)": lambda a: m.adopt_prefix(seq, a),
            "fork": lambda a: m.fork(a),
            "snapshot": lambda a: m.snapshot(a),
            "rollback(seq_id)": lambda a: m.rollback(a, version),
            "rollback(version)": lambda a: m.rollback(seq, a),
            "commit(version)": lambda a: m.commit(seq, a),
            "commit(keep)": lambda a: m.commit(seq, version, a),
            "truncate": lambda a: m.truncate(seq, a),
            "free": lambda a: m.free(a),
            "publish_pending": lambda a: m.publish_pending(a),
            "ensure_resident": lambda a: m.ensure_resident(a),
            "release": lambda a: m.release(a),
            "page": lambda a: m.page(a),
        }

        async def after(name: str, value: Any, got: Any) -> None:
            if name == "ensure_resident":
                await m.release(got)

        assert await _escapes(calls, after) == []
        m.check_invariants()
        await m.close()


@pytest.mark.parametrize("value", [math.nan, -1.0, "soon"])
async def test_a_bad_deadline_is_named(tmp_path: Any, value: Any) -> None:
    async with open_cache(config(tmp_path)) as cache:
        with pytest.raises(KVTierError, match="deadline"):
            await cache.prefetch([PageKey(b"\0" * 16)], value)
