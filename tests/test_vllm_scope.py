"""Requests whose KV is not a function of their token ids alone (kvtier.integrations.vllm
.scope): a LoRA adapter, a cache salt or prompt embeddings get a namespace of their own
(prompt-embedding pages keyed by a digest of their rows), multimodal inputs are left
alone; and the cache API keys, stores and looks up pages in a namespace other than its
own. The connector inside a real engine: tests/vllm_connector."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from cache_kit import PAGE, PT, config, open_cache

from kvtier.errors import KVTierUsageError
from kvtier.integrations.vllm.scope import RequestScope, key_ids, request_scope, scoped
from kvtier.integrations.vllm.worker_parts import SaveBatch, label_runs
from kvtier.keys import Namespace, page_keys


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


def _item(identifier: Any, offset: int, length: int) -> SimpleNamespace:
    """A vLLM ``MultiModalFeatureSpec`` as kvtier reads it."""
    pos = SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(identifier=identifier, mm_position=pos, modality="image")


def test_multimodal_requests_kvtier_cannot_read_are_skipped() -> None:
    cases = {
        "no identifier": [_item(None, 0, 4)],
        "no placeholder range": [SimpleNamespace(identifier="img")],
        "range (0, 0)": [_item("img", 0, 0)],
    }
    for why, features in cases.items():
        scope = request_scope(_request(mm_features=features))
        assert scope.skip is not None and why in scope.skip, (why, scope.skip)
    embedded = _request(mm_features=[_item("img", 0, 4)], prompt_embeds=torch.zeros(4, 8))
    assert request_scope(embedded).skip == "multimodal inputs with prompt embeddings"


def _mm_ids(features: list[SimpleNamespace], tokens: list[int], pages: int) -> np.ndarray:
    scope = request_scope(_request(mm_features=features))
    assert scope.skip is None and scope.suffix == ""  # the engine's namespace
    return _ids(scope, tokens, pages).reshape(pages, BLOCK)


def test_multimodal_pages_are_keyed_by_the_items_they_overlap() -> None:
    """Placeholder ids are equal whatever the image: a page overlapping an image is keyed
    by the image's identifier and where it starts relative to the page."""
    tokens = list(range(100, 106)) + [7] * 8 + list(range(200, 210))  # image at 6, 8 long
    cat = _mm_ids([_item("cat", 6, 8)], tokens, 6)
    dog = _mm_ids([_item("dog", 6, 8)], tokens, 6)
    plain = np.asarray(tokens[:24], dtype=np.uint32).reshape(6, BLOCK)
    assert (cat[0] == plain[0]).all()  # before the image: text, shared with text prompts
    for p in (1, 2, 3):  # pages 1-3 overlap positions 6-13
        assert not (cat[p] == plain[p]).all() and not (cat[p] == dog[p]).all()
    assert (cat[4:] == plain[4:]).all()  # after it: token ids (the key chain differs)
    again = _mm_ids([_item("cat", 6, 8)], tokens, 6)
    assert (again == cat).all()
    shifted = _mm_ids([_item("cat", 5, 8)], [*tokens[:5], 7, *tokens[6:]], 6)
    assert not (shifted[1] == cat[1]).all()  # the same image one position earlier
    two = _mm_ids([_item("dog", 14, 2), _item("cat", 6, 8)], tokens, 6)  # any order
    assert (two[:3] == cat[:3]).all() and not (two[3] == cat[3]).all()


def test_multimodal_page_keys_differ_past_the_image_through_the_chain() -> None:
    ns = Namespace("m", page_tokens=BLOCK)
    tokens = [1, 2, 3, 4, 7, 7, 7, 7, 5, 6, 8, 9]
    cat = page_keys(_mm_ids([_item("cat", 4, 4)], tokens, 3).ravel(), ns)
    dog = page_keys(_mm_ids([_item("dog", 4, 4)], tokens, 3).ravel(), ns)
    text = page_keys(np.asarray(tokens), ns)
    assert cat[0] == dog[0] == text[0]
    assert len({cat[1], dog[1], text[1]}) == 3 and len({cat[2], dog[2], text[2]}) == 3


