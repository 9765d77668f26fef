"""Page limits of one tier: its capacity and its watermarks, in pages."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.errors import KVTierUsageError


@dataclass(frozen=True)
class TierLimits:
    """Capacity and watermarks of a tier, in pages.

    Attributes:
        capacity: pages the tier can hold.
        high: past this many pages eviction starts (at least 1).
        low: eviction brings the tier down to this many pages (at most ``high``).
    """

    capacity: int
    high: int
    low: int

    @classmethod
    def of(
        cls, capacity: int, high_watermark: float = 1.0, low_watermark: float = 1.0
    ) -> TierLimits:
        """Limits of a tier of ``capacity`` pages from watermark fractions in (0, 1].

        Raises:
            KVTierUsageError: a negative capacity or a fraction outside (0, 1].
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise KVTierUsageError(f"capacity must be an int of pages >= 0, got {capacity!r}")
        for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
            if not 0 < value <= 1:
                raise KVTierUsageError(f"{name} must be in (0, 1], got {value!r}")
        high = max(1, math.floor(high_watermark * capacity + 1e-9))
        low = min(high, max(0, math.floor(low_watermark * capacity + 1e-9)))
        return cls(capacity, high, low)
