"""Hints through vLLM's ``kv_transfer_params`` (kvtier.integrations.vllm.hints): parsing
with errors that name the field, the pages each hint names, and the worker's calls into a
real KVCache made only after the saves in flight landed. Needs no vLLM."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError
from kvtier.integrations.vllm.hints import (
    HintRun,
    RequestHints,
    apply_hints,
    apply_hints_after,
    hint_calls,
    parse_request_hints,
)
from kvtier.keys import PageKey

BS = 32


def test_no_kvtier_entry_is_no_hints() -> None:
    assert parse_request_hints(None) is None
    assert parse_request_hints({}) is None
    assert parse_request_hints({"do_remote_prefill": True}) is None


def test_every_field_parses_into_whole_and_leading_hints() -> None:
    hints = parse_request_hints(
        {
            "kvtier": {
                "session": "open",
                "next_turn_s": 30,
                "ttl_s": 600.5,
                "priority": 2,
                "pin_tokens": 100,
                "shared_tokens": 200,
            }
        }
    )
    assert hints == RequestHints(
        whole=(("open", None), ("next_turn", 30.0), ("ttl", 600.5), ("priority", 2.0)),
        leading=(("pin", 100),),
        shared=200,
    )


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ([1, 2], "kv_transfer_params must be a JSON object"),
        ({"kvtier": "pin"}, "kv_transfer_params.kvtier must be a JSON object"),
        ({"kvtier": {"nxt_turn_s": 3}}, "unknown field(s) nxt_turn_s"),
        ({"kvtier": {"session": "opened"}}, "session must be 'open' or 'close'"),
        ({"kvtier": {"next_turn_s": -1}}, "next_turn_s must be >= 0"),
        ({"kvtier": {"ttl_s": "10"}}, "ttl_s must be a finite number"),
        ({"kvtier": {"ttl_s": float("nan")}}, "ttl_s must be a finite number"),
        ({"kvtier": {"ttl_s": float("inf")}}, "ttl_s must be a finite number"),
        ({"kvtier": {"next_turn_s": 10**400}}, "next_turn_s must be a finite number"),
        ({"kvtier": {"priority": 0}}, "priority must be > 0"),
        ({"kvtier": {"priority": True}}, "priority must be a finite number"),
        ({"kvtier": {"pin_tokens": 1.5}}, "pin_tokens must be a whole number"),
        ({"kvtier": {"shared_tokens": -3}}, "shared_tokens must be a whole number"),
        ({"kvtier": {"session": "close", "next_turn_s": 5}}, "cannot come with"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_field(entry: Any, names: str) -> None:
    with pytest.raises(KVTierUsageError) as err:
        parse_request_hints(entry)
    assert names in str(err.value)


def test_session_hints_skip_the_pinned_or_shared_prefix() -> None:
    hints = parse_request_hints({"kvtier": {"session": "close", "pin_tokens": 2 * BS + 5}})
    assert hints is not None
    assert hints.runs("r", 6, BS) == [
        HintRun("r", "pin", 0, 2),
        HintRun("r", "close", 2, 4),
    ]
    shared = parse_request_hints({"kvtier": {"next_turn_s": 9, "shared_tokens": 3 * BS}})
    assert shared is not None
    assert shared.runs("r", 5, BS) == [HintRun("r", "next_turn", 3, 2, 9.0)]
    # a request no longer than its shared prefix says nothing about its own pages
    assert shared.runs("r", 3, BS) == []
    assert hints.runs("r", 0, BS) == []


def test_pin_covers_whole_pages_only_and_at_most_the_request() -> None:
    hints = parse_request_hints({"kvtier": {"pin_tokens": 10 * BS, "unpin_tokens": BS - 1}})
    assert hints is not None
    assert hints.runs("r", 4, BS) == [HintRun("r", "pin", 0, 4)]


def test_hint_calls_use_the_worker_keys_and_leave_out_unknown_pages() -> None:
    keys = {"a": [bytes([i]) * 16 for i in range(4)]}
    runs = [HintRun("a", "ttl", 2, 5, 1.0), HintRun("b", "close", 0, 2), HintRun("a", "pin", 0, 1)]
    calls = hint_calls(runs, lambda rid: keys.get(rid, []))
    assert calls == [("ttl", keys["a"][2:4], 1.0), ("pin", keys["a"][:1], None)]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float | None]] = []

    def hint(self, kind: str, keys: Any, value: float | None = None) -> None:
        self.calls.append((kind, len(keys), value))


async def test_hints_wait_for_every_save_in_flight() -> None:
    rec = Recorder()
    store: concurrent.futures.Future[None] = concurrent.futures.Future()
    task = asyncio.ensure_future(apply_hints_after(rec, [store], [("close", [b"k" * 16], None)]))
    await asyncio.sleep(0.05)
    assert rec.calls == []  # the save has not landed yet
    store.set_exception(OSError("disk gone"))  # a failed save releases the hints too
    await asyncio.wait_for(task, 5)
    assert rec.calls == [("close", 1, None)]


def _config(tmp_path: Path, pages: int) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": f"{pages * 512}B", "eviction": "hinted"}
        ],
        "log": {"level": "warning"},
    }


async def test_a_pin_hint_keeps_pages_a_real_cache_would_evict(tmp_path: Path) -> None:
    """The calls reach the policy of a real cache: of two equally old prompts, the pinned
    one survives a stream of newer pages, the other does not."""
    async with KVCache(_config(tmp_path, 16), configure_log=False) as cache:
        pinned = np.arange(16) + 1000
        other = np.arange(16) + 2000
        await cache.store(pinned, np.ones((4, 512), np.uint8))
        await cache.store(other, np.ones((4, 512), np.uint8))
        keys_pinned = list((await cache.lookup(pinned)).keys)
        assert len(keys_pinned) == 4
        apply_hints(cache, hint_calls([HintRun("a", "pin", 0, 4)], lambda rid: keys_pinned))
        for i in range(12):
            await cache.store(np.arange(16) + 10_000 * (i + 1), np.ones((4, 512), np.uint8))
        assert len((await cache.lookup(pinned)).keys) == 4
        assert len((await cache.lookup(other)).keys) < 4


async def test_a_hint_on_a_closed_cache_is_logged_not_raised(tmp_path: Path) -> None:
    cache = KVCache(_config(tmp_path, 8), configure_log=False)
    key: PageKey = b"\x01" * 16
    apply_hints(cache, [("close", [key], None)])  # not open: logged
    with pytest.raises(KVTierUsageError):
        cache.hint("close", [key])
