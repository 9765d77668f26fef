"""Input checking of the facade: page keys, parents, namespaces and page buffers.

Everything :class:`~kvtier.cache.KVCache` takes from an engine passes through here first:
a key that is not a 16-byte page key, a page buffer of the wrong shape, dtype, byte order
or count, an output buffer that cannot be written, a tensor on a GPU; each raises
:class:`~kvtier.errors.KVTierUsageError` naming what was wrong (``pages[3]: shape ...``)
before anything changes. Page buffers come out as 1-D uint8 views (no copy where the
layout allows), which is what the pipeline and the backends take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.backend import check_buffer
from kvtier.errors import KVTierUsageError
from kvtier.keys import KEY_BYTES, Namespace, PageKey
from kvtier.spec import KVSpec, canonical_dtype


def check_key(key: Any, what: str, optional: bool = False) -> PageKey:
    """``key`` as a page key, or :class:`KVTierUsageError` naming ``what``."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise KVTierUsageError(
            f"{what} must be a {KEY_BYTES}-byte page key{' or None' if optional else ''}, "
            f"got {type(key).__name__}"
            f"{' of ' + str(len(key)) + ' bytes' if isinstance(key, bytes) else ''}"
        )
    return PageKey(key)


def check_keys(keys: Sequence[Any], what: str = "keys") -> list[PageKey]:
    """``keys`` as a list of page keys, or :class:`KVTierUsageError` naming the bad one."""
    if isinstance(keys, bytes | bytearray | str | memoryview):
        raise KVTierUsageError(
            f"{what} must be a sequence of page keys, not a single {type(keys).__name__}"
        )
    if not isinstance(keys, Sequence | np.ndarray) and not hasattr(keys, "__iter__"):
        raise KVTierUsageError(f"{what} must be a sequence of page keys, got {type(keys).__name__}")
    return [check_key(k, f"{what}[{i}]") for i, k in enumerate(keys)]


def check_store_keys(keys: Sequence[Any], what: str = "keys") -> list[PageKey]:
    """``keys`` of pages to store or reserve, as :func:`check_keys` checks them, each
    given once; else :class:`KVTierUsageError` naming the first key repeated (one call
    storing two pages under one key would keep one of them and report both stored)."""
    ks = check_keys(keys, what)
    first: dict[PageKey, int] = {}
    for i, k in enumerate(ks):
        j = first.setdefault(k, i)
        if j != i:
            raise KVTierUsageError(
                f"{what}[{i}] repeats {what}[{j}]: each page is stored under its own key, "
                "once per call"
            )
    return ks


def check_parents(parents: Sequence[Any] | None, n: int) -> list[PageKey | None]:
    """The parent of each of ``n`` pages (``None`` entries allowed; all ``None`` when
    ``parents`` is), or :class:`KVTierUsageError` naming the bad one."""
    if parents is None:
        return [None] * n
    if isinstance(parents, bytes | bytearray | str):
        raise KVTierUsageError(
            f"parents must be a sequence of page keys, not a single {type(parents).__name__}"
        )
    try:
        parents = list(parents)
    except TypeError:
        raise KVTierUsageError(
            f"parents must be a sequence of page keys (or None), got {type(parents).__name__}"
        ) from None
    if len(parents) != n:
        raise KVTierUsageError(f"parents: got {len(parents)} for {n} keys")
    return [
        None if p is None else check_key(p, f"parents[{i}]", optional=True)
        for i, p in enumerate(parents)
    ]


#: Token ids, as the API takes them.
Tokens = Sequence[int] | np.ndarray
#: A namespace as the API takes it: a :class:`~kvtier.keys.Namespace`, its label, or
#: ``None`` for the cache's own.
NamespaceArg = Namespace | str | None


def namespace_of(namespace: NamespaceArg, default: Namespace) -> Namespace:
    """``namespace`` as a :class:`~kvtier.keys.Namespace` (``default``, the cache's own,
    when ``None``; a label parsed). :class:`KVTierUsageError` for anything else, a string
    that is not a namespace label, or a namespace whose page geometry (tokens per page, KV
    dtype with any lossy-codec mark, layout version) is not the cache's: its pages would be
    keyed as something they are not. Another model id, revision or rank is fine."""
    if namespace is None:
        return default
    if isinstance(namespace, str):
        namespace = Namespace.from_label(namespace)
    if not isinstance(namespace, Namespace):
        raise KVTierUsageError(
            f"namespace must be a Namespace, a label string or None, got {type(namespace).__name__}"
        )
    geometry = (namespace.page_tokens, namespace.kv_dtype, namespace.layout_version)
    ours = (default.page_tokens, default.kv_dtype, default.layout_version)
    if geometry != ours:
        raise KVTierUsageError(
            f"namespace {namespace.label!r} keys pages of {namespace.page_tokens} tokens of "
            f"{namespace.kv_dtype} (layout {namespace.layout_version}); this cache's pages "
            f"are {default.page_tokens} tokens of {default.kv_dtype} (layout "
            f"{default.layout_version}): a namespace may name another model, revision or "
            "rank, not another page geometry"
        )
    return namespace


def namespace_label(namespace: Namespace | str | None, default: Namespace) -> str:
    """The label of ``namespace`` (``default`` when ``None``); :class:`KVTierUsageError`
    for anything but a :class:`~kvtier.keys.Namespace`, a label string or ``None``."""
    if isinstance(namespace, Namespace):
        return namespace.label
    if namespace is None:
        return default.label
    if isinstance(namespace, str):
        return namespace
    raise KVTierUsageError(
        f"namespace must be a Namespace, a label string or None, got {type(namespace).__name__}"
    )


