"""Lossless codecs: ``none``, ``zstd`` and ``lz4``, with an optional byte-plane shuffle.

KV of a 16-bit dtype is poorly compressible as it lies in memory: each element's high
byte (sign, exponent, top mantissa bits) repeats a few values, its low byte is close to
noise, and the two alternate. The *shuffle* (``shuffle = true``, the default for dtypes
wider than one byte) regroups the bytes by position within the element (all first bytes,
then all second bytes, ...) before compressing, so the compressible planes are contiguous;
decoding compresses nothing away and undoes the shuffle exactly. ``docs/benchmarks.md``
has the ratios measured with and without it.

Both compressors release the GIL while they work (python-zstandard and python-lz4 do), so
a codec store's worker threads encode batches in parallel.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np

from kvtier.codec.base import Codec, CodecError
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec


def _check_bool(codec: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"codec {codec!r}: parameter {name!r} must be true or false, "
                          f"got {value!r}")  # fmt: skip
    return value


def _check_int(codec: str, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(
            f"codec {codec!r}: parameter {name!r} must be an integer in [{lo}, {hi}], got {value!r}"
        )
    return value


def shuffle_into(page: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """Write ``page``'s bytes grouped by their position in each ``itemsize``-byte
    (2, 4 or 8) little-endian element: all first bytes, then all second bytes, ..."""
    words = page.view(f"<u{itemsize}")
    planes = out.reshape(itemsize, -1)
    np.copyto(planes[0], words, casting="unsafe")  # the low byte of each element
    for j in range(1, itemsize):
        np.copyto(planes[j], words >> (8 * j), casting="unsafe")


def unshuffle_into(planes: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """Undo :func:`shuffle_into`: ``out`` gets the page back."""
    rows = planes.reshape(itemsize, -1)
    dtype = np.dtype(f"<u{itemsize}")
    acc = rows[itemsize - 1].astype(dtype)
    for j in range(itemsize - 2, -1, -1):
        acc <<= dtype.type(8)
        acc |= rows[j]
    out.view(dtype)[...] = acc


class NoneCodec(Codec):
    """No encoding: a tier with ``codec = "none"`` is not wrapped at all (its pages keep
    the plain store format). The class exists so ``none`` is listed with the others and
    so that benchmarks can measure the frame's own cost."""

    name: ClassVar[str] = "none"

    def max_encoded_bytes(self) -> int:
        return self.page_bytes

    @property
    def fixed_size(self) -> bool:
        return True

    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        out[: self.page_bytes] = page
        return self.page_bytes

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        if data.nbytes != self.page_bytes:
            raise CodecError(f"none: {data.nbytes} bytes for a {self.page_bytes}-byte page")
        out[...] = data


class _Compressor(Codec):
    """Shared parts of the byte compressors: shuffle, per-thread state, no-gain fallback."""

    def __init__(self, spec: KVSpec, *, shuffle: Any = None, **params: Any) -> None:
        super().__init__(spec, **params)
        itemsize = spec.dtype_size
        want = itemsize > 1 if shuffle is None else _check_bool(self.name, "shuffle", shuffle)
        #: Element width the shuffle groups by (1: no shuffle).
        self.shuffle = itemsize if want and itemsize > 1 else 1
        self._local = threading.local()

    @property
    def identity(self) -> str:
        return f"{self.name}/shuffle={self.shuffle}"

    def max_encoded_bytes(self) -> int:
        return self.page_bytes  # a page that does not shrink is stored raw instead

    def _scratch(self) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "scratch", None)
        if buf is None:
            buf = np.empty(self.page_bytes, dtype=np.uint8)
            self._local.scratch = buf
        return buf

    def _planes(self, page: np.ndarray) -> np.ndarray:
        if self.shuffle == 1:
            return page
        scratch = self._scratch()
        shuffle_into(page, self.shuffle, scratch)
        return scratch

    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        packed = self._compress(self._planes(page))
        n = len(packed)
        if n >= self.page_bytes:
            return None
        out[:n] = np.frombuffer(packed, dtype=np.uint8)
        return n

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        target = out if self.shuffle == 1 else self._scratch()
        self._decompress(data, target)
        if self.shuffle != 1:
            unshuffle_into(target, self.shuffle, out)

    def _compress(self, data: np.ndarray) -> bytes:
        raise NotImplementedError

    def _decompress(self, data: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError


class ZstdCodec(_Compressor):
    """Zstandard (python-zstandard). Parameters: ``level`` (-7..22, default 1: fast
    levels keep up with NVMe best; higher ones gain little on KV), ``shuffle``."""

    name: ClassVar[str] = "zstd"

    def __init__(self, spec: KVSpec, *, level: Any = 1, shuffle: Any = None, **params: Any):
        super().__init__(spec, shuffle=shuffle, **params)
        self.level = _check_int(self.name, "level", level, -7, 22)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import zstandard  # noqa: F401
        except ImportError as exc:
            return f"package 'zstandard' is not installed ({exc})"
        return None

    def _compress(self, data: np.ndarray) -> bytes:
        import zstandard

        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            self._local.cctx = cctx
        return bytes(cctx.compress(data.data))

    def _decompress(self, data: np.ndarray, out: np.ndarray) -> None:
        import zstandard

        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = zstandard.ZstdDecompressor()
            self._local.dctx = dctx
        try:
            raw = dctx.decompress(data.data, max_output_size=self.page_bytes)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: cannot decode page: {exc}") from None
        if len(raw) != self.page_bytes:
            raise CodecError(f"zstd: decoded {len(raw)} bytes, expected {self.page_bytes}")
        out[...] = np.frombuffer(raw, dtype=np.uint8)


class Lz4Codec(_Compressor):
    """LZ4 block format (python-lz4). Parameters: ``acceleration`` (1..65537, default 1;
    higher is faster and compresses less), ``shuffle``."""

    name: ClassVar[str] = "lz4"

    def __init__(
        self, spec: KVSpec, *, acceleration: Any = 1, shuffle: Any = None, **params: Any
    ) -> None:
        super().__init__(spec, shuffle=shuffle, **params)
        self.acceleration = _check_int(self.name, "acceleration", acceleration, 1, 65537)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import lz4.block  # noqa: F401
        except ImportError as exc:
            return f"package 'lz4' is not installed ({exc})"
        return None

    def _compress(self, data: np.ndarray) -> bytes:
        import lz4.block

        return bytes(
            lz4.block.compress(
                data.data, mode="fast", acceleration=self.acceleration, store_size=False
            )
        )

    def _decompress(self, data: np.ndarray, out: np.ndarray) -> None:
        import lz4.block

        try:
            raw = lz4.block.decompress(data.data, uncompressed_size=self.page_bytes)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: cannot decode page: {exc}") from None
        if len(raw) != self.page_bytes:
            raise CodecError(f"lz4: decoded {len(raw)} bytes, expected {self.page_bytes}")
        out[...] = np.frombuffer(raw, dtype=np.uint8)
