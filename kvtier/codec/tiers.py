"""Building a tier's backend with its codec: what :class:`~kvtier.cache.KVCache` calls.

A tier configured with ``codec = "none"`` (the default) gets its backend exactly as
before: no wrapper, the plain store format. Any other codec applies to store backends
only: the store is built for the codec's slot size and ``capacity_bytes // slot`` pages
(:func:`kvtier.codec.store.tier_capacity_pages`) and wrapped in a
:class:`~kvtier.codec.store.CodecStore`.

Either way a tier holds ``capacity_bytes // footprint`` pages, the footprint being the
room one page (or slot) takes in the backend
(:meth:`~kvtier.backend.Backend.page_footprint`: the page itself in memory, a 4 KiB-aligned
slot with its header on NVMe), so a tier never takes more than its capacity.
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


class TierCapacityError(ConfigError):
    """A tier's capacity holds no page in its backend (which may need more room per page
    than the page itself: :meth:`~kvtier.backend.Backend.page_footprint`)."""


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

    Raises :class:`TierCapacityError` (a :class:`ConfigError`) for a capacity that holds no
    page, :class:`TierCodecError` (one too) for an unknown codec, bad codec parameters, a
    codec on an arena backend or a capacity below one encoded page; the
    backend's own errors (unknown options, bad values) propagate as
    :func:`kvtier.registry.create` raises them.
    """
    cls = registry.resolve(backend)
    if codec == NO_CODEC:
        pages = cls.capacity_pages_for(capacity_bytes, spec.page_bytes)
        if pages < 1:
            raise TierCapacityError(_no_page(backend, capacity_bytes, spec.page_bytes, cls))
        return registry.create(backend, page_bytes=spec.page_bytes, capacity_pages=pages, **options)
    if cls.kind is not BackendKind.STORE:
        raise TierCodecError(
            f"codec {codec!r} needs a store backend; {backend!r} is an {cls.kind} "
            "(codecs apply to the tiers below memory)"
        )
    try:
        made = make_codec(codec, spec, **dict(codec_params or {}))
    except ConfigError as exc:
        raise TierCodecError(str(exc)) from None
    pages = tier_capacity_pages(capacity_bytes, made, cls)
    if pages < 1:
        raise TierCodecError(
            _no_page(backend, capacity_bytes, slot_bytes(made), cls) + f" encoded with {codec!r}"
        )
    inner = registry.construct(cls, page_bytes=slot_bytes(made), capacity_pages=pages, **options)
    assert isinstance(inner, StoreBackend)
    return wrap(inner, made)


def _no_page(backend: str, capacity_bytes: int, page_bytes: int, cls: type[Backend]) -> str:
    """Why a capacity holds no page, with the room one page takes in this backend."""
    takes = cls.page_footprint(page_bytes)
    room = "" if takes == page_bytes else f" (on {backend!r} one takes {takes} bytes)"
    return f"capacity {capacity_bytes} bytes holds no page of {page_bytes} bytes{room}"
