"""Sizes of ``kvtier bench sim``'s simulated tiers: ``--capacity`` (a share of the
distinct blocks or a page count), ``--tier-scale`` for each tier below, and each tier's
codec page factor (``--codec``). Every size is checked before the first replay.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from kvtier.errors import KVTierUsageError


def parse_capacity(text: str, distinct: int) -> int:
    """Pages of ``--capacity text`` for a trace of ``distinct`` blocks: ``"1%"`` or
    ``"0.01"`` (a share of the distinct blocks, at most 100 %; a number below 1 is a
    share) or ``"2000"`` (pages; a number of 1 or more is a page count). Raises
    :class:`KVTierUsageError` naming ``--capacity`` and the text otherwise."""
    kind, value = capacity_value(text)
    if kind == "share":
        return max(1, int(value * distinct))
    if value != int(value):
        raise KVTierUsageError(
            f"--capacity {text}: a page count must be a whole number of pages (a share is "
            "below 1, e.g. 0.01, or a percentage, e.g. 1%)"
        )
    return int(value)


def capacity_value(text: str) -> tuple[str, float]:
    """What ``--capacity text`` asks for: ``("share", s)`` with ``0 < s <= 1`` or
    ``("pages", n)`` with ``n >= 1`` (not yet checked to be whole); see
    :func:`parse_capacity`. Raises :class:`KVTierUsageError` naming ``--capacity``."""
    t = text.strip()
    percent = t.endswith("%")
    try:
        v = float(t[:-1]) / 100 if percent else float(t)
    except ValueError:
        raise KVTierUsageError(
            f"--capacity: bad capacity {text!r}: use 1%, 0.01 or a page count"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise KVTierUsageError(f"--capacity: capacity must be a finite number > 0, got {text!r}")
    if percent and v > 1:
        raise KVTierUsageError(
            f"--capacity {text}: a share of the distinct blocks is at most 100% (for more "
            "pages, give a page count, e.g. --capacity 2000)"
        )
    return ("share", v) if percent or v < 1 else ("pages", v)


def capacity_key(text: str) -> tuple[str, Fraction]:
    """The exact capacity ``--capacity text`` asks for, so ``1%`` and ``0.01`` (or
    ``2000`` and ``2000.0``) compare equal: ``("share", s)`` or ``("pages", n)``, from the
    decimal text (no rounding). ``text`` must pass :func:`capacity_value`."""
    kind, value = capacity_value(text)
    t = text.strip()
    try:
        exact = Fraction(Decimal(t[:-1])) / 100 if t.endswith("%") else Fraction(Decimal(t))
    except (InvalidOperation, ValueError):  # a form float reads and Decimal does not
        exact = Fraction(value)
    return kind, exact


def unique_capacities(texts: list[str]) -> list[str]:
    """``texts`` without repeats of a capacity already listed (:func:`capacity_key`), in
    order: a capacity given twice is replayed once, as a policy named twice is."""
    seen: dict[tuple[str, Fraction], str] = {}
    for text in texts:
        seen.setdefault(capacity_key(text), text)
    return list(seen.values())


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


#: Tier names the simulator models as memory arenas (``--tiers``), where the live cache
#: refuses a codec.
ARENA_TIERS = ("hbm", "dram")


def codec_page_factors(codecs: dict[str, str], tier_names: list[str], spec: Any) -> list[float]:
    """Per tier, pages held per page of uncoded capacity: ``page_bytes / slot_bytes`` of its
    codec, 1 without a codec. A codec is written as for ``kvtier bench codec``:
    ``NAME[:key=value,...]`` (:func:`kvtier.bench.codec.parse_codec`).

    For 16-token pages of 16-bit KV: ``fp8-e4m3`` about 2 (one float32 scale per layer,
    K/V and head); ``int8`` 1.6 (its default ``scale=channel`` keeps a float32 scale per
    head dimension over the page's 16 tokens: 1.25 bytes an element), about 1.94 with
    ``scale=token``; a lossless codec just under 1 (capacity counts a raw page plus the
    frame). Raises :class:`KVTierUsageError` naming ``--codec`` for a tier not in
    ``tier_names``, an unknown codec or a bad parameter."""
    unknown = sorted(set(codecs) - set(tier_names))
    if unknown:
        raise KVTierUsageError(
            f"--codec names tier(s) {unknown}; tiers are {tier_names} (--tiers, default "
            f"hbm): add them, e.g. --tiers {','.join([*tier_names, *unknown])}"
        )
    arenas = [n for n in codecs if n in ARENA_TIERS]
    if arenas:  # the live cache refuses a codec there: no page count to model
        raise KVTierUsageError(
            f"--codec {arenas[0]}={codecs[arenas[0]]}: {arenas[0]!r} is a memory arena, and "
            "a codec applies to a store tier (nvme, file, remote), as in the live cache"
        )
    return [_page_factor(n, codecs[n], spec) if n in codecs else 1.0 for n in tier_names]


def _page_factor(tier: str, text: str, spec: Any) -> float:
    """Pages a tier coded with ``text`` holds per page of uncoded capacity (see
    :func:`codec_page_factors`); errors name ``--codec tier=text``."""
    from kvtier.bench.codec import parse_codec
    from kvtier.codec import NO_CODEC, make_codec, slot_bytes

    try:
        codec, params = parse_codec(text)
        if codec == NO_CODEC and not params:
            return 1.0
        return float(spec.page_bytes / slot_bytes(make_codec(codec, spec, **params)))
    except KVTierUsageError as exc:
        raise KVTierUsageError(f"--codec {tier}={text}: {exc}") from None
