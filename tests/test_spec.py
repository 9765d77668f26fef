"""KVSpec: the page-size formula, presets, MLA, adaptive page size and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.errors import KVTierUsageError
from kvtier.spec import DTYPE_SIZES, PRESETS, KVSpec, adaptive_page_tokens, canonical_dtype, preset

MiB = 1 << 20


def _formula_per_layer(spec: KVSpec) -> int:
    """The source article's formula, written out independently of KVSpec."""
    kv = 1 if spec.mla else 2
    return spec.num_kv_heads * spec.head_dim * spec.page_tokens * kv * DTYPE_SIZES[spec.dtype]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_follows_the_formula(name: str) -> None:
    spec = preset(name)
    assert spec.bytes_per_layer == _formula_per_layer(spec)
    assert spec.page_bytes == spec.bytes_per_layer * spec.num_layers
    assert math.prod(spec.page_shape) * spec.dtype_size == spec.page_bytes
    assert spec.bytes_per_token_per_layer * spec.page_tokens == spec.bytes_per_layer
    assert spec.name == name
    assert KVSpec(**spec.to_dict()) == spec


def test_required_presets_exist() -> None:
    for name in ("llama3-8b", "llama3-70b", "qwen3-32b", "deepseek-v3", "article-example"):
        assert name in PRESETS


def test_article_example_is_4_mib_per_layer_per_page() -> None:
    spec = preset("article-example")
    assert (spec.num_kv_heads, spec.head_dim, spec.page_tokens) == (128, 512, 16)
    assert spec.dtype_size == 2
    assert spec.bytes_per_layer == 4 * MiB


def test_mla_stores_one_latent_not_k_and_v() -> None:
    ds = preset("deepseek-v3")
    assert ds.mla and ds.kv_factor == 1 and ds.num_kv_heads == 1
    assert ds.page_shape[1] == 1
    as_kv = KVSpec(ds.num_layers, 1, ds.head_dim, ds.dtype, ds.page_tokens, mla=False)
    assert as_kv.page_bytes == 2 * ds.page_bytes


@pytest.mark.parametrize("page_tokens", [4, 16, 64])
def test_page_bytes_scale_with_page_tokens(page_tokens: int) -> None:
    base = preset("llama3-8b")
    spec = base.with_page_tokens(page_tokens)
    assert spec.page_bytes * base.page_tokens == base.page_bytes * page_tokens
    assert spec.num_layers == base.num_layers


@pytest.mark.parametrize(("dtype", "canonical"), [
    ("fp16", "float16"), ("torch.bfloat16", "bfloat16"), ("BF16", "bfloat16"),
    ("fp8", "float8_e4m3fn"), ("float", "float32"), ("int8", "int8"),
])  # fmt: skip
def test_dtype_aliases(dtype: str, canonical: str) -> None:
    assert canonical_dtype(dtype) == canonical
    assert KVSpec(1, 1, 8, dtype).dtype == canonical


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        (0, 16),
        (1, 16),
        (8 * 1024, 16),
        (8 * 1024 + 1, 32),
        (32 * 1024, 32),
        (128 * 1024 - 1, 32),
        (128 * 1024, 64),
        (1 << 22, 64),
    ],
)
def test_adaptive_page_size_boundaries(context: int, expected: int) -> None:
    assert adaptive_page_tokens(context) == expected


def test_adaptive_page_size_is_monotonic() -> None:
    sizes = [adaptive_page_tokens(c) for c in range(0, 300_000, 997)]
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("bad", [-1, -8192, True])
def test_adaptive_page_size_rejects_bad_context(bad: int) -> None:
    with pytest.raises(KVTierUsageError, match="context length"):
        adaptive_page_tokens(bad)


def test_pages_for() -> None:
    spec = preset("tiny")
    n = spec.page_tokens
    assert [spec.pages_for(t) for t in (0, 1, n, n + 1, 3 * n)] == [0, 1, 1, 2, 3]
    with pytest.raises(KVTierUsageError, match="num_tokens"):
        spec.pages_for(-1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_tokens"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True, "8", None])
def test_bad_geometry_names_the_field(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    kwargs[field] = value
    with pytest.raises(KVTierUsageError, match=field):
        KVSpec(**kwargs)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted() -> None:
    spec = KVSpec(np.int64(2), np.int32(2), np.int64(8))  # type: ignore[arg-type]
    assert spec.num_layers == 2 and type(spec.num_layers) is int


def test_unknown_dtype_is_named_and_known_ones_listed() -> None:
    with pytest.raises(KVTierUsageError, match=r"'float12'.*bfloat16"):
        KVSpec(1, 1, 8, "float12")


def test_mla_must_be_bool() -> None:
    with pytest.raises(KVTierUsageError, match="mla"):
        KVSpec(1, 1, 8, mla="yes")  # type: ignore[arg-type]


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(KVTierUsageError, match=r"'llama9'.*llama3-8b"):
        preset("llama9")
