"""The page codecs on their own: lossless round trips, fp8's error bound and agreement
with PyTorch's float8_e4m3fn, the frame's verification, and the registry."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.codec import Codec, CodecError, discover, make_codec, slot_bytes
from kvtier.codec.fp8 import E4M3_MAX, Fp8E4M3Codec
from kvtier.codec.frame import (
    FLAG_RAW,
    FRAME_SIZE,
    codec_tag,
    verify_frame,
    write_frame,
)
from kvtier.codec.int8 import Int8Codec
from kvtier.codec.lossless import shuffle_into, unshuffle_into
from kvtier.errors import ConfigError, IntegrityError
from kvtier.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_tokens=4, name="t")
LOSSLESS = [
    ("none", {}),
    ("zstd", {}),
    ("zstd", {"shuffle": False, "level": 5}),
    ("lz4", {}),
    ("lz4", {"shuffle": False, "acceleration": 8}),
]


def _spec(dtype: str) -> KVSpec:
    return KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_tokens=4, name="t")


def _round_trip(codec: Codec, page: np.ndarray) -> tuple[int | None, np.ndarray]:
    enc = np.empty(codec.max_encoded_bytes(), dtype=np.uint8)
    n = codec.encode(page, enc)
    out = np.empty(codec.page_bytes, dtype=np.uint8)
    if n is None:  # no gain: the store keeps the page raw
        out[...] = page
    else:
        codec.decode(enc[:n], out)
    return n, out


def _kv(spec: KVSpec, values: np.ndarray) -> np.ndarray:
    """float values as one page of ``spec``'s dtype (uint8 view)."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if spec.dtype == "bfloat16" else spec.dtype
    return np.ascontiguousarray(values.astype(np.float32).astype(dt)).view(np.uint8).reshape(-1)


def _as_float(spec: KVSpec, page: np.ndarray) -> np.ndarray:
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if spec.dtype == "bfloat16" else spec.dtype
    return page.view(dt).astype(np.float32).reshape(spec.page_shape)


# -- lossless --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), LOSSLESS, ids=str)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_lossless_round_trip_is_exact(name: str, params: dict[str, Any], data: st.DataObject):
    codec = make_codec(name, SPEC, **params)
    kind = data.draw(st.sampled_from(["bytes", "kv", "runs"]))
    if kind == "bytes":
        page = np.frombuffer(data.draw(st.binary(min_size=512, max_size=512)), dtype=np.uint8)
    elif kind == "kv":
        seed = data.draw(st.integers(0, 2**32 - 1))
        scale = data.draw(st.floats(1e-3, 1e3))
        page = _kv(SPEC, np.random.default_rng(seed).standard_normal(256) * scale)
    else:
        value = data.draw(st.integers(0, 255))
        page = np.full(512, value, dtype=np.uint8)
        page[data.draw(st.integers(0, 511))] ^= 1
    n, out = _round_trip(codec, page)
    assert np.array_equal(out, page)
    assert n is None or n <= codec.max_encoded_bytes()


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_compressible_pages_shrink_and_noise_is_declined(name: str) -> None:
    codec = make_codec(name, SPEC)
    zeros = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    n, _ = _round_trip(codec, zeros)
    assert n is not None and n < SPEC.page_bytes // 4
    noise = np.random.default_rng(3).integers(0, 256, SPEC.page_bytes, dtype=np.uint8)
    assert codec.encode(noise, np.empty(SPEC.page_bytes, dtype=np.uint8)) is None


@pytest.mark.parametrize("itemsize", [2, 4])
def test_shuffle_groups_bytes_by_position_and_inverts(itemsize: int) -> None:
    page = np.arange(64, dtype=np.uint8)
    planes = np.empty_like(page)
    shuffle_into(page, itemsize, planes)
    assert list(planes[:3]) == [0, itemsize, 2 * itemsize]  # first bytes of each element
    back = np.empty_like(page)
    unshuffle_into(planes, itemsize, back)
    assert np.array_equal(back, page)


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_garbage_does_not_decode(name: str) -> None:
    codec = make_codec(name, SPEC)
    garbage = np.random.default_rng(5).integers(0, 256, 100, dtype=np.uint8)
    with pytest.raises(CodecError, match=name):
        codec.decode(garbage, np.empty(SPEC.page_bytes, dtype=np.uint8))


