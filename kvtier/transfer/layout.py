"""Layer-first <-> page-first conversion of KV pages (gather for eviction, scatter for load).

An inference engine keeps its KV cache *layer-first*: one tensor per attention layer (or
one stacked tensor over layers), each indexed by block number. kvtier's lower tiers store
*page-first* blobs: one contiguous ``[layers, kv, page_tokens, kv_heads, head_dim]`` page
(:attr:`kvtier.spec.KVSpec.page_shape`). :class:`LayerFirstCache` converts between the two
for a whole batch of blocks at once, as whole-array gathers and scatters:

* a stacked cache (one ``[layers, ...]`` array): **one gather plus one strided copy** for
  the whole batch, whatever the number of pages and layers;
* a list of per-layer arrays: one batched gather per layer.

Never ``pages x layers`` copies (that is :func:`gather_per_chunk`, the reference the
benchmark compares against). The same code runs with CuPy arrays on a GPU (each operation
is a kernel launch on the current stream) and with numpy arrays on the CPU (tests).

Engine layouts (per layer):

* ``blocks_first``: ``[num_blocks, kv, page_tokens, kv_heads, head_dim]`` (FlashInfer,
  SGLang; for MLA ``kv`` is 1 and may be omitted: ``[num_blocks, page_tokens, 1, dim]``
  reshaped);
* ``kv_first``: ``[kv, num_blocks, page_tokens, kv_heads, head_dim]`` (vLLM's FlashAttention
  backend).

Arrays may hold the spec's dtype (last axis ``head_dim``) or raw bytes (uint8, last axis
``head_dim x dtype size``); torch tensors are taken zero-copy through numpy (CPU) or DLPack
(CUDA). Every shape, dtype, device or index problem raises
:class:`~kvtier.errors.KVTierUsageError` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec

EngineLayout = Literal["blocks_first", "kv_first"]
_LAYOUTS = ("blocks_first", "kv_first")


def array_module(arr: Any) -> Any:
    """numpy or cupy, whichever ``arr`` belongs to."""
    if isinstance(arr, np.ndarray):
        return np
    if type(arr).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    raise KVTierUsageError(f"expected a numpy or CuPy array, got {type(arr).__name__}")


def as_byte_array(obj: Any) -> Any:
    """A numpy/CuPy uint8 view of ``obj`` (numpy, CuPy or torch), sharing its memory.

    Elements become bytes along the last axis (a ``[..., 128]`` bfloat16 array becomes
    ``[..., 256]`` uint8). Raises :class:`KVTierUsageError` when the last axis is not
    contiguous or the object is no array.
    """
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        import torch

        t = obj
        if t.dim() == 0 or t.stride(-1) != 1:
            raise KVTierUsageError("a KV tensor's last axis must be contiguous (stride 1)")
        t8 = t.view(torch.uint8)
        if t8.is_cuda:
            import cupy

            return cupy.from_dlpack(t8)
        if t8.device.type != "cpu":
            raise KVTierUsageError(f"KV tensors on {t8.device} are not supported")
        return t8.numpy()
    xp = array_module(obj)
    arr = obj
    if arr.ndim == 0:
        raise KVTierUsageError("a KV array needs at least one axis")
    if arr.dtype == xp.uint8:
        return arr
    if arr.strides[-1] != arr.itemsize:
        raise KVTierUsageError("a KV array's last axis must be contiguous")
    return arr.view(xp.uint8)


def _check_dtype(spec: KVSpec, arr: Any, what: str) -> Any:
    """``arr`` unchanged if its element size fits ``spec`` (or it is raw uint8 bytes)."""
    dtype = getattr(arr, "dtype", None)
    if dtype is None:
        raise KVTierUsageError(f"{what}: expected an array or tensor, got {type(arr).__name__}")
    size = arr.element_size() if hasattr(arr, "element_size") else int(dtype.itemsize)
    name = str(dtype).removeprefix("torch.")
    if name != "uint8" and size != spec.dtype_size:
        raise KVTierUsageError(
            f"{what}: dtype {name} has {size}-byte elements, spec {spec.name!r} stores "
            f"{spec.dtype} ({spec.dtype_size} bytes)"
        )
    return arr


def _device_of(arr: Any) -> int | None:
    """CUDA device id of a CuPy array, ``None`` for host arrays."""
    dev = getattr(arr, "device", None)
    ident = getattr(dev, "id", None)
    return ident if isinstance(ident, int) else None


class LayerFirstCache:
    """An engine's layer-first KV cache, seen as ``num_blocks`` pages of ``spec``.

    Args:
        spec: the geometry (page size, layers, dtype).
        layers: one stacked array ``[layers, <per-layer shape>]`` or a sequence of
            ``spec.num_layers`` per-layer arrays, numpy / CuPy / torch.
        layout: ``blocks_first`` or ``kv_first`` (see the module docstring).

    Raises :class:`KVTierUsageError` for a layer count, shape or dtype that does not match
    ``spec``, or layers on different devices.
    """

    def __init__(
        self,
        spec: KVSpec,
        layers: Any | Sequence[Any],
        layout: EngineLayout = "blocks_first",
    ) -> None:
        if layout not in _LAYOUTS:
            raise KVTierUsageError(f"layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
        self.spec = spec
        self.layout: EngineLayout = layout
        kv = spec.kv_factor
        self._chunk = spec.bytes_per_layer // kv  # bytes of one (layer, kv, block)
        if isinstance(layers, Sequence) and not hasattr(layers, "shape"):
            if len(layers) != spec.num_layers:
                raise KVTierUsageError(
                    f"got {len(layers)} layer arrays for a {spec.num_layers}-layer spec"
                )
            views = [
                self._per_layer(as_byte_array(_check_dtype(spec, a, f"layer {i}")), f"layer {i}")
                for i, a in enumerate(layers)
            ]
            self._stacked = None
            self._layers = views
            first = views[0]
        else:
            u8 = as_byte_array(_check_dtype(spec, layers, "stacked KV array"))
            if not u8.flags.c_contiguous:  # a reshape would silently copy
                raise KVTierUsageError("stacked KV array must be C-contiguous")
            if u8.shape[0] != spec.num_layers:
                raise KVTierUsageError(
                    f"stacked KV array has {u8.shape[0]} layers on axis 0, "
                    f"spec {spec.name!r} has {spec.num_layers}"
                )
            per = self._per_layer(u8[0], "stacked KV array (per layer)")
            self._stacked = u8.reshape((spec.num_layers, *per.shape))
            self._layers = [self._stacked[i] for i in range(spec.num_layers)]
            first = per
        self.xp = array_module(first)
        self.device = _device_of(first)
        for i, layer in enumerate(self._layers):
            if array_module(layer) is not self.xp or _device_of(layer) != self.device:
                raise KVTierUsageError(f"layer {i} is on another device than layer 0")
        self.num_blocks = int(first.shape[0 if layout == "blocks_first" else 1])

    def _per_layer(self, u8: Any, what: str) -> Any:
        """Check one layer's byte view and return it as ``[N, kv, chunk]`` / ``[kv, N, chunk]``."""
        spec = self.spec
        if not u8.flags.c_contiguous:
            raise KVTierUsageError(f"{what} must be C-contiguous")
        total = int(u8.size)
        per_block = spec.bytes_per_layer
        if total % per_block:
            raise KVTierUsageError(
                f"{what}: {total} bytes is not a whole number of {per_block}-byte blocks "
                f"(shape {tuple(u8.shape)})"
            )
        n = total // per_block
        kv = spec.kv_factor
        lead = 0 if self.layout == "blocks_first" else 1
        dims = tuple(int(d) for d in u8.shape)
        if self.layout == "kv_first" and (len(dims) < 2 or dims[0] != kv):
            raise KVTierUsageError(
                f"{what}: kv_first layout needs axis 0 of size {kv} (K and V), got shape {dims}"
            )
        if dims[lead] != n:
            raise KVTierUsageError(
                f"{what}: shape {dims} does not match {self.layout} "
                f"[blocks, kv={kv}, tokens={spec.page_tokens}, heads={spec.num_kv_heads}, "
                f"dim={spec.head_dim}] for spec {spec.name!r}"
            )
        shape = (n, kv, self._chunk) if self.layout == "blocks_first" else (kv, n, self._chunk)
        return u8.reshape(shape)

    # -- validation ----------------------------------------------------------------------

    def _ids(self, block_ids: Sequence[int] | Any, unique: bool) -> Any:
        host = np.asarray(
            block_ids.get() if hasattr(block_ids, "get") and self.xp is not np else block_ids
        )
        if host.ndim != 1:
            raise KVTierUsageError(f"block ids must be 1-D, got shape {host.shape}")
        if host.size and host.dtype.kind not in "iu":
            raise KVTierUsageError(f"block ids must be integers, got dtype {host.dtype}")
        if host.size:
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise KVTierUsageError(
                    f"block id {bad} out of range: the cache has {self.num_blocks} blocks"
                )
            if unique and np.unique(host).size != host.size:
                raise KVTierUsageError("block ids to scatter into must be distinct")
        return self.xp.asarray(host.astype(np.int64, copy=False))

    def _pages(self, pages: Any, n: int, writable: bool) -> Any:
        """``pages`` as a ``[n, layers, kv, chunk]`` uint8 view, or raise."""
        spec = self.spec
        try:
            xp = array_module(pages)
        except KVTierUsageError:
            raise KVTierUsageError(
                f"pages must be a numpy or CuPy uint8 array, got {type(pages).__name__}"
            ) from None
        if xp is not self.xp or _device_of(pages) != self.device:
            where = "the host" if self.device is None else f"GPU {self.device}"
            got = "the host" if _device_of(pages) is None else f"GPU {_device_of(pages)}"
            raise KVTierUsageError(
                f"pages are on {got} but the KV cache is on {where}: stage them on the "
                "cache's device first"
            )
        if pages.dtype != xp.uint8:
            raise KVTierUsageError(f"pages must be uint8, got {pages.dtype}")
        if int(pages.size) != n * spec.page_bytes:
            raise KVTierUsageError(
                f"pages hold {int(pages.size)} bytes, {n} pages of {spec.page_bytes} need "
                f"{n * spec.page_bytes}"
            )
        if not pages.flags.c_contiguous:
            raise KVTierUsageError("pages must be C-contiguous")
        if writable and hasattr(pages.flags, "writeable") and not pages.flags.writeable:
            raise KVTierUsageError("pages must be writable to gather into")
        return pages.reshape((n, spec.num_layers, spec.kv_factor, self._chunk))

    # -- conversion ----------------------------------------------------------------------

    def gather(self, block_ids: Sequence[int] | Any, out: Any) -> Any:
        """Copy blocks ``block_ids`` into ``out`` as page-first pages; returns ``out``.

        ``out`` is a C-contiguous uint8 array on the cache's device holding
        ``len(block_ids) x page_bytes`` bytes (any shape, e.g. ``[n, page_bytes]``).
        On CuPy the copies are queued on the current stream.
        """
        ids = self._ids(block_ids, unique=False)
        n = int(ids.shape[0])
        dst = self._pages(out, n, writable=True)
        if n == 0:
            return out
        if self._stacked is not None:
            if self.layout == "blocks_first":  # [L, N, kv, c] -> [n, L, kv, c]
                dst.transpose(1, 0, 2, 3)[...] = self._stacked[:, ids]
            else:  # [L, kv, N, c] -> [n, L, kv, c]
                dst.transpose(1, 2, 0, 3)[...] = self._stacked[:, :, ids]
        else:
            for layer, src in enumerate(self._layers):
                if self.layout == "blocks_first":
                    dst[:, layer] = src[ids]
                else:
                    dst[:, layer].transpose(1, 0, 2)[...] = src[:, ids]
        return out

    def scatter(self, block_ids: Sequence[int] | Any, pages: Any) -> None:
        """Copy page-first ``pages`` into blocks ``block_ids`` (which must be distinct)."""
        ids = self._ids(block_ids, unique=True)
        n = int(ids.shape[0])
        src = self._pages(pages, n, writable=False)
        if n == 0:
            return
        if self._stacked is not None:
            if self.layout == "blocks_first":
                self._stacked[:, ids] = src.transpose(1, 0, 2, 3)
            else:
                self._stacked[:, :, ids] = src.transpose(1, 2, 0, 3)
        else:
            for layer, dst in enumerate(self._layers):
                if self.layout == "blocks_first":
                    dst[ids] = src[:, layer]
                else:
                    dst[:, ids] = src[:, layer].transpose(1, 0, 2)

    @property
    def launches_per_batch(self) -> int:
        """Array operations one gather or scatter issues (kernel launches on a GPU)."""
        return 1 if self._stacked is not None else self.spec.num_layers


def gather_per_chunk(cache: LayerFirstCache, block_ids: Sequence[int], out: Any) -> Any:
    """The naive reference: one copy per (page, layer, K/V) chunk. For tests and for the
    benchmark's baseline only; :meth:`LayerFirstCache.gather` is the real path."""
    ids = [int(i) for i in cache._ids(block_ids, unique=False).tolist()]
    dst = cache._pages(out, len(ids), writable=True)
    for p, block in enumerate(ids):
        for layer, src in enumerate(cache._layers):
            for kv in range(cache.spec.kv_factor):
                chunk = src[block, kv] if cache.layout == "blocks_first" else src[kv, block]
                dst[p, layer, kv] = chunk
    return out
