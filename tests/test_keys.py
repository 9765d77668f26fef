"""Page keys: chaining, stability across processes, namespace separation, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import KVTierUsageError
from kvtier.keys import KEY_BYTES, ROOT_KEY, Namespace, PageKey, key_hex, page_keys
from kvtier.spec import preset

NS = Namespace("meta-llama/Llama-3.1-8B", "abc123", "bfloat16", 16, 0)
TOKENS = np.random.default_rng(7).integers(0, 128_256, 16 * 9 + 5).tolist()


def test_keys_are_128_bit_and_one_per_full_page() -> None:
    keys = page_keys(TOKENS, NS)
    assert len(keys) == len(TOKENS) // NS.page_tokens
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    assert key_hex(keys[0]) == keys[0].hex() and len(key_hex(keys[0])) == 32


def test_first_key_is_the_documented_hash() -> None:
    first = np.asarray(TOKENS[:16], dtype="<u4").tobytes()
    assert page_keys(TOKENS, NS)[0] == xxhash.xxh3_128_digest(ROOT_KEY + NS.digest + first)


def test_chaining_lets_a_sequence_be_hashed_in_pieces() -> None:
    whole = page_keys(TOKENS, NS)
    head = page_keys(TOKENS[:48], NS)
    tail = page_keys(TOKENS[48:], NS, parent=head[-1])
    assert head + tail == whole


def test_a_page_key_depends_on_every_earlier_page() -> None:
    changed = list(TOKENS)
    changed[3] += 1  # first page differs
    a, b = page_keys(TOKENS, NS), page_keys(changed, NS)
    assert all(x != y for x, y in zip(a, b, strict=True))
    later = list(TOKENS)
    later[16 * 5] += 1  # page 5 differs: pages 0-4 keep their keys
    c = page_keys(later, NS)
    assert c[:5] == a[:5] and all(x != y for x, y in zip(a[5:], c[5:], strict=True))


def test_partial_pages_get_no_key() -> None:
    assert page_keys(TOKENS[:15], NS) == []
    assert page_keys([], NS) == []
    assert len(page_keys(TOKENS[: 16 * 2 + 15], NS)) == 2


def test_input_types_give_equal_keys() -> None:
    ref = page_keys(TOKENS, NS)
    for arr in (np.asarray(TOKENS, np.int64), np.asarray(TOKENS, np.uint32), tuple(TOKENS)):
        assert page_keys(arr, NS) == ref


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(0, 12))
def test_prefix_property(tokens: list[int], cut_pages: int) -> None:
    cut = min(cut_pages * 4, len(tokens))
    ns = Namespace("m", page_tokens=4)
    whole = page_keys(tokens, ns)
    head = page_keys(tokens[:cut], ns)
    assert whole[: len(head)] == head
    assert whole == head + page_keys(tokens[cut:], ns, head[-1] if head else ROOT_KEY)


_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    from kvtier.keys import Namespace, page_keys
    ns = Namespace(*json.loads(sys.argv[1]))
    tokens = json.loads(sys.argv[2])
    print(json.dumps([k.hex() for k in page_keys(tokens, ns)]))
    """
)


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_keys_are_stable_across_processes(hashseed: str) -> None:
    fields = [NS.model_id, NS.revision, NS.kv_dtype, NS.page_tokens, NS.rank]
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, json.dumps(fields), json.dumps(TOKENS)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd="/",
    )
    assert json.loads(out.stdout) == [k.hex() for k in page_keys(TOKENS, NS)]


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("model_id", "meta-llama/Llama-3.1-70B"),
        ("revision", "def456"),
        ("kv_dtype", "float8_e4m3fn"),
        ("page_tokens", 32),
        ("rank", 1),
        ("layout_version", 4),
    ],
)
def test_every_namespace_field_separates_keys(field: str, other: object) -> None:
    ns2 = dataclasses.replace(NS, **{field: other})
    assert ns2.digest != NS.digest
    assert str(other) in ns2.label
    tokens = TOKENS[:64]
    a, b = page_keys(tokens, NS), page_keys(tokens, ns2)
    assert a and b and not set(a) & set(b)


def test_namespace_for_spec() -> None:
    spec = preset("llama3-8b")
    ns = Namespace.for_spec(spec, revision="r1", rank=3)
    assert (ns.model_id, ns.kv_dtype, ns.page_tokens, ns.rank) == ("llama3-8b", "bfloat16", 16, 3)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1.0] * 16, "integers"),
        ([-1] + [0] * 15, r"\[0, 2\*\*32\)"),
        ([2**32] + [0] * 15, r"\[0, 2\*\*32\)"),
        ([[1, 2], [3, 4]], "1-D"),
        (["a"] * 16, "integers"),
    ],
)
def test_bad_token_ids_are_rejected(tokens: object, match: str) -> None:
    with pytest.raises(KVTierUsageError, match=match):
        page_keys(tokens, NS)  # type: ignore[arg-type]


def test_bad_parent_is_rejected() -> None:
    with pytest.raises(KVTierUsageError, match="parent key must be 16 bytes"):
        page_keys(TOKENS, NS, parent=PageKey(b"short"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": "m", "page_tokens": 0}, "page_tokens"),
        ({"model_id": "m", "rank": -1}, "rank"),
        # a lone surrogate (bytes the environment could not decode) failed at the first
        # store, as a bare UnicodeEncodeError
        ({"model_id": "bad\udcffid"}, r"model_id 'bad\\udcffid' is not valid Unicode"),
        ({"model_id": "m", "revision": "\ud800"}, "revision"),
    ],
)
def test_bad_namespace_fields_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(KVTierUsageError, match=match):
        Namespace(**kwargs)  # type: ignore[arg-type]


def test_private_keys_are_new_each_time_and_kept_apart_by_tag() -> None:
    from kvtier.keys import KEY_BYTES, PrivateKeys

    a, b = PrivateKeys(b"\xfftest-aaaa"), PrivateKeys(b"\xfetest-bbbb")
    keys = [*a.take(3), b.next()]
    assert len(set(keys)) == 4 and all(len(k) == KEY_BYTES for k in keys)
    assert all(a.owns(k) for k in keys[:3]) and not a.owns(keys[3]) and b.owns(keys[3])
    with pytest.raises(KVTierUsageError, match="10 bytes"):
        PrivateKeys(b"short")
