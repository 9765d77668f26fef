"""The namespace encoding is unambiguous: two different namespaces never share a page key,
on any tier (design invariant 4 and 9).

Before the fix, (model ``m@x``, revision ``y``) and (model ``m``, revision ``x@y``) made
the same label, hence the same digest and the same keys, and their pages were served to
each other on every store.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import registry
from kvtier.backend import Backend
from kvtier.errors import KVTierUsageError
from kvtier.keys import Namespace, page_keys
from kvtier.testing.servers import RedisServer, unavailable_reason

PAGE_TOKENS = 4
TOKENS = list(range(PAGE_TOKENS * 2))
#: Characters that could act as separators in a textual encoding, and some plain ones.
ALPHABET = "@/%:|#;,=\\ \x00\n-_.vr0123456789aémx"

fields = st.text(alphabet=ALPHABET, min_size=1, max_size=8)
ints = st.integers(0, 2**31 - 1)
namespaces = st.builds(
    Namespace,
    model_id=fields,
    revision=fields,
    kv_dtype=fields,
    page_tokens=st.just(PAGE_TOKENS),
    rank=ints,
    layout_version=st.integers(1, 2**31 - 1),
)


def test_reported_collision_is_gone() -> None:
    a = Namespace("m@x", "y", page_tokens=PAGE_TOKENS)
    b = Namespace("m", "x@y", page_tokens=PAGE_TOKENS)
    assert a.label != b.label and a.digest != b.digest
    assert not set(page_keys(TOKENS, a)) & set(page_keys(TOKENS, b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("m/bf16", "x", "f"), ("m", "x", "bf16/f")),
        (("m", "x/p4", "f"), ("m", "x", "p4/f")),
        (("m%40x", "y", "f"), ("m@x", "y", "f")),
        (("m", "a%2Fb", "f"), ("m", "a/b", "f")),
    ],
)
def test_separator_and_escape_lookalikes_differ(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    na, nb = Namespace(*a, page_tokens=PAGE_TOKENS), Namespace(*b, page_tokens=PAGE_TOKENS)
    assert na.digest != nb.digest


@settings(max_examples=400, deadline=None)
@given(namespaces, namespaces)
def test_distinct_namespaces_never_share_a_key(a: Namespace, b: Namespace) -> None:
    ka, kb = page_keys(TOKENS, a), page_keys(TOKENS, b)
    if a == b:
        assert ka == kb and a.label == b.label
    else:
        assert a.label != b.label
        assert not set(ka) & set(kb)


@settings(max_examples=200, deadline=None)
@given(namespaces)
def test_label_round_trips(ns: Namespace) -> None:
    assert Namespace.from_label(ns.label) == ns


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_id": 5}, "model_id must be a non-empty string"),
        ({"model_id": "m", "revision": None}, "revision must be a string"),
        ({"model_id": "m", "kv_dtype": ""}, "kv_dtype must be a non-empty string"),
        ({"model_id": "m", "rank": 2**70}, r"rank must be an integer in \[0, 2\*\*31\)"),
        ({"model_id": "m", "rank": True}, "rank must be an integer"),
        ({"model_id": "m", "rank": 1.0}, "rank must be an integer"),
        ({"model_id": "m", "page_tokens": 2**40}, "page_tokens must be an integer"),
        ({"model_id": "m", "layout_version": 0}, "layout_version must be an integer"),
    ],
)
def test_bad_field_types_and_ranges_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(KVTierUsageError, match=match):
        Namespace(**kwargs)


@pytest.mark.parametrize("label", ["", "m", "m@r/f/p4/r0", "m@r/f/px/r0/v2", "m@r/f/p4/r0/v2/x"])
def test_from_label_refuses_what_is_not_a_label(label: str) -> None:
    with pytest.raises(KVTierUsageError, match="not a namespace label"):
        Namespace.from_label(label)


# -- every tier: pages of random namespaces over the same tokens stay apart ---------------


def _random_namespaces(n: int, seed: int) -> list[Namespace]:
    """``n`` distinct namespaces whose text fields mix separators, as adversarial as the
    hypothesis strategy above (same alphabet), and including the reported pair."""
    rng = random.Random(seed)

    def text() -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))

    out = {
        Namespace("m@x", "y", page_tokens=PAGE_TOKENS),
        Namespace("m", "x@y", page_tokens=PAGE_TOKENS),
    }
    while len(out) < n:
        out.add(Namespace(text(), text(), text(), PAGE_TOKENS, rng.randint(0, 3)))
    return sorted(out, key=lambda ns: ns.label)


PAGE_BYTES = 512
N_NAMESPACES = 120


@pytest.fixture(scope="module")
def valkey() -> Iterator[RedisServer | None]:
    if unavailable_reason("valkey"):
        yield None
        return
    with RedisServer("valkey") as server:
        yield server


def _options(name: str, tmp: Path, valkey: RedisServer | None) -> dict[str, Any] | None:
    makers: dict[str, Callable[[], dict[str, Any] | None]] = {
        "dram": lambda: {},
        "file": lambda: {"path": tmp / "file"},
        "nvme": lambda: {"path": tmp / "nvme", "slab_bytes": 64 * 4096},
        "redis": lambda: (
            None
            if valkey is None
            else {"url": valkey.url, "key_prefix": f"ns-{uuid.uuid4().hex[:8]}"}
        ),
    }
    return makers[name]() if name in makers else None


@pytest.fixture
async def tier(
    request: pytest.FixtureRequest, tmp_path: Path, valkey: Any
) -> AsyncIterator[Backend]:
    name = request.param
    info = registry.describe(name)
    if not info.available:
        pytest.skip(f"{name} unavailable here: {info.reason}")
    options = _options(name, tmp_path, valkey)
    if options is None:
        pytest.skip(f"{name}: no server here")
    backend = registry.create(
        name, page_bytes=PAGE_BYTES, capacity_pages=2 * N_NAMESPACES * 2, **options
    )
    await backend.open()
    yield backend
    await backend.close()


@pytest.mark.parametrize("tier", ["dram", "file", "nvme", "redis"], indirect=True)
async def test_no_page_is_served_across_namespaces_on_any_tier(tier: Backend) -> None:
    spaces = _random_namespaces(N_NAMESPACES, seed=12)
    expected: dict[bytes, np.ndarray] = {}
    for i, ns in enumerate(spaces):
        keys = page_keys(TOKENS, ns)
        data = [np.full(PAGE_BYTES, i % 251, np.uint8) for _ in keys]
        data = [d.copy() for d in data]
        for j, d in enumerate(data):
            d[:4] = np.frombuffer(i.to_bytes(2, "little") + j.to_bytes(2, "little"), np.uint8)
        assert await tier.put(keys, data, ns.label) == [True] * len(keys)
        for k, d in zip(keys, data, strict=True):
            assert k not in expected, f"{ns.label} shares a key with another namespace"
            expected[k] = d
    keys = list(expected)
    out = [np.empty(PAGE_BYTES, np.uint8) for _ in keys]
    assert await tier.get(keys, out) == [True] * len(keys)
    for k, got in zip(keys, out, strict=True):
        assert np.array_equal(got, expected[k])


def test_replace_keeps_validation() -> None:
    ns = Namespace("m", page_tokens=PAGE_TOKENS)
    with pytest.raises(KVTierUsageError):
        dataclasses.replace(ns, rank=-1)
