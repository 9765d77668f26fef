"""Admission policies: whether a page may enter a tier at all.

* :class:`FrequencyAdmission` - TinyLFU-style: a count-min sketch of recent references
  (with periodic halving, so it forgets) admits a page once it has been referenced at
  least ``threshold`` times. One-hit pages (three quarters of real chat traffic) never
  enter the tier.
* :class:`ReusePredictor` - the reuse predictor behind *selective write-through*: a page
  goes down the hierarchy only if it is likely to be reused, i.e. it was referenced
  before, or its parent (the page before it in its sequence) was reused. The live pipeline
  asks it before writing a page down; the replay asks it the same way.

Both are deterministic (xxhash of the key, never Python's salted ``hash``). The module
also holds the registry of admission policies by config name (:func:`make_admission`,
:func:`register_admission`), used by the configuration, the cache and ``kvtier bench sim``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import xxhash

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import AdmissionPolicy, AdmitAll


class CountMinSketch:
    """A 4-row count-min sketch of 8-bit counters that halves itself every ``sample``
    increments (TinyLFU's reset), so counts reflect recent traffic."""

    ROWS = 4

    def __init__(self, width: int = 1 << 16, sample: int | None = None) -> None:
        if width < 16 or width & (width - 1):
            raise ConfigError(f"sketch width must be a power of two >= 16, got {width}")
        self.width = width
        self.sample = sample if sample is not None else 10 * width
        if self.sample < 1:
            raise ConfigError(f"sketch sample must be >= 1, got {self.sample}")
        self._rows = [bytearray(width) for _ in range(self.ROWS)]
        self._adds = 0

    def _slots(self, key: bytes) -> list[int]:
        h = xxhash.xxh3_64_intdigest(key)
        mask = self.width - 1
        return [(h >> (16 * i)) & mask for i in range(self.ROWS)]

    def add(self, key: bytes) -> None:
        """Count one reference of ``key``."""
        for row, s in zip(self._rows, self._slots(key), strict=True):
            if row[s] < 255:
                row[s] += 1
        self._adds += 1
        if self._adds >= self.sample:
            self._adds = 0
            for row in self._rows:
                row[:] = bytes(v >> 1 for v in row)

    def estimate(self, key: bytes) -> int:
        """An upper bound of the recent references of ``key``."""
        return min(row[s] for row, s in zip(self._rows, self._slots(key), strict=True))


class FrequencyAdmission(AdmissionPolicy):
    """Admit a page once it was referenced at least ``threshold`` times recently."""

    name: ClassVar[str] = "frequency"

    def __init__(self, threshold: int = 2, width: int = 1 << 16) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ConfigError(f"frequency admission: threshold must be >= 1, got {threshold!r}")
        self.threshold = threshold
        self.sketch = CountMinSketch(width)

    def on_access(self, key: PageKey) -> None:
        self.sketch.add(key)

    def admit(self, key: PageKey) -> bool:
        return self.sketch.estimate(key) >= self.threshold


class ReusePredictor(AdmissionPolicy):
    """Selective write-through: admit pages likely to be reused.

    A page is predicted reusable when it has been referenced more than once recently, or
    when :meth:`note_parent` said its parent was reused (a continued session extends a
    prefix that already proved useful). Memory is bounded by the sketch.
    """

    name: ClassVar[str] = "reuse"

    def __init__(self, width: int = 1 << 16) -> None:
        self.sketch = CountMinSketch(width)
        self._reused_parents = CountMinSketch(width)

    def on_access(self, key: PageKey) -> None:
        self.sketch.add(key)

    def note_parent(self, key: PageKey, parent: PageKey | None) -> None:
        """Record that ``key`` extends ``parent``; children of reused pages are admitted."""
        if parent is not None and self.sketch.estimate(parent) >= 2:
            self._reused_parents.add(key)

    def admit(self, key: PageKey) -> bool:
        return self.sketch.estimate(key) >= 2 or self._reused_parents.estimate(key) >= 1


# -- the registry: admission policies by config name --------------------------------------

#: Admission policies by config name (``pipeline.admission``); add with
#: :func:`register_admission`.
ADMISSION_POLICIES: dict[str, Callable[..., AdmissionPolicy]] = {
    AdmitAll.name: AdmitAll,
    FrequencyAdmission.name: FrequencyAdmission,
    ReusePredictor.name: ReusePredictor,
}


def register_admission(name: str, factory: Callable[..., AdmissionPolicy]) -> None:
    """Make an :class:`~kvtier.policy.base.AdmissionPolicy` selectable by ``name``."""
    ADMISSION_POLICIES[name] = factory


def make_admission(name: str, **params: Any) -> AdmissionPolicy:
    """Build the admission policy ``name`` with ``params``.

    Raises:
        ConfigError: unknown name (the message lists the known ones) or bad parameters.
    """
    try:
        factory = ADMISSION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(ADMISSION_POLICIES))
        raise ConfigError(
            f"pipeline.admission: unknown admission policy {name!r}; known: {known}"
        ) from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(
            f"pipeline.admission_params: bad parameters for {name!r}: {exc}"
        ) from None


def admission_names() -> list[str]:
    """Names of the registered admission policies, sorted."""
    return sorted(ADMISSION_POLICIES)