def test_identity_names_what_decoding_depends_on() -> None:
    assert make_codec("zstd", SPEC, level=1).identity == make_codec("zstd", SPEC, level=9).identity
    assert make_codec("zstd", SPEC).identity != make_codec("zstd", SPEC, shuffle=False).identity
    assert make_codec("zstd", SPEC).identity != make_codec("lz4", SPEC).identity
    fp8 = make_codec("fp8-e4m3", SPEC)
    assert fp8.identity != make_codec("fp8-e4m3", SPEC, scale="token").identity
    assert fp8.identity != make_codec("fp8-e4m3", _spec("bfloat16")).identity


# -- fp8-e4m3 --------------------------------------------------------------------------


def _fp8_bound(codec: Fp8E4M3Codec, x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Largest error rounding to e4m3 (3 mantissa bits: half an ulp is 2**-4 of the value's
    binade; subnormal steps of 2**-9) and then to the page dtype allows, per element: the
    dtype's relative half ulp, or half its smallest subnormal step for tiny values."""
    y = np.abs(x) / scales
    binade = np.exp2(np.floor(np.log2(np.maximum(y, 2.0**-6))))
    e4m3 = scales * binade * 2.0**-4
    out_ulp, out_tiny = {
        "float16": (2.0**-11, 2.0**-25),
        "bfloat16": (2.0**-8, 2.0**-134),
        "float32": (2.0**-24, 2.0**-150),
    }[codec.spec.dtype]
    return e4m3 + (np.abs(x) + e4m3) * out_ulp + out_tiny


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("scale", ["head", "token", "tensor"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), magnitude=st.floats(-3, 2))
def test_fp8_error_within_the_rounding_bound(dtype: str, scale: str, seed: int, magnitude: float):
    spec = _spec(dtype)
    codec = make_codec("fp8-e4m3", spec, scale=scale)
    assert isinstance(codec, Fp8E4M3Codec)
    rng = np.random.default_rng(seed)
    spread = 10.0 ** (magnitude + rng.uniform(-1.5, 1.5, size=(2, 2, 1, 2, 1)))  # fits fp16
    page = _kv(spec, rng.standard_normal(spec.page_shape) * spread)
    enc = np.empty(codec.max_encoded_bytes(), dtype=np.uint8)
    assert codec.encode(page, enc) == codec.max_encoded_bytes()
    out = np.empty_like(page)
    codec.decode(enc, out)
    x, got = _as_float(spec, page), _as_float(spec, out)
    scales = enc[: 4 * codec.groups].view("<f4").reshape(codec._scale_shape)
    err = np.abs(got - x)
    assert (err <= _fp8_bound(codec, x, scales)).all(), float(err.max())
    # a group's largest magnitude maps to the top of the e4m3 range
    assert np.allclose(np.abs(x).max(axis=codec._axes, keepdims=True) / scales, E4M3_MAX)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_fp8_bytes_match_torch_float8_e4m3fn_and_decoded_pages_are_fixed_points(seed: int):
    codec = make_codec("fp8-e4m3", SPEC)
    assert isinstance(codec, Fp8E4M3Codec)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SPEC.page_shape) * 10.0 ** rng.uniform(-3, 3.5, size=(2, 2, 1, 2, 1))
    page = _kv(SPEC, x)
    enc = np.empty(codec.max_encoded_bytes(), dtype=np.uint8)
    codec.encode(page, enc)
    head = 4 * codec.groups
    scales = torch.from_numpy(enc[:head].view("<f4").reshape(codec._scale_shape).copy())
    xs = torch.from_numpy(_as_float(SPEC, page))
    ref = (xs / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert np.array_equal(ref.view(torch.uint8).numpy().reshape(-1), enc[head:])
    out = np.empty_like(page)
    codec.decode(enc, out)
    _, again = _round_trip(codec, out)
    assert np.array_equal(again, out)  # a decoded page is kept exactly from then on


def test_fp8_halves_a_16_bit_page_plus_its_scales() -> None:
    codec = make_codec("fp8-e4m3", SPEC)
    elements = int(np.prod(SPEC.page_shape))
    heads = SPEC.num_layers * 2 * SPEC.num_kv_heads
    assert codec.max_encoded_bytes() == elements + 4 * heads
    assert codec.fixed_size and slot_bytes(codec) == FRAME_SIZE + elements + 4 * heads
    assert make_codec("fp8-e4m3", _spec("float32")).max_encoded_bytes() == elements + 4 * heads


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("scale", ["channel", "token", "head"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), magnitude=st.floats(-3, 2))
def test_int8_error_is_at_most_half_a_step(dtype: str, scale: str, seed: int, magnitude: float):
    spec = _spec(dtype)
    codec = make_codec("int8", spec, scale=scale)
    assert isinstance(codec, Int8Codec)
    rng = np.random.default_rng(seed)
    spread = 10.0 ** (magnitude + rng.uniform(-1.5, 1.5, size=(2, 2, 1, 2, 1)))
    page = _kv(spec, rng.standard_normal(spec.page_shape) * spread)
    n, out = _round_trip(codec, page)
    assert n == codec.max_encoded_bytes()
    x, got = _as_float(spec, page), _as_float(spec, out)
    step = np.abs(x).max(axis=codec._axes, keepdims=True) / 127
    out_ulp, out_tiny = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134),
                         "float32": (2.0**-24, 2.0**-150)}[dtype]  # fmt: skip
    bound = step * (0.5 + 1e-6) + (np.abs(x) + step) * out_ulp + out_tiny
    assert (np.abs(got - x) <= bound).all()
    _, again = _round_trip(codec, out)
    assert np.array_equal(again, out)  # decoded pages are fixed points


