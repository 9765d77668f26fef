"""Requests whose KV is not a function of their token ids alone (kvtier.integrations.vllm
.scope): a LoRA adapter or a cache salt gets a namespace of its own, prompt embeddings and
multimodal inputs are left alone; and the cache API keys, stores and looks up pages in a
namespace other than its own. The connector inside a real engine: tests/vllm_connector."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from cache_kit import PAGE, PT, config, open_cache

from kvtier.errors import KVTierUsageError
from kvtier.integrations.vllm.scope import RequestScope, request_scope, scoped
from kvtier.integrations.vllm.worker_parts import SaveBatch, label_runs
from kvtier.keys import Namespace


def _request(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "prompt_embeds": None,
        "mm_features": [],
        "lora_request": None,
        "cache_salt": None,
    }
    base.update(fields)
    return SimpleNamespace(**base)


def _lora(name: str, path: str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def test_plain_requests_use_the_engines_namespace() -> None:
    assert request_scope(_request()) == RequestScope()
    assert request_scope(SimpleNamespace()) == RequestScope()  # older vLLM: no such fields


def test_lora_and_salt_extend_the_model_id_and_never_store_the_salt() -> None:
    a = request_scope(_request(lora_request=_lora("sql", "/adapters/sql")))
    b = request_scope(_request(lora_request=_lora("sql", "/adapters/sql-v2")))
    c = request_scope(_request(lora_request=_lora("sql", "/adapters/sql")))
    assert a.skip is None and a.suffix.startswith("+lora=sql@") and a == c
    assert a != b  # re-pointing a name at another adapter: other pages (vLLM keys the path)
    salted = request_scope(_request(cache_salt="tenant-secret"))
    assert salted.suffix.startswith("+salt=") and "tenant-secret" not in salted.suffix
    assert salted != request_scope(_request(cache_salt="tenant-other"))
    both = request_scope(_request(lora_request=_lora("sql", "/adapters/sql"), cache_salt="t"))
    assert both.suffix.startswith(a.suffix + "+salt=")


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"prompt_embeds": np.zeros((4, 8))}, "prompt embeddings"),
        ({"mm_features": [object()]}, "multimodal inputs"),
    ],
)
def test_requests_kvtier_cannot_key_are_skipped(fields: dict[str, Any], why: str) -> None:
    assert request_scope(_request(**fields)) == RequestScope(skip=why)


def test_scoped_namespaces_differ_in_label_and_digest() -> None:
    ns = Namespace("org/m", "r1", rank=1)
    assert scoped(ns, "") is ns
    other = scoped(ns, "+salt=ab")
    assert other.model_id == "org/m+salt=ab" and other.rank == 1
    assert other.digest != ns.digest and Namespace.from_label(other.label) == other


def test_save_batch_groups_pages_by_namespace_and_saves_a_shared_block_once() -> None:
    run = SimpleNamespace
    keys = {"a": [b"a0", b"a1", b"a2"], "b": [b"b0", b"b1"], "c": [b"a0", b"c1"]}
    labels = {"b": "ns+salt"}
    batch = SaveBatch.of(
        [run(req_id="a", first_page=1, block_ids=[11, 12]),
         run(req_id="b", first_page=0, block_ids=[20, 21]),
         run(req_id="c", first_page=0, block_ids=[30, 31]),
         run(req_id="z", first_page=0, block_ids=[40])],  # keys not known yet: skipped
        keys, labels, "ns",
    )  # fmt: skip
    assert batch.keys == [b"a1", b"a2", b"a0", b"c1", b"b0", b"b1"]
    assert batch.parents == [b"a0", b"a1", b"\0" * 16, b"a0", b"\0" * 16, b"b0"]
    assert batch.blocks == [11, 12, 30, 31, 20, 21]
    assert label_runs(batch.labels) == [("ns", 0, 4), ("ns+salt", 4, 6)]
    assert label_runs([]) == []


async def test_a_cache_keys_stores_and_looks_up_in_another_namespace(tmp_path: Path) -> None:
    tokens = list(range(5 * PT))
    pages = np.full((5, PAGE), 3, np.uint8)
    async with open_cache(config(tmp_path)) as cache:
        lora = scoped(cache.namespace, "+lora=x@1")
        stored = await cache.store(tokens, pages, namespace=lora)
        assert all(stored.stored) and stored.keys == cache.page_keys(tokens, namespace=lora)
        assert (await cache.lookup(tokens)).keys == []  # the engine's own namespace: a miss
        hit = await cache.lookup(tokens, namespace=lora.label)  # a label works too
        assert hit.keys == stored.keys
        with pytest.raises(KVTierUsageError, match="not a namespace label"):
            await cache.lookup(tokens, namespace="nope")
        with pytest.raises(KVTierUsageError, match="namespace must be a Namespace"):
            cache.page_keys(tokens, namespace=5)  # type: ignore[arg-type]
