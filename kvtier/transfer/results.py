"""What the pipeline's fetches answer: :class:`LoadResult` and :class:`PrefetchResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.keys import PageKey


@dataclass
class LoadResult:
    """Result of :meth:`~kvtier.transfer.pipeline.Pipeline.load`.

    Attributes:
        slots: top-tier slot of each requested key (``None`` when missing, or when the top
            tier is a store).
        missing: keys that could not be brought to the top tier (absent everywhere, or
            every tier holding them failed): the engine recomputes them.
    """

    slots: list[int | None]
    missing: list[PageKey]


@dataclass
class PrefetchResult:
    """Result of :meth:`~kvtier.transfer.pipeline.Pipeline.prefetch`.

    Attributes:
        arrived: keys resident in the top tier by the deadline.
        late: keys still moving at the deadline (they may land later, in the background).
        missing: keys absent from every tier, or whose transfer failed.
    """

    arrived: list[PageKey]
    late: list[PageKey] = field(default_factory=list)
    missing: list[PageKey] = field(default_factory=list)