@pytest.mark.parametrize("name", ["fp8-e4m3", "int8"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_scaled_codecs_refuse_non_finite_pages(name: str, bad: float) -> None:
    codec = make_codec(name, SPEC)
    x = np.ones(SPEC.page_shape, dtype=np.float32)
    x[1, 0, 2, 1, 3] = bad
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(_kv(SPEC, x), np.empty(codec.max_encoded_bytes(), dtype=np.uint8))


@pytest.mark.parametrize("name", ["fp8-e4m3", "int8"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_scaled_codecs_give_the_largest_value_back_finite(name: str, dtype: str) -> None:
    """A page holding its dtype's largest finite value came back as inf (int8 on
    float32: QMAX x the scale rounded past float32's max); it is clipped to that value."""
    import ml_dtypes

    spec = _spec(dtype)
    codec = make_codec(name, spec)
    biggest = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).max)
    x = np.random.default_rng(0).standard_normal(spec.page_shape)
    x[0, 0, 0, 0, 0], x[1, 1, 3, 1, 7] = biggest, -biggest
    _, out = _round_trip(codec, _kv(spec, x))
    got = _as_float(spec, out)
    assert np.isfinite(got).all()
    assert got[0, 0, 0, 0, 0] == biggest and got[1, 1, 3, 1, 7] == -biggest


@pytest.mark.parametrize("name", ["fp8-e4m3", "int8"])
def test_scaled_codecs_refuse_values_too_small_to_scale(name: str) -> None:
    """A float32 page of 1e-44 was written with a scale that underflowed to 0, then
    refused at every read ("invalid scales"): a committed page lost. It is now refused
    at encode, so it is never written."""
    spec = _spec("float32")
    codec = make_codec(name, spec)
    with pytest.raises(CodecError, match="too small to scale"):
        codec.encode(
            _kv(spec, np.full(spec.page_shape, 1e-44)),
            np.empty(codec.max_encoded_bytes(), dtype=np.uint8),
        )


def test_fp8_all_zero_page_round_trips() -> None:
    codec = make_codec("fp8-e4m3", SPEC)
    zeros = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    _, out = _round_trip(codec, zeros)
    assert np.array_equal(out, zeros)


def test_fp8_rejects_wrong_length_and_bad_scales() -> None:
    codec = make_codec("fp8-e4m3", SPEC)
    out = np.empty(SPEC.page_bytes, dtype=np.uint8)
    with pytest.raises(CodecError, match="encoded bytes"):
        codec.decode(np.zeros(codec.max_encoded_bytes() - 1, dtype=np.uint8), out)
    enc = np.zeros(codec.max_encoded_bytes(), dtype=np.uint8)
    enc[:4] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)
    with pytest.raises(CodecError, match="scales"):
        codec.decode(enc, out)


@pytest.mark.parametrize(
    ("params", "dtype", "match"),
    [
        ({"scale": "row"}, "float16", "scale"),
        ({"bits": 4}, "float16", "bits"),
        ({}, "int8", "int8"),
    ],
)
def test_fp8_bad_parameters_and_dtypes_are_named(params: dict[str, Any], dtype: str, match: str):
    with pytest.raises(ConfigError, match=match):
        make_codec("fp8-e4m3", _spec(dtype), **params)


# -- the frame -------------------------------------------------------------------------


def _framed(encoded: bytes, tag: int = 7, flags: int = 0, page_bytes: int = 512) -> np.ndarray:
    blob = np.zeros(FRAME_SIZE + len(encoded), dtype=np.uint8)
    blob[FRAME_SIZE:] = np.frombuffer(encoded, dtype=np.uint8)
    write_frame(blob, tag, flags, len(encoded), page_bytes)
    return blob


def test_frame_round_trip() -> None:
    blob = _framed(b"abcdef")
    frame = verify_frame(blob, 7, 512)
    assert frame.encoded.tobytes() == b"abcdef" and not frame.raw
    raw = _framed(bytes(512), flags=FLAG_RAW)
    assert verify_frame(raw, 7, 512).raw


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=64), where=st.integers(0, 10**6), bit=st.integers(0, 7)
)
def test_any_flipped_bit_fails_frame_verification(payload: bytes, where: int, bit: int) -> None:
    blob = _framed(payload)
    blob[where % blob.nbytes] ^= 1 << bit
    with pytest.raises(IntegrityError):
        verify_frame(blob, 7, 512)


