"""``fp8-e4m3``: lossy 8-bit floating point KV with one scale per group of elements.

A page of ``float16``, ``bfloat16`` or ``float32`` KV (laid out as ``KVSpec.page_shape``:
layers, K/V, tokens, KV heads, head dim) is stored as float32 scales followed by one
e4m3 byte per element (OCP FP8 E4M3, the ``float8_e4m3fn`` of PyTorch: 4 exponent bits,
3 mantissa bits, largest value 448, no infinities). Each group's scale is its largest
magnitude divided by 448, so the group uses the whole e4m3 range; values are rounded to
nearest even (``ml_dtypes`` casts). The encoded size is fixed:
``elements + 4 x groups`` bytes, a little over half a 16-bit page.

Parameter ``scale`` picks the groups:

* ``"head"`` (default): one scale per layer, K/V and KV head (over its tokens and head
  dimensions): ``layers x 2 x kv_heads`` scales per page;
* ``"token"``: one per layer, K/V, token and KV head (finer, ``page_tokens`` times more
  scales);
* ``"tensor"``: one per layer and K/V.

Decoding gathers each element from a 256-entry table per group, already scaled and
rounded to the output dtype, so it is one pass (with ``"token"`` scales, whose groups are
too many for tables, it scales each element instead). A page holding a non-finite value cannot
be encoded (:class:`~kvtier.codec.base.CodecError`: it is not written to the tier).

The codec is lossy: a tier configured with it changes the cache's namespace (see
:mod:`kvtier.codec.base`), so its pages never mix with exact KV.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from kvtier.codec.base import Codec, CodecError
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec

#: Largest finite e4m3fn value.
E4M3_MAX = 448.0
#: Reduction axes of each scale granularity over (layers, kv, tokens, heads, head_dim).
_GROUP_AXES: dict[str, tuple[int, ...]] = {
    "head": (2, 4),
    "token": (4,),
    "tensor": (2, 3, 4),
}
_INPUT_DTYPES = ("float16", "bfloat16", "float32")


def _np_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a KV dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(name)


class Fp8E4M3Codec(Codec):
    """FP8 E4M3 with per-group float32 scales (see the module docstring)."""

    name: ClassVar[str] = "fp8-e4m3"
    lossy: ClassVar[bool] = True

    def __init__(self, spec: KVSpec, *, scale: Any = "head", **params: Any) -> None:
        super().__init__(spec, **params)
        if scale not in _GROUP_AXES:
            raise ConfigError(
                f"codec {self.name!r}: parameter 'scale' must be one of "
                f"{', '.join(_GROUP_AXES)}, got {scale!r}"
            )
        if spec.dtype not in _INPUT_DTYPES:
            raise ConfigError(
                f"codec {self.name!r} encodes {', '.join(_INPUT_DTYPES)} KV; this model's KV "
                f"is {spec.dtype}"
            )
        self.scale = str(scale)
        self.shape = spec.page_shape
        self.dtype = _np_dtype(spec.dtype)
        self.elements = int(np.prod(self.shape))
        self._axes = _GROUP_AXES[self.scale]
        self._scale_shape = tuple(1 if i in self._axes else n for i, n in enumerate(self.shape))
        self.groups = int(np.prod(self._scale_shape))
        # With few groups (per head), decode gathers element i from entry
        # group(i) * 256 + byte(i) of one table already scaled and in the output dtype:
        # one pass. With many (per token), building that table would cost more than the
        # page: decode then scales each element instead.
        self._by_table = self.groups * 256 <= self.elements // 4
        self._group_base = np.ascontiguousarray(
            np.broadcast_to(
                (np.arange(self.groups, dtype=np.int32) * 256).reshape(self._scale_shape),
                self.shape,
            )
        ).reshape(-1)
        self._group_base.flags.writeable = False
        if not self._by_table:
            self._group_base = np.zeros(0, dtype=np.int32)
        import ml_dtypes

        self._fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
        self._codes = np.arange(256, dtype=np.uint8).view(self._fp8).astype(np.float32)
        self._codes[~np.isfinite(self._codes)] = 0.0  # the two NaN codes are never written
        self._out_bits = np.dtype(f"<u{self.dtype.itemsize}")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError as exc:
            return f"package 'ml_dtypes' is not installed ({exc})"
        return None

    @property
    def identity(self) -> str:
        return f"{self.name}/scale={self.scale}/{self.spec.dtype}/{'x'.join(map(str, self.shape))}"

    @property
    def representation(self) -> str:
        return f"{self.name}:{self.scale}"

    @property
    def fixed_size(self) -> bool:
        return True

    def max_encoded_bytes(self) -> int:
        return 4 * self.groups + self.elements

    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        x = page.view(self.dtype).reshape(self.shape).astype(np.float32)
        amax = np.abs(x).max(axis=self._axes, keepdims=True)
        if not np.isfinite(amax).all():
            raise CodecError(f"{self.name}: page holds non-finite values (inf or nan)")
        scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype("<f4")
        x /= scales
        np.clip(x, -E4M3_MAX, E4M3_MAX, out=x)
        head = 4 * self.groups
        out[:head] = scales.reshape(-1).view(np.uint8)
        out[head : head + self.elements] = x.reshape(-1).astype(self._fp8).view(np.uint8)
        return head + self.elements

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        if data.nbytes != self.max_encoded_bytes():
            raise CodecError(
                f"{self.name}: {data.nbytes} encoded bytes, expected {self.max_encoded_bytes()}"
            )
        head = 4 * self.groups
        scales = data[:head].view("<f4")
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise CodecError(f"{self.name}: page holds invalid scales")
        codes = data[head : head + self.elements]
        if self._by_table:
            table = (scales.reshape(-1, 1) * self._codes.reshape(1, -1)).astype(self.dtype)
            index = self._group_base + codes
            np.take(table.view(self._out_bits).reshape(-1), index, out=out.view(self._out_bits))
            return
        values = np.take(self._codes, codes).reshape(self.shape)
        values *= scales.reshape(self._scale_shape)
        out.view(self.dtype).reshape(self.shape)[...] = values.astype(self.dtype)
