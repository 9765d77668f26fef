"""``fp8-e4m3``: 8-bit floating-point KV with one float32 scale per group.

Each element is stored as an OCP FP8 E4M3 byte (PyTorch's ``float8_e4m3fn``: 4 exponent
bits, 3 mantissa bits, largest value 448, no infinities), rounded to nearest even
(``ml_dtypes`` casts; the bytes equal ``torch``'s conversion). Being a float format, its
error is relative to each value (about 2.5 % rms on real KV, almost whatever the scale
groups); ``scale`` (default ``"head"``) mostly sets the dynamic range. Layout, groups and
the decode path: :mod:`kvtier.codec.scaled`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvtier.codec.scaled import ScaledByteCodec

#: Largest finite e4m3fn value.
E4M3_MAX = 448.0


class Fp8E4M3Codec(ScaledByteCodec):
    """FP8 E4M3 with per-group float32 scales (see the module docstring)."""

    name: ClassVar[str] = "fp8-e4m3"
    QMAX: ClassVar[float] = E4M3_MAX
    DEFAULT_SCALE: ClassVar[str] = "head"

    def _code_values(self) -> np.ndarray:
        import ml_dtypes

        codes: np.ndarray = (
            np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        )
        codes[~np.isfinite(codes)] = 0.0  # the two NaN codes are never written
        return codes

    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        import ml_dtypes

        codes: np.ndarray = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return codes