def test_frame_names_each_mismatch() -> None:
    blob = _framed(b"abcdef")
    with pytest.raises(IntegrityError, match="another codec"):
        verify_frame(blob, 8, 512)
    with pytest.raises(IntegrityError, match="512-byte pages, expected 1024"):
        verify_frame(blob, 7, 1024)
    with pytest.raises(IntegrityError, match="claims 6 encoded bytes, 5 are there"):
        verify_frame(blob[:-1], 7, 512)
    with pytest.raises(IntegrityError, match="truncated"):
        verify_frame(blob[:10], 7, 512)
    with pytest.raises(IntegrityError, match="magic"):
        verify_frame(np.zeros(64, dtype=np.uint8), 7, 512)
    with pytest.raises(IntegrityError, match="raw page"):
        verify_frame(_framed(b"short", flags=FLAG_RAW), 7, 512)
    assert codec_tag("zstd/shuffle=2") != codec_tag("zstd/shuffle=1")


# -- registry --------------------------------------------------------------------------


def test_builtins_are_registered_with_their_lossiness() -> None:
    infos = {i.name: i for i in discover()}
    assert {n: (i.lossy, i.available) for n, i in infos.items() if n in {
        "none", "zstd", "lz4", "fp8-e4m3", "int8"}} == {
        "none": (False, True), "zstd": (False, True), "lz4": (False, True),
        "fp8-e4m3": (True, True), "int8": (True, True),
    }  # fmt: skip


def test_unknown_codec_and_bad_parameters_are_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown codec 'brotli'; registered: .*zstd"):
        make_codec("brotli", SPEC)
    with pytest.raises(ConfigError, match="'level'"):
        make_codec("zstd", SPEC, level=99)
    with pytest.raises(ConfigError, match="'shuffle'"):
        make_codec("lz4", SPEC, shuffle="yes")
    with pytest.raises(ConfigError, match="unknown parameter"):
        make_codec("none", SPEC, level=1)
    with pytest.raises(ConfigError, match="not a kvtier Codec"):
        make_codec("kvtier.spec:KVSpec", SPEC)


class ReverseCodec(Codec):
    """A plugin-style codec, found by path: stores the page's bytes reversed."""

    name = "reverse"

    def max_encoded_bytes(self) -> int:
        return self.page_bytes

    @property
    def fixed_size(self) -> bool:
        return True

    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        out[: self.page_bytes] = page[::-1]
        return self.page_bytes

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        out[...] = data[::-1]


def test_a_codec_class_path_resolves_like_a_plugin() -> None:
    codec = make_codec(f"{__name__}:ReverseCodec", SPEC)
    page = np.arange(512, dtype=np.uint16).astype(np.uint8)
    n, out = _round_trip(codec, page)
    assert n == 512 and np.array_equal(out, page)


class _CheckRaises(ReverseCodec):
    @classmethod
    def unavailable_reason(cls) -> str | None:
        raise RuntimeError("boom in the check")


class _CtorRaises(ReverseCodec):
    def __init__(self, spec: KVSpec, **params: Any) -> None:
        raise RuntimeError("boom in the constructor")


class _FloatMax(ReverseCodec):
    def max_encoded_bytes(self) -> int:
        return 600.5  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("cls", "needle"),
    [("_CheckRaises", "its availability check raised RuntimeError('boom in the check')"),
     ("_CtorRaises", "its constructor raised RuntimeError('boom in the constructor')"),
     ("_FloatMax", "max_encoded_bytes() gave 600.5, not a number of bytes")],
)  # fmt: skip
def test_a_plugin_codecs_own_failures_are_named(cls: str, needle: str) -> None:
    """Before: a raw RuntimeError from KVCache ("a kvtier bug" in the CLI), and for a
    float max_encoded_bytes "NvmeStore.page_footprint(632.5) gave 4096.0: a backend bug"."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make_codec(f"{__name__}:{cls}", SPEC)
