"""``interval``: evict the page whose next use, forecast from the mean interval between its
past uses, is furthest away.

This is :class:`~kvtier.policy.hinted.HintedPolicy` without hints: every reference is
unforeseen, so every page used at least twice (at different times) has a *rate
forecast*, its last use plus the mean interval of its uses. Once that time is past, the
wait stretches the interval, and each second late adds ``lateness`` (0.25) seconds more:
a page whose traffic stopped (popularity moved to other pages) leaves sooner than the
stretched mean of its old, frequent uses would let it. Victims: pages used once, in the
fallback policy's order (LRU-2's, where they come in LRU order); then the pages with a
forecast, furthest first. Rates of evicted pages are kept for ``rate_history``
capacities, so a page that comes back keeps its history.

Unlike LRU-2, which ranks pages by their second most recent use, it ranks them by when
they are expected next: a page used every second, last used a minute ago, goes before a
page used every ten minutes, last used a minute ago. On the first half of the Mooncake
conversation trace it is 0.0055 / 0.0066 ahead of LRU-2 in prefix hit rate at 1 / 5 %
capacity (docs/benchmarks.md, "Policy suite"; before ``lateness``). It needs the clock:
the replay passes the trace's time and the live cache ``time.monotonic()``
(:meth:`on_time`); ``adaptive`` forwards its clock to it.

Engine hints are ignored (the clock they carry is kept): ``hinted`` is the policy that
uses them, ``adaptive`` runs both.
"""

from __future__ import annotations

from typing import ClassVar

from kvtier.policy.hinted import HintedPolicy
from kvtier.policy.hints import Hint

#: Seconds added to an overdue forecast per second it is late (see
#: :mod:`kvtier.policy.rate_table`), chosen on the policy suite's tuning half (0, 0.1,
#: 0.25, 0.5 and 1 tried; docs/benchmarks.md, "Policy suite").
DEFAULT_LATENESS = 0.25


class IntervalPolicy(HintedPolicy):
    """The furthest forecast next use first, by the mean interval of each page's uses."""

    name: ClassVar[str] = "interval"

    def __init__(
        self,
        fallback: str = "lru-k",
        history: float = 4.0,
        rate_history: float = 16.0,
        lateness: float = DEFAULT_LATENESS,
    ) -> None:
        """``fallback``: a registered policy for the pages used once. ``history`` /
        ``rate_history``: capacities of evicted pages whose use counts are kept, for pages
        used once / more; ``lateness``: what each second past a forecast adds to it (see
        :class:`~kvtier.policy.hinted.HintedPolicy`). Raises
        :class:`~kvtier.errors.ConfigError` for a bad value."""
        super().__init__(
            fallback=fallback, history=history, rate_history=rate_history, lateness=lateness
        )

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """Hints are not this policy's input; only their time is kept."""
        self.on_time(now_s)
