"""The worker's loads (``kvtier.integrations.vllm.loads.Loads``) without an engine: a real
``KVCache`` on its own loop thread, CPU block tensors in vLLM's layout, the metadata
vLLM's scheduler side would send. Runs in the vLLM environment (the metadata types are
vLLM's)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.cache import KVCache
from kvtier.keys import page_keys

BLOCK, HEADS, CONTENT, LAYERS, BLOCKS = 16, 2, 32, 2, 12
PAGE_BYTES = LAYERS * HEADS * BLOCK * CONTENT * 2  # float16 KV (K and V in CONTENT)


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    from kvtier.integrations.vllm.loads import Loads
    from kvtier.integrations.vllm.loop_thread import LoopThread
    from kvtier.integrations.vllm.paged import PagedKV

    loop = LoopThread("test-loads")
    model = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": CONTENT // 2,
             "dtype": "float16", "page_tokens": BLOCK, "name": "loads"}  # fmt: skip
    tier = {"name": "dram", "backend": "dram", "capacity": 16 * PAGE_BYTES}
    config = {"model": model, "log": {"level": "warning"}, "tiers": [tier]}
    cache = loop.run(KVCache.open(config, env={}, configure_log=False))
    shape = (BLOCKS, HEADS, BLOCK, CONTENT)
    layers = [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]
    paged = PagedKV(layers)
    keys: dict[str, list[bytes]] = {}
    counts: dict[str, float] = {}

    def run_keys(run: Any) -> list[bytes] | None:
        have = keys.get(run.req_id)
        end = run.first_page + len(run.block_ids)
        return None if have is None or end > len(have) else have[run.first_page : end]

    def count(name: str, value: float) -> None:
        counts[name] = counts.get(name, 0) + value

    loads = Loads(loop, cache, paged, {}, run_keys, 5.0, count)
    try:
        yield {"loop": loop, "cache": cache, "paged": paged, "keys": keys,
               "counts": counts, "loads": loads, "run_keys": run_keys,
               "count": count}  # fmt: skip
    finally:
        loads.shutdown()
        loop.run(cache.close())
        loop.stop()


def _store(rig: dict[str, Any], req: str, pages: int, seed: int) -> np.ndarray:
    """Store ``pages`` random pages for request ``req``; their bytes."""
    cache = rig["cache"]
    tokens = np.arange(pages * BLOCK) + 1000 * seed
    data = np.random.default_rng(seed).integers(0, 256, (pages, PAGE_BYTES), dtype=np.uint8)
    rig["loop"].run(cache.store(tokens, data))
    rig["keys"][req] = page_keys(tokens, cache.namespace)
    return data


def _meta(**fields: Any) -> Any:
    from kvtier.integrations.vllm.metadata import KVTierMetadata

    return KVTierMetadata(**fields)


def _run(req: str, first: int, blocks: list[int]) -> Any:
    from kvtier.integrations.vllm.metadata import PageRun

    return PageRun(req, first, blocks)


def _received(loads: Any, want: set[str], timeout: float = 10.0) -> set[str]:
    """What ``received`` reports, polled as vLLM does once per step, until ``want``."""
    got: set[str] = set()
    end = time.monotonic() + timeout
    while not want <= got and time.monotonic() < end:
        got |= loads.received()
        time.sleep(0.01)
    return got


def _block_bytes(paged: Any, block: int) -> np.ndarray:
    return np.concatenate([t[block].view(torch.uint8).numpy().reshape(-1) for t in paged.layers])


def test_an_asynchronous_load_is_reported_once_its_pages_are_in_their_blocks(rig) -> None:  # type: ignore[no-untyped-def]
    data = _store(rig, "a", 3, seed=1)
    loads = rig["loads"]
    loads.plan(_meta(async_loads=[_run("a", 0, [5, 2, 9])]))
    assert _received(loads, {"a"}) == {"a"}
    assert loads.errors() == set()
    for i, block in enumerate([5, 2, 9]):
        assert np.array_equal(_block_bytes(rig["paged"], block), data[i])
    assert rig["counts"]["loaded_pages"] == 3
    assert loads.received() == set()  # reported once


def test_pages_kvtier_cannot_give_are_load_errors_reported_with_the_request(rig) -> None:  # type: ignore[no-untyped-def]
    _store(rig, "a", 2, seed=2)
    cache = rig["cache"]
    rig["loop"].run(cache.delete(rig["keys"]["a"][1:2]))  # page 1 gone since the lookup
    rig["keys"]["b"] = []  # no token ids for "b": its run cannot be named
    loads = rig["loads"]
    loads.plan(_meta(async_loads=[_run("a", 0, [3, 4]), _run("b", 0, [7])]))
    assert _received(loads, {"a", "b"}) == {"a", "b"}
    assert loads.errors() == {4, 7}
    assert not _block_bytes(rig["paged"], 4).any()  # a failed page is never scattered


def test_a_synchronous_load_waits_per_layer_and_leaves_asynchronous_ones_running(rig) -> None:  # type: ignore[no-untyped-def]
    first = _store(rig, "s", 1, seed=3)
    _store(rig, "a", 1, seed=4)
    loads = rig["loads"]
    loads.layer_of.update({"layer.0": 0, "layer.1": 1})
    loads.plan(_meta(loads=[_run("s", 0, [0])], async_loads=[_run("a", 0, [1])]))
    loads.start()
    loads.wait_layer("layer.0")
    loads.wait_layer("layer.1")
    assert np.array_equal(_block_bytes(rig["paged"], 0), first[0])
    assert loads.errors() == set()
    assert _received(loads, {"a"}) == {"a"}


def test_a_request_whose_keys_are_all_unknown_is_reported_at_once(rig) -> None:  # type: ignore[no-untyped-def]
    loads = rig["loads"]
    loads.plan(_meta(async_loads=[_run("x", 0, [6, 8])]))
    assert loads.received() == {"x"}
    assert loads.errors() == {6, 8}


def test_several_kv_cache_groups_load_per_layer_group_and_fail_per_request(  # type: ignore[no-untyped-def]
    rig,
) -> None:
    """vLLM's hybrid KV cache manager: layer 0 in a sliding-window group (group 1), layer 1
    in a full-attention group (group 0); a page's block is one id per group, ``NOT_HELD``
    where the window group does not hold it. vLLM cannot map a block id back to a request
    then, so a failed load is reported by request (``failed``), never as block ids."""
    from kvtier.integrations.vllm.groups import NOT_HELD
    from kvtier.integrations.vllm.loads import Loads
    from kvtier.integrations.vllm.paged import PagedKV

    paged = PagedKV(rig["paged"].layers, [1, 0])
    loads = Loads(rig["loop"], rig["cache"], paged, {}, rig["run_keys"], 5.0, rig["count"], True)
    try:
        data = _store(rig, "a", 2, seed=5)
        loads.plan(_meta(async_loads=[_run("a", 0, [(3, NOT_HELD), (4, 6)])]))
        assert _received(loads, {"a"}) == {"a"}
        assert loads.errors() == set() and loads.failed() == set()
        lb = paged.layer_bytes

        def layer_bytes(layer: int, block: int) -> np.ndarray:
            return paged.layers[layer][block].view(torch.uint8).numpy().reshape(-1)

        assert np.array_equal(layer_bytes(1, 3), data[0][lb : 2 * lb])
        assert np.array_equal(layer_bytes(1, 4), data[1][lb : 2 * lb])
        assert np.array_equal(layer_bytes(0, 6), data[1][:lb])
        assert not layer_bytes(0, 3).any() and not layer_bytes(0, 4).any()  # not its blocks

        _store(rig, "b", 2, seed=6)
        rig["loop"].run(rig["cache"].delete(rig["keys"]["b"][1:2]))  # gone since the lookup
        rig["keys"]["c"] = []  # no token ids for "c"
        runs = [_run("b", 0, [(7, 8), (9, 10)]), _run("c", 0, [(11, NOT_HELD)])]
        loads.plan(_meta(async_loads=runs))
        assert _received(loads, {"b", "c"}) == {"b", "c"}
        assert loads.failed() == {"b", "c"}
        assert loads.errors() == set()  # block ids would name other groups' blocks too
        assert not layer_bytes(1, 9).any() and not layer_bytes(0, 10).any()
    finally:
        loads.shutdown()
