"""The scheduler side's planning, without an engine: what it answers, loads, saves and
holds for requests driven through vLLM's calls (fake requests and block lists; the lookup
answered by a stand-in). Runs in the vLLM environment (the metadata types are vLLM's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BS = 32


class FakeLookup:
    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.calls: list[int] = []
        self.scopes: list[str] = []

    def lookup(self, tokens: Any, flags: int = 0, scope: str = "") -> Any:
        from kvtier.integrations.vllm.lookup import LookupAnswer

        self.calls.append(len(tokens))
        self.scopes.append(scope)
        return LookupAnswer(
            min(self.pages, len(tokens) // BS), [("nvme", self.pages)], {"nvme": "store"}
        )

    def close(self) -> None:
        pass


def _side(
    tmp_path: Path,
    pages: int,
    loads: bool = True,
    saves: bool = True,
    groups: Any = None,
    **settings: Any,
) -> Any:
    from kvtier.integrations.vllm.identity import ParallelPlace
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.settings import ConnectorSettings

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS),
        kv_transfer_config=SimpleNamespace(engine_id="e"),
    )
    side = SchedulerSide(
        cfg, ConnectorSettings(**settings), ParallelPlace(), tmp_path, loads, saves, groups
    )
    side.client = FakeLookup(pages)
    return side


def _request(rid: str, n: int, computed: int = 0, **fields: Any) -> Any:
    tokens = list(range(n))
    return SimpleNamespace(
        request_id=rid, all_token_ids=tokens, num_tokens=n, num_computed_tokens=computed, **fields
    )


class Blocks:
    """vLLM's ``KVCacheBlocks`` of a request: one id list per KV cache group."""

    def __init__(self, ids: list[int], *other_groups: list[int]) -> None:
        self.groups = (ids, *other_groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def _output(scheduled: dict[str, int], spec: dict[str, list[int]] | None = None) -> Any:
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec or {})


def test_hit_is_whole_pages_beyond_the_local_cache_and_leaves_a_token(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=10)
    req = _request("a", 5 * BS)  # 5 whole pages: at most 4 can be loaded
    assert side.match(req, 0)[0] == 4 * BS
    assert side.match(req, 2 * BS)[0] == 2 * BS  # vLLM already has two
    assert len(side.client.calls) == 1  # the answer is reused while the request waits
    side2 = _side(tmp_path, pages=1)
    assert side2.match(_request("b", 3 * BS), 2 * BS)[0] == 0  # kvtier holds less than vLLM


def test_load_then_saves_only_what_kvtier_lacks(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=3)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(100, 110)),))
    req = _request("a", 6 * BS + 5)
    assert side.match(req, BS)[0] == 2 * BS  # pages 1-2 from kvtier
    side.after_alloc(req, Blocks(list(range(100, 110))), 2 * BS)
    req.num_computed_tokens = 3 * BS
    meta = side.build_meta(_output({"a": 3 * BS + 5}))
    assert [(r.first_page, r.block_ids) for r in meta.loads] == [(1, [101, 102])]
    assert [(r.first_page, r.block_ids) for r in meta.saves] == [(3, [103, 104, 105])]
    # token ids travel once, in pieces that follow each other
    assert [(d.req_id, d.first_page, len(d.tokens)) for d in meta.tokens] == [
        ("a", 0, 3 * BS),
        ("a", 3, 3 * BS),
    ]
    assert side.hit_sources(req) == {("nvme", "store"): 2 * BS}


def test_unverified_speculative_tokens_are_never_saved(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=0)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", BS + 20)  # prompt of 52 tokens
    side.match(req, 0)
    req.num_computed_tokens = BS + 20
    req.all_token_ids = list(range(BS + 30))  # 10 accepted output tokens
    # this step: the last accepted token + 4 drafts; only 2*BS - 1 verified tokens so far
    meta = side.build_meta(_output({"a": 5}, {"a": [1, 2, 3, 4]}))
    assert [(r.first_page, len(r.block_ids)) for r in meta.saves] == [(0, 1)]


