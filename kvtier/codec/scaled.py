"""Lossy codecs that store one byte per element and a float32 scale per group of elements.

:class:`ScaledByteCodec` holds what ``fp8-e4m3`` (:mod:`kvtier.codec.fp8`) and ``int8``
(:mod:`kvtier.codec.int8`) share. A page of ``float16``, ``bfloat16`` or ``float32`` KV
(laid out as ``KVSpec.page_shape``: layers, K/V, tokens, KV heads, head dim) is stored as
the float32 scales followed by one code byte per element; a group's scale is its largest
magnitude over the code's largest value, so each group uses the code's whole range. The
encoded size is fixed: ``elements + 4 x groups`` bytes, a little over half a 16-bit page.

Parameter ``scale`` picks the groups (one scale each):

* ``"head"``: per layer, K/V and KV head (over its tokens and head dimensions);
* ``"token"``: per layer, K/V, token and KV head (a head's vector for one token);
* ``"channel"``: per layer, K/V, KV head and head dimension (over the page's tokens);
* ``"tensor"``: per layer and K/V.

Decoding gathers each element from a 256-entry table per group, already scaled and
rounded to the output dtype, so it is one pass; when the groups are too many for tables
to pay off (``token``, ``channel``), it scales each element instead. A page holding a
non-finite value cannot be encoded (:class:`~kvtier.codec.base.CodecError`: it is not
written to the tier).

These codecs are lossy: a tier configured with one changes the cache's namespace (see
:mod:`kvtier.codec.base`), so their pages never mix with exact KV.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from kvtier.codec.base import Codec, CodecError
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec

#: Reduction axes of each scale granularity over (layers, kv, tokens, heads, head_dim).
GROUP_AXES: dict[str, tuple[int, ...]] = {
    "head": (2, 4),
    "token": (4,),
    "channel": (2,),
    "tensor": (2, 3, 4),
}
INPUT_DTYPES = ("float16", "bfloat16", "float32")


def np_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a KV dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(name)


def _finite_max(dtype: np.dtype[Any]) -> np.float32:
    """The largest finite value of the page dtype, as a float32."""
    if dtype in (np.dtype(np.float16), np.dtype(np.float32)):
        return np.float32(np.finfo(dtype).max)
    import ml_dtypes

    return np.float32(ml_dtypes.finfo(dtype).max)  # type: ignore[no-untyped-call]


class ScaledByteCodec(Codec):
    """One code byte per element, one float32 scale per group (see the module docstring).

    Subclasses set :attr:`QMAX` (the largest code value) and :attr:`DEFAULT_SCALE`, and
    implement :meth:`_code_values` and :meth:`_quantize`.
    """

    lossy: ClassVar[bool] = True
    #: The largest magnitude a code byte represents; a group's peak maps to it.
    QMAX: ClassVar[float]
    #: The ``scale`` granularity when the config names none.
    DEFAULT_SCALE: ClassVar[str] = "head"

    def __init__(self, spec: KVSpec, *, scale: Any = None, **params: Any) -> None:
        super().__init__(spec, **params)
        scale = self.DEFAULT_SCALE if scale is None else scale
        if scale not in GROUP_AXES:
            raise ConfigError(
                f"codec {self.name!r}: parameter 'scale' must be one of "
                f"{', '.join(GROUP_AXES)}, got {scale!r}"
            )
        if spec.dtype not in INPUT_DTYPES:
            raise ConfigError(
                f"codec {self.name!r} encodes {', '.join(INPUT_DTYPES)} KV; this model's KV "
                f"is {spec.dtype}"
            )
        self.scale = str(scale)
        self.shape = spec.page_shape
        self.dtype = np_dtype(spec.dtype)
        self.elements = int(np.prod(self.shape))
        self._axes = GROUP_AXES[self.scale]
        self._scale_shape = tuple(1 if i in self._axes else n for i, n in enumerate(self.shape))
        self.groups = int(np.prod(self._scale_shape))
        # With few groups (per head), decode gathers element i from entry
        # group(i) * 256 + byte(i) of one table already scaled and in the output dtype:
        # one pass. With many, building the tables would cost more than the page: decode
        # then scales each element instead.
        self._by_table = self.groups * 256 <= self.elements // 4
        self._group_base = np.zeros(0, dtype=np.int32)
        if self._by_table:
            self._group_base = np.ascontiguousarray(
                np.broadcast_to(
                    (np.arange(self.groups, dtype=np.int32) * 256).reshape(self._scale_shape),
                    self.shape,
                )
            ).reshape(-1)
        self._group_base.flags.writeable = False
        self._codes = self._code_values()
        self._finite_max = _finite_max(self.dtype)
        self._out_bits = np.dtype(f"<u{self.dtype.itemsize}")

    @abstractmethod
    def _code_values(self) -> np.ndarray:
        """The float32 value of each of the 256 code bytes (0 for bytes never written)."""

    @abstractmethod
    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        """Code bytes (uint8) of float32 values already divided by their scale (so within
        ``[-QMAX, QMAX]``), rounded to nearest."""

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
        scales = np.where(amax > 0, amax / np.float32(self.QMAX), np.float32(1.0)).astype("<f4")
        if (scales == 0).any():  # a group's peak is so small its scale is no float32
            raise CodecError(
                f"{self.name}: page holds values too small to scale (a group's peak "
                f"{float(amax[scales == 0].max()):g} over {self.QMAX} is below the "
                "smallest float32)"
            )
        x /= scales
        np.clip(x, -self.QMAX, self.QMAX, out=x)
        head = 4 * self.groups
        out[:head] = scales.reshape(-1).view(np.uint8)
        out[head : head + self.elements] = self._quantize(x.reshape(-1))
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
        # a peak at the dtype's largest value comes back as QMAX x its scale, which may
        # round past it: clipped, it is that value again, not inf (float32 max was
        # served as inf)
        top = self._finite_max
        with np.errstate(over="ignore"):
            if self._by_table:
                table = scales.reshape(-1, 1) * self._codes.reshape(1, -1)
                np.clip(table, -top, top, out=table)
                table = table.astype(self.dtype)
                index = self._group_base + codes
                np.take(table.view(self._out_bits).reshape(-1), index, out=out.view(self._out_bits))
                return
            values = np.take(self._codes, codes).reshape(self.shape)
            values *= scales.reshape(self._scale_shape)
        np.clip(values, -top, top, out=values)
        out.view(self.dtype).reshape(self.shape)[...] = values.astype(self.dtype)