@pytest.mark.parametrize(
    "raw", [object(), [0.5, 1.0], torch.tensor(1.0)], ids=["object", "list", "0-dim"]
)
def test_prompt_embeddings_that_are_not_rows_of_a_tensor_are_skipped(raw: object) -> None:
    scope = request_scope(_request(prompt_embeds=raw))
    assert scope.embeds is None and scope.skip is not None
    assert "prompt embeddings kvtier cannot read" in scope.skip


BLOCK = 4


def _embeds(rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ids(scope: RequestScope, tokens: list[int], pages: int, first: int = 0) -> np.ndarray:
    return key_ids(scope, tokens, first, pages, BLOCK)


def test_prompt_embeddings_key_each_page_by_its_rows() -> None:
    """vLLM gives an embedded prompt placeholder ids (all 0): two prompts of one length
    must not share a page unless their embeddings, up to it, are byte for byte equal."""
    x = _embeds(10, 1)
    y = x.clone()
    y[6] += 1  # differs from page 1 (rows 4-7) on
    tokens = [0] * 10 + [5, 6]  # 10 prompt positions, 2 generated tokens: 3 whole pages
    sx, sy = request_scope(_request(prompt_embeds=x)), request_scope(_request(prompt_embeds=y))
    assert sx.skip is None and sx.suffix == "+embeds=bfloat16" and sx == sy
    kx, ky = _ids(sx, tokens, 3), _ids(sy, tokens, 3)
    assert kx.dtype == np.uint32 and kx.shape == (12,)
    assert (kx[:4] == ky[:4]).all() and (kx[4:8] != ky[4:8]).all()
    # page 2's own rows are equal: its ids too; its key differs through its parent's
    assert (kx[8:] == ky[8:]).all()
    ns = Namespace("m", page_tokens=BLOCK)
    keys_x, keys_y = page_keys(kx, ns), page_keys(ky, ns)
    assert keys_x[0] == keys_y[0] and keys_x[1] != keys_y[1] and keys_x[2] != keys_y[2]
    # ... and the same page again: equal
    assert (key_ids(sx, tokens, 1, 3, BLOCK) == kx[4:]).all()
    # the placeholder ids are never the key; generated tokens past the rows keep theirs
    assert not (kx[:8] == 0).all()
    later = _ids(sx, [0] * 10 + [5, 6, 7, 8, 9, 10], 4)
    assert (later[:12] == kx).all() and list(later[12:]) == [7, 8, 9, 10]
    # the page holding the last rows and generated tokens depends on those tokens
    assert (_ids(sx, [0] * 10 + [5, 7], 3)[8:] != kx[8:]).any()


def test_prompt_embeddings_of_another_dtype_are_another_namespace() -> None:
    x = _embeds(8, 1)
    as_half = request_scope(_request(prompt_embeds=x.view(torch.float16)))  # the same bytes
    plain = request_scope(_request(prompt_embeds=x))
    assert as_half.suffix == "+embeds=float16" and as_half.suffix != plain.suffix
    salted = request_scope(_request(prompt_embeds=x, cache_salt="t"))
    assert salted.suffix.startswith("+salt=") and salted.suffix.endswith("+embeds=bfloat16")


def test_key_ids_key_whole_pages_only() -> None:
    assert key_ids(RequestScope(), [1, 2, 3], 0, 1, BLOCK).size == 0
    assert list(key_ids(RequestScope(), [1, 2, 3, 4, 5], 0, 2, BLOCK)) == [1, 2, 3, 4]
    scope = request_scope(_request(prompt_embeds=_embeds(6, 1)))
    assert key_ids(scope, [0] * 6, 0, 2, BLOCK).shape == (4,)  # rows 4-5: no whole page


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