def test_finished_request_saves_its_last_pages_and_holds_its_blocks(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=0)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", 2 * BS)
    side.match(req, 0)
    side.build_meta(_output({"a": 2 * BS}))  # both prompt pages saved now
    req.all_token_ids = list(range(3 * BS + 1))
    req.num_tokens = 3 * BS + 1
    req.num_computed_tokens = 3 * BS
    assert side.finished(req, (list(range(4)),)) is True
    meta = side.build_meta(_output({}))
    assert meta.holds == ["a"]
    assert [(r.first_page, r.block_ids) for r in meta.saves] == [(2, [2])]
    assert side.finished(_request("never-seen", 10), ([],)) is False


def test_a_failed_load_and_the_pages_after_it_are_not_saved_from_that_request(
    tmp_path: Path,
) -> None:
    """vLLM recomputes from a page whose load failed; in a docs-only probe under heavy
    preemption the pages saved after that recompute served wrong tokens on every later
    run. Not saved now (before: pages 2-4 were saved again); the next request of the
    prompt computes them the ordinary way."""
    side = _side(tmp_path, pages=4)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(200, 210)),))
    req = _request("a", 5 * BS + 1)
    side.match(req, 0)
    side.after_alloc(req, Blocks(list(range(200, 210))), 4 * BS)
    req.num_computed_tokens = 4 * BS
    side.build_meta(_output({"a": BS + 1}))
    side.loads_reported({202})  # page 2 could not be loaded: vLLM recomputes pages 2..
    req.num_computed_tokens = 2 * BS
    meta = side.build_meta(_output({"a": 3 * BS + 1}))
    assert meta.saves == []
    req.all_token_ids = list(range(6 * BS + 1))
    req.num_tokens = 6 * BS + 1
    req.num_computed_tokens = 6 * BS
    assert side.finished(req, (list(range(200, 210)),)) is False  # nothing left to save
    other = _request("b", 5 * BS + 1)  # the same prompt again, in a new request
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(300, 310)),))
    side.client = FakeLookup(2)  # the damaged page 2 is gone from kvtier
    side.match(other, 0)
    side.after_alloc(other, Blocks(list(range(300, 310))), 2 * BS)
    other.num_computed_tokens = 2 * BS
    meta = side.build_meta(_output({"b": 3 * BS + 1}))
    assert [(r.first_page, r.block_ids) for r in meta.saves] == [(2, [302, 303, 304])]


@pytest.mark.parametrize(("loads", "saves"), [(False, True), (True, False)])
def test_roles(tmp_path: Path, loads: bool, saves: bool) -> None:
    side = _side(tmp_path, pages=4, loads=loads, saves=saves)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", 6 * BS)
    assert side.match(req, 0)[0] == (4 * BS if loads else 0)
    req.num_computed_tokens = 0
    meta = side.build_meta(_output({"a": 6 * BS}))
    assert bool(meta.saves) == saves
    assert side.finished(req, (list(range(6)),)) is False or saves