class PageInput:
    """Page buffers in and out of a cache of ``spec``, checked and viewed as uint8 rows."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec

    def rows(self, pages: Any, n: int, what: str, writable: bool = False) -> list[np.ndarray]:
        """``pages`` as ``n`` 1-D uint8 page views (no copy where the layout allows)."""
        spec = self.spec
        pb = spec.page_bytes
        shape_hint = (
            f"[{n}, {pb}] uint8 or [{n}, {', '.join(map(str, spec.page_shape))}] {spec.dtype}"
        )
        if isinstance(pages, list | tuple):
            if len(pages) != n:
                raise KVTierUsageError(f"{what}: got {len(pages)} pages for {n} keys")
            return [self.one_row(p, f"{what}[{i}]", writable) for i, p in enumerate(pages)]
        arr = self.as_numpy(pages, what, writable)
        if arr.dtype == np.uint8 and arr.ndim == 2:
            if arr.shape != (n, pb):
                raise KVTierUsageError(
                    f"{what}: shape {tuple(arr.shape)} does not match {shape_hint}"
                )
        else:
            expected = (n, *spec.page_shape)
            if tuple(arr.shape) != expected:
                raise KVTierUsageError(
                    f"{what}: shape {tuple(arr.shape)} does not match {shape_hint}"
                )
            if arr.nbytes != n * pb:  # e.g. uint8 in the page shape of a 2-byte dtype
                raise KVTierUsageError(
                    f"{what}: {arr.dtype} array of shape {tuple(arr.shape)} holds {arr.nbytes} "
                    f"bytes, not {n * pb} ({n} pages of {pb}); pass {shape_hint}"
                )
            arr = arr.view(np.uint8).reshape(n, pb)
        return list(arr)

    def one_row(self, page: Any, what: str, writable: bool) -> np.ndarray:
        """One page buffer as a 1-D uint8 view: bytes-like, flat uint8, or page_shape."""
        if isinstance(page, bytes | bytearray | memoryview):
            row = check_buffer(page, self.spec.page_bytes, what)
        else:
            arr = self.as_numpy(page, what, writable)
            if arr.dtype != np.uint8 or arr.ndim != 1:
                if tuple(arr.shape) != self.spec.page_shape:
                    raise KVTierUsageError(
                        f"{what}: shape {tuple(arr.shape)} is neither [{self.spec.page_bytes}] "
                        f"uint8 nor the page shape {list(self.spec.page_shape)}"
                    )
                arr = arr.view(np.uint8).reshape(-1)
            row = check_buffer(arr, self.spec.page_bytes, what)
        if writable and not row.flags.writeable:
            raise KVTierUsageError(f"{what} must be writable to receive a page")
        return row

    def as_numpy(self, obj: Any, what: str, writable: bool) -> np.ndarray:
        """A C-contiguous numpy view of a numpy array or CPU torch tensor, dtype-checked."""
        if type(obj).__module__.startswith("torch"):
            import torch

            if not isinstance(obj, torch.Tensor):
                raise KVTierUsageError(f"{what}: unsupported type {type(obj).__name__}")
            if obj.layout != torch.strided:
                raise KVTierUsageError(
                    f"{what}: a {obj.layout} tensor; kvtier takes dense (strided) tensors"
                )
            if obj.device.type != "cpu":
                raise KVTierUsageError(
                    f"{what}: tensor is on {obj.device}; kvtier's facade takes CPU tensors"
                )
            if obj.dtype != torch.uint8:
                self.check_dtype(str(obj.dtype), what)
            if not obj.is_contiguous():
                if writable:
                    raise KVTierUsageError(f"{what}: output tensor must be contiguous")
                obj = obj.contiguous()
            flat: np.ndarray = obj.detach().reshape(-1).view(torch.uint8).numpy()
            # keep the logical shape for the checks, in bytes along the last axis
            shape = tuple(obj.shape)
            if obj.dtype == torch.uint8:
                return flat.reshape(shape)
            return ByteRows(flat, shape, obj.element_size()).array()
        if not isinstance(obj, np.ndarray):
            raise KVTierUsageError(
                f"{what}: expected a numpy array, a CPU torch tensor or a list of page "
                f"buffers, got {type(obj).__name__}"
            )
        if not obj.dtype.isnative:  # its bytes are not the spec dtype's bytes
            raise KVTierUsageError(
                f"{what}: dtype {obj.dtype.str} is not in native byte order; convert it "
                f"first (.astype({obj.dtype.name!r}))"
            )
        if obj.dtype != np.uint8:
            self.check_dtype(obj.dtype.name, what)
        if not obj.flags.c_contiguous:
            if writable:
                raise KVTierUsageError(f"{what}: output array must be C-contiguous")
            obj = np.ascontiguousarray(obj)
        if writable and not obj.flags.writeable:
            raise KVTierUsageError(f"{what}: output array must be writable")
        return np.asarray(obj)

    def check_dtype(self, name: str, what: str) -> None:
        """A dtype (by name) must be the spec's KV dtype."""
        try:
            dtype = canonical_dtype(name)
        except KVTierUsageError:
            dtype = name
        if dtype != self.spec.dtype:
            raise KVTierUsageError(
                f"{what}: dtype {name} does not match the model's KV dtype {self.spec.dtype} "
                f"(pass the spec dtype, or raw uint8 page bytes)"
            )


class ByteRows:
    """Reinterpret a flat byte buffer of a typed tensor with the tensor's logical shape,
    the last axis in bytes (so shape checks against page_shape still work)."""

    def __init__(self, flat: np.ndarray, shape: tuple[int, ...], itemsize: int) -> None:
        self.flat = flat
        self.shape = shape
        self.itemsize = itemsize

    def array(self) -> np.ndarray:
        if not self.shape:
            return self.flat
        dtype = np.dtype(f"V{self.itemsize}")
        return self.flat.view(dtype).reshape(self.shape)
