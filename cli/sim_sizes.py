"""Sizes of ``kvtier bench sim``'s simulated tiers: ``--capacity`` (a share of the
distinct blocks or a page count), ``--tier-scale`` for each tier below, and each tier's
codec page factor (``--codec``). Every size is checked before the first replay.
"""

from __future__ import annotations

import math
from typing import Any

from kvtier.errors import KVTierUsageError


def parse_capacity(text: str, distinct: int) -> int:
    """``"1%"`` or ``"0.01"`` (a share of distinct blocks) or ``"2000"`` (pages)."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise KVTierUsageError(f"bad capacity {text!r}: use 1%, 0.01 or a page count") from None
    if not math.isfinite(v) or v <= 0:
        raise KVTierUsageError(f"capacity must be a finite number > 0, got {text!r}")
    if t.endswith("%"):
        if v > 1e6:
            raise KVTierUsageError(f"capacity {text!r} is beyond reason")
        return max(1, int(v * distinct))
    if v < 1:
        return max(1, int(v * distinct))
    if v != int(v):
        raise KVTierUsageError(f"absolute capacity must be a whole number of pages: {text!r}")
    return int(v)


#: The most pages a simulated tier may hold (page counts are 64-bit integers).
MAX_TIER_PAGES = 2**63 - 1


def tier_pages(
    capacity: str, top: int, tier_scale: float, names: list[str], factors: list[float]
) -> list[int]:
    """Pages per tier for a top tier of ``top`` pages (``--capacity capacity``): each lower
    tier ``tier_scale`` times the one above, each times its codec page factor, at least 1.
    Raises :class:`KVTierUsageError` naming the tier that would hold more than
    :data:`MAX_TIER_PAGES` (or a number of pages beyond the float range)."""
    out = []
    for i, (name, factor) in enumerate(zip(names, factors, strict=True)):
        try:
            scaled = top if i == 0 else int(top * tier_scale**i)
            pages = max(1, int(scaled * factor))
        except OverflowError:
            pages = MAX_TIER_PAGES + 1
        if pages > MAX_TIER_PAGES:
            what = f"--capacity {capacity}" + ("" if i == 0 else f" --tier-scale {tier_scale:g}")
            raise KVTierUsageError(
                f"{what}: tier {name!r} would hold more than 2**63 - 1 pages, the most a tier holds"
            )
        out.append(pages)
    return out


def codec_page_factors(codecs: dict[str, str], tier_names: list[str], spec: Any) -> list[float]:
    """Per tier, pages held per page of uncoded capacity: ``page_bytes / slot_bytes`` of its
    codec (``fp8-e4m3`` about 2; a lossless codec slightly under 1, since capacity counts
    a raw page plus the frame), 1 without a codec. A codec is written as for ``kvtier
    bench codec``: ``NAME[:key=value,...]`` (:func:`kvtier.bench.codec.parse_codec`)."""
    from kvtier.bench.codec import parse_codec
    from kvtier.codec import NO_CODEC, make_codec, slot_bytes

    unknown = sorted(set(codecs) - set(tier_names))
    if unknown:
        raise KVTierUsageError(
            f"--codec names tier(s) {unknown}; tiers are {tier_names} (--tiers, default "
            f"hbm): add them, e.g. --tiers {','.join([*tier_names, *unknown])}"
        )
    out = []
    for name in tier_names:
        codec, params = parse_codec(codecs.get(name, NO_CODEC))
        if codec == NO_CODEC and not params:
            out.append(1.0)
            continue
        out.append(spec.page_bytes / slot_bytes(make_codec(codec, spec, **params)))
    return out