def _finish(side: Any, req: Any, generated: int) -> Any:
    """Let ``req`` (its prompt all computed) generate ``generated`` tokens and finish."""
    n = len(req.all_token_ids) + generated
    req.all_token_ids = list(range(n))
    req.num_tokens = n
    req.num_computed_tokens = n - 1
    held = side.finished(req, (list(range(n // BS + 1)),))
    return held, side.build_meta(_output({}))


@pytest.mark.parametrize("saves", [True, False])
def test_a_finished_request_passes_its_hints_to_the_workers(tmp_path: Path, saves: bool) -> None:
    from kvtier.integrations.vllm.hints import HintRun

    side = _side(tmp_path, pages=0, saves=saves)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", 3 * BS)
    req.kv_transfer_params = {"kvtier": {"next_turn_s": 20, "pin_tokens": BS + 3}}
    side.match(req, 0)
    side.build_meta(_output({"a": 3 * BS}))
    held, meta = _finish(side, req, 2 * BS + 1)  # 5 whole pages of KV
    assert held is saves
    assert meta.hints == [HintRun("a", "pin", 0, 1), HintRun("a", "next_turn", 1, 4, 20.0)]
    # the workers know the token ids of every hinted page (a consumer saved none before)
    sent = sum(len(d.tokens) for d in meta.tokens) + (3 * BS if saves else 0)
    assert sent == 5 * BS
    assert side.build_meta(_output({})).hints == []  # sent once


def test_malformed_hints_are_counted_and_the_request_served(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=2)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", 3 * BS)
    req.kv_transfer_params = {"kvtier": {"next_turn": 20}}
    assert side.match(req, 0)[0] == 2 * BS  # the lookup is unaffected
    assert side.take_stats().data["hint_errors"] == 1
    side.build_meta(_output({"a": 3 * BS}))
    _held, meta = _finish(side, req, BS)
    assert meta.hints == []


def test_a_lora_or_salted_request_is_looked_up_and_saved_in_its_own_scope(
    tmp_path: Path,
) -> None:
    side = _side(tmp_path, pages=2)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    lora = SimpleNamespace(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")
    req = _request("a", 4 * BS + 1, lora_request=lora, cache_salt="tenant")
    assert side.match(req, 0)[0] == 2 * BS
    scope = side.client.scopes[-1]
    assert scope.startswith("+lora=sql@") and "+salt=" in scope and "tenant" not in scope
    side.after_alloc(req, Blocks(list(range(10))), 2 * BS)
    req.num_computed_tokens = 2 * BS
    meta = side.build_meta(_output({"a": 2 * BS + 1}))
    assert meta.tokens and all(d.scope == scope for d in meta.tokens)
    plain = _request("b", 4 * BS + 1)
    side.match(plain, 0)
    assert side.client.scopes[-1] == ""


@pytest.mark.parametrize(
    "fields", [{"prompt_embeds": object()}, {"mm_features": [object()]}], ids=["embeds", "mm"]
)
def test_requests_kvtier_cannot_key_are_neither_loaded_nor_saved(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """Multimodal inputs, and prompt embeddings that are not a tensor, are not keyed: their
    token ids alone (placeholders) would let one prompt load another's KV."""
    side = _side(tmp_path, pages=4)
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    req = _request("a", 5 * BS, **fields)
    assert side.match(req, 0)[0] == 0 and side.client.calls == []
    req.num_computed_tokens = 5 * BS
    meta = side.build_meta(_output({"a": 1}))
    assert meta.empty
    assert side.finished(req, (list(range(5)),)) is False
    assert side.take_stats().data["unkeyed_requests"] == 1


class TwoTierLookup(FakeLookup):
    """Answers ``dram`` pages on the top tier, then ``nvme`` pages below it."""

    def __init__(self, dram: int, nvme: int) -> None:
        super().__init__(dram + nvme)
        self.runs = [("dram", dram), ("nvme", nvme)]

    def lookup(self, tokens: Any, flags: int = 0, scope: str = "") -> Any:
        from kvtier.integrations.vllm.lookup import LookupAnswer

        self.calls.append(len(tokens))
        return LookupAnswer(
            min(self.pages, len(tokens) // BS), self.runs, {"dram": "arena", "nvme": "store"}
        )


@pytest.mark.parametrize(
    ("mode", "local", "expect"),
    [
        ("never", 0, False),
        ("always", 0, True),
        ("below-top", 0, True),  # pages 2-3 are on NVMe
        ("below-top", 2 * BS, True),
        ("always", 4 * BS, False),  # nothing to load
    ],
)
def test_which_hits_load_asynchronously(
    tmp_path: Path, mode: str, local: int, expect: bool
) -> None:
    side = _side(tmp_path, pages=0, load_async=mode)
    side.client = TwoTierLookup(dram=2, nvme=2)
    assert side.match(_request("a", 5 * BS), local) == (max(0, 4 * BS - local), expect)


def test_below_top_keeps_a_hit_held_on_the_top_tier_synchronous(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=0, load_async="below-top")
    side.client = TwoTierLookup(dram=4, nvme=0)
    assert side.match(_request("a", 5 * BS), 0) == (4 * BS, False)


def test_an_asynchronous_load_travels_apart_until_the_workers_report_it(tmp_path: Path) -> None:
    side = _side(tmp_path, pages=3, load_async="always")
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(100, 110)),))
    req = _request("a", 6 * BS + 5)
    assert side.match(req, 0) == (3 * BS, True)
    side.after_alloc(req, Blocks(list(range(100, 110))), 3 * BS)
    meta = side.build_meta(_output({}))  # the request waits: nothing scheduled
    assert meta.loads == [] and [(r.first_page, r.block_ids) for r in meta.async_loads] == [
        (0, [100, 101, 102])
    ]
    assert [(d.first_page, len(d.tokens)) for d in meta.tokens] == [(0, 3 * BS)]
    assert side.take_stats().data["async_loads"] == 1
    side.loads_reported(set(), set())  # a step passes, the load is still running
    side.loads_reported({101}, {"a"})  # done: page 1 failed
    # vLLM matches the request again (its num_computed_tokens cut to page 1): the failed
    # page and the ones after it are neither offered again nor saved from this request
    assert side.match(req, BS) == (0, False)
    req.num_computed_tokens = BS
    meta = side.build_meta(_output({"a": 5 * BS + 5}))
    assert meta.saves == []


def test_a_request_gone_before_its_asynchronous_load_is_sent_still_gets_it(
    tmp_path: Path,
) -> None:
    """vLLM frees an aborted waiting request's blocks only once the workers report its
    load over: the load is sent even without the request's state."""
    side = _side(tmp_path, pages=2, load_async="always")
    req = _request("a", 3 * BS)
    side.match(req, 0)
    side.after_alloc(req, Blocks([7, 8]), 2 * BS)
    side._reqs.clear()
    meta = side.build_meta(_output({}))
    assert [(r.req_id, r.block_ids) for r in meta.async_loads] == [("a", [7, 8])]


def test_a_hybrid_model_loads_asynchronously_and_saves_pages_every_group_holds(
    tmp_path: Path,
) -> None:
    """Two KV cache groups (full attention: group 0; a sliding window: group 1, whose null
    block 0 stands for blocks outside its window). Loads run asynchronously (a failure is
    reported per request); a page is saved only where both groups hold it."""
    from kvtier.integrations.vllm.groups import NOT_HELD, KVGroups

    side = _side(tmp_path, pages=4, groups=KVGroups(2, {}))
    full, window = list(range(100, 110)), [0, 0, 52, 53, 54, 0, 56, 0, 0, 0]
    pool = SimpleNamespace(null_block=SimpleNamespace(block_id=0))
    side.kv_cache_manager = SimpleNamespace(
        get_block_ids=lambda rid: (full, window), block_pool=pool
    )
    req = _request("a", 7 * BS + 5)
    assert side.match(req, 0) == (4 * BS, True)  # asynchronous although the setting is "never"
    side.after_alloc(req, Blocks(full, window), 4 * BS)
    meta = side.build_meta(_output({}))
    assert meta.loads == []
    assert [(r.first_page, r.block_ids) for r in meta.async_loads] == [
        (0, [(100, NOT_HELD), (101, NOT_HELD), (102, 52), (103, 53)])
    ]
    # the load failed: vLLM recomputes the request from its first token, and kvtier neither
    # offers nor saves any of its pages again
    side.loads_reported(set(), {"a"}, {"a"})
    assert side.match(req, 0) == (0, False)
    req.num_computed_tokens = 0
    assert side.build_meta(_output({"a": 7 * BS + 5})).saves == []
    # a new request of another prompt saves the pages both groups hold
    other = _request("b", 7 * BS + 5)
    side.client = FakeLookup(0)
    assert side.match(other, 0) == (0, False)
    side.after_alloc(other, Blocks(full, window), 0)
    meta = side.build_meta(_output({"b": 7 * BS + 5}))
    assert [(r.first_page, r.block_ids) for r in meta.saves] == [
        (2, [(102, 52), (103, 53), (104, 54)]),
        (6, [(106, 56)]),
    ]  # pages 0, 1 and 5: the window group no longer holds them
    other.all_token_ids = list(range(9 * BS + 1))
    other.num_tokens = 9 * BS + 1
    other.num_computed_tokens = 9 * BS
    window[7:9] = [57, 58]
    assert side.finished(other, (full, window)) is True
    assert [(r.first_page, r.block_ids) for r in side.build_meta(_output({})).saves] == [
        (7, [(107, 57), (108, 58)])
    ]
