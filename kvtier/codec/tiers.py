"""Building a tier's backend with its codec: what :class:`~kvtier.cache.KVCache` calls.

A tier configured with ``codec = "none"`` (the default) gets its backend exactly as
before: no wrapper, the plain store format. Any other codec applies to store backends
only: the store is built for the codec's slot size and ``capacity_bytes // slot`` pages
(:func:`kvtier.codec.store.tier_capacity_pages`) and wrapped in a
:class:`~kvtier.codec.store.CodecStore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier import registry
from kvtier.backend import Backend, BackendKind, StoreBackend
from kvtier.codec.registry import NO_CODEC, make_codec
from kvtier.codec.store import slot_bytes, tier_capacity_pages, wrap
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec


class TierCodecError(ConfigError):
    """A tier's codec does not fit its backend (an arena) or its capacity."""


def create_backend(
    backend: str,
    *,
    spec: KVSpec,
    capacity_bytes: int,
    options: Mapping[str, Any],
    codec: str = NO_CODEC,
    codec_params: Mapping[str, Any] | None = None,
) -> Backend:
    """The (unopened) backend of one tier.

    Raises :class:`TierCodecError` (a :class:`ConfigError`) for an unknown codec, bad codec
    parameters, a codec on an arena backend or a capacity below one encoded page; the
    backend's own errors (unknown options, bad values) propagate as
    :func:`kvtier.registry.create` raises them.
    """
    if codec == NO_CODEC:
        return registry.create(
            backend,
            page_bytes=spec.page_bytes,
            capacity_pages=capacity_bytes // spec.page_bytes,
            **options,
        )
    cls = registry.resolve(backend)
    if cls.kind is not BackendKind.STORE:
        raise TierCodecError(
            f"codec {codec!r} needs a store backend; {backend!r} is an {cls.kind} "
            "(codecs apply to the tiers below memory)"
        )
    try:
        made = make_codec(codec, spec, **dict(codec_params or {}))
    except ConfigError as exc:
        raise TierCodecError(str(exc)) from None
    pages = tier_capacity_pages(capacity_bytes, made)
    if pages < 1:
        raise TierCodecError(
            f"capacity {capacity_bytes} bytes holds no page of {slot_bytes(made)} bytes "
            f"encoded with {codec!r}"
        )
    inner = cls(page_bytes=slot_bytes(made), capacity_pages=pages, **options)
    assert isinstance(inner, StoreBackend)
    return wrap(inner, made)
