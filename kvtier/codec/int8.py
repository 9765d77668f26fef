"""``int8``: 8-bit integer KV with one float32 scale per group (symmetric, -127..127).

Each element is ``round(value / scale)`` with ``scale`` = the group's largest magnitude /
127, so the error is uniform within a group (half a step, ``peak / 254``) rather than
relative as with ``fp8-e4m3``. With fine groups that is the more accurate of the two:
``scale = "channel"`` (the default: one scale per layer, K/V, head and head dimension over
the page's tokens, the KIVI choice for keys) or ``"token"``. Layout, groups and the
decode path: :mod:`kvtier.codec.scaled`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvtier.codec.scaled import ScaledByteCodec


class Int8Codec(ScaledByteCodec):
    """Symmetric int8 with per-group float32 scales (see the module docstring)."""

    name: ClassVar[str] = "int8"
    QMAX: ClassVar[float] = 127.0
    DEFAULT_SCALE: ClassVar[str] = "channel"

    def _code_values(self) -> np.ndarray:
        codes = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
        codes[128] = 0.0  # -128 is never written
        return codes

    def _quantize(self, scaled: np.ndarray) -> np.ndarray:
        codes: np.ndarray = np.rint(scaled).astype(np.int8).view(np.uint8)
        return codes
