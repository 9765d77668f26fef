"""A model shape given in the configuration without a name gets a name of its own: the
name is the namespace's default model id, so two shapes with the same page size never
share pages on a persistent tier (before, both were ``tiny`` or ``custom``, and a cache
of one shape served the other's pages)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_kit import PAGE, PT, open_cache, tier

from kvtier.config import load_config
from kvtier.keys import page_keys
from kvtier.spec import preset


def _config(path: Path, model: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "tiers": [
            tier("d", "dram", 8),
            tier("f", "file", 64, options={"path": str(path)}),
        ],
    }


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ({"preset": "tiny"}, "tiny"),
        ({"preset": "tiny", "page_tokens": 8, "dtype": "bfloat16"}, "tiny"),  # in the namespace
        ({"preset": "tiny", "num_layers": 4, "num_kv_heads": 1}, "tiny-L4H1D8"),
        ({"preset": "tiny", "mla": True}, "tiny-L2H2D8-mla"),
        ({"preset": "tiny", "num_layers": 4, "name": "mine"}, "mine"),
        ({"num_layers": 3, "num_kv_heads": 2, "head_dim": 64}, "custom-L3H2D64"),
        ({"num_layers": 3, "num_kv_heads": 2, "head_dim": 64, "name": "m"}, "m"),
    ],
)
def test_the_model_name_follows_the_shape_unless_given(model: dict[str, Any], name: str) -> None:
    resolved = load_config({"model": model}, env={})
    assert resolved.config.spec.name == name
    assert resolved.config.namespace.model_id == name
    assert resolved.preset == model.get("preset")
    if "preset" in model:  # inspect config lists the preset, not the derived name
        assert resolved.as_rows()[0] == ("model.preset", model["preset"], "python")


def test_an_explicit_model_id_still_wins() -> None:
    raw = {"model": {"preset": "tiny", "num_layers": 4}, "namespace": {"model_id": "org/m"}}
    assert load_config(raw, env={}).config.namespace.model_id == "org/m"


async def test_a_shape_with_the_same_page_size_does_not_read_anothers_pages(
    tmp_path: Path,
) -> None:
    tiny = preset("tiny")
    other = {"preset": "tiny", "num_layers": 4, "num_kv_heads": 1}  # 512-byte pages too
    tokens = list(range(6 * PT))
    async with open_cache(_config(tmp_path / "f", {"preset": "tiny"})) as cache:
        assert cache.config.spec.page_bytes == tiny.page_bytes == PAGE
        assert all((await cache.store(tokens, np.full((6, PAGE), 7, np.uint8))).stored)
        await cache.flush()
    async with open_cache(_config(tmp_path / "f", other)) as cache:
        assert cache.config.spec.page_bytes == PAGE
        assert (await cache.lookup(tokens)).keys == []
    async with open_cache(_config(tmp_path / "f", {"preset": "tiny"})) as cache:
        assert len((await cache.lookup(tokens)).keys) == 6  # still there for its own shape


def test_pages_keyed_before_shapes_had_names_are_never_asked_for() -> None:
    """kvtier before 2026-12-03 (layout version 2) keyed a custom shape's pages under its
    preset's name: a store or pool it wrote for ``tiny`` with 4 heads of 4 holds pages
    under the keys the ``tiny`` preset asks for now, and served them (an upgrade probe
    read 16 such pages back). Layout version 3 keys are another set."""
    tokens = list(range(6 * PT))
    now = load_config({"model": {"preset": "tiny"}}, env={}).config.namespace
    before = dataclasses.replace(now, layout_version=2)  # how that version keyed "tiny"
    assert now.layout_version == 3 and now.label.endswith("/v3")
    assert not set(page_keys(tokens, now)) & set(page_keys(tokens, before))
