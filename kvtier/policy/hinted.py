"""``hinted``: evict by what the engine said (see :mod:`kvtier.policy.hints`), and by a
fallback policy where it said nothing.

For every page the policy keeps what the hints imply:

* a *predicted next use* (``next_turn``: the hint's time plus its gap; ``open``: the
  typical gap seen in ``next_turn`` hints so far), consumed when the page is referenced
  and dropped as *overdue* once the session is late by more than its own gap;
* *dead* pages (``close``, or a ``ttl`` that ran out): nothing more will come for them;
* *pinned* pages (``pin``, until ``unpin``) and *weights* (``priority``);
* the *unforeseen rate*: references no hint foretold (a new session reusing a tenant's
  system prompt or a tool prompt) counted per page, at most one per
  ``SAME_REFERENCE_S``. A page with two or more has a *rate forecast*: its last
  unforeseen reference plus their mean interval (once that time is past, now plus the
  interval from the first one to now, divided by the number of intervals: the wait
  stretches the estimate; plus ``lateness`` x how late it is, 0 here by default and 0.25
  in ``interval``). Hints describe sessions; a page many sessions share is used by
  sessions no hint announced yet, and this is how the policy sees them.

A page's *forecast* is the sooner of its live prediction and its rate forecast.
Victims, in order: dead pages (oldest death first); pages without a forecast, in the
fallback policy's order (low-weight pages before high-weight ones); pages with one, the
furthest first (Belady's rule on what the engine said and the traffic showed), the
distance divided by the page's weight; pinned pages last. A page referenced again after
a ``close`` or past its ``ttl`` simply comes back to life: a wrong hint costs the hits it
lost, never correctness. Hints given for pages the tier does not hold are kept for
``history`` capacities of pages, so a hint that arrives before its pages does count; the
rates of evicted pages are kept for ``rate_history`` capacities (``history`` for pages
with one unforeseen reference): a shared prompt evicted and fetched again keeps its rate.

Time comes from :meth:`on_time` (the replay passes the trace's clock, the live cache
``time.monotonic()``); without it every prediction is relative to the last hint.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy, close_order, victims_in_order
from kvtier.policy.hint_predict import add_predictions, overdue_of
from kvtier.policy.hints import Hint, NextUse, hint_target
from kvtier.policy.params import nonnegative_param, share_param
from kvtier.policy.prefix_cut import policy_offers
from kvtier.policy.rate_table import RateTable

#: Unforeseen references of a page closer than this (seconds) count as one: the same
#: request touching a page twice (its store, then its load) is not two uses.
SAME_REFERENCE_S = 0.001

#: Up to this many held pages the forecast ranking is built afresh for every walk.
EXACT_RANKING_PAGES = 8192
#: Above it, the ranking is rebuilt once this share of the held pages changed or left.
RANKING_REUSE_SHARE = 0.125


def _fallback(name: str, owner: str) -> EvictionPolicy:
    """The fallback policy ``name`` of policy ``owner`` (``hinted`` or ``interval``)."""
    from kvtier.policy.eviction import make_policy

    if not isinstance(name, str):
        raise ConfigError(f"{owner}: fallback must be a policy name, got {name!r}")
    try:
        policy = make_policy(name)
    except ConfigError as exc:
        raise ConfigError(f"{owner}: fallback: {exc}") from None
    if hint_target(policy) is not None:  # it would never be given the clock or the hints
        raise ConfigError(f"{owner}: the fallback cannot be {name!r}, a policy that keeps time")
    return policy


class HintedPolicy(EvictionPolicy):
    """Engine hints first, ``fallback`` for the pages hints say nothing about."""

    name: ClassVar[str] = "hinted"

    def __init__(
        self,
        fallback: str = "lru-k",
        history: float = 4.0,
        pin_share: float = 0.5,
        rate_history: float = 16.0,
        lateness: float = 0.0,
    ) -> None:
        """``fallback``: a registered policy that keeps no clock. ``history``: how many
        capacities of hinted pages not (or no longer) in the tier keep their hint (and of
        evicted pages with one unforeseen reference, their count). ``rate_history``: how
        many capacities of evicted pages with two or more unforeseen references keep their
        rate. ``pin_share``: pins hold while pinned pages fill at most this share of the
        tier (an engine pinning more than fits gets plain eviction for them). ``lateness``:
        each second a rate forecast is late adds this many seconds to it (0: the wait only
        stretches the mean interval; :mod:`kvtier.policy.rate_table`). Raises
        :class:`ConfigError` naming a bad value and this policy (or ``interval``)."""
        self.history = nonnegative_param(self.name, "history", history)
        self.rate_history = nonnegative_param(self.name, "rate_history", rate_history)
        lateness = nonnegative_param(self.name, "lateness", lateness, finite=True)
        self.pin_share = share_param(self.name, "pin_share", pin_share)
        self.fallback = _fallback(fallback, self.name)
        self.now = 0.0
        self._seen_c = 0
        self._resident: set[PageKey] = set()
        #: page -> pending predicted uses (time, overdue after, tolerance), soonest first;
        #: a page shared by several sessions has one per session (at most 8).
        self._predicted: dict[PageKey, tuple[tuple[float, float, float], ...]] = {}
        #: page -> [first, last, count] of its unforeseen references; the held pages
        #: with two or more of them, for ranking all at once.
        self._unforeseen: dict[PageKey, tuple[float, float, float]] = {}
        self._rates = RateTable(lateness)
        #: Pages with an unforeseen rate the tier no longer holds, oldest first.
        self._rate_absent: OrderedDict[PageKey, None] = OrderedDict()
        #: The same for pages with one unforeseen reference (kept ``history`` only).
        self._once_absent: OrderedDict[PageKey, None] = OrderedDict()
        #: The forecast ranking of a large tier, reused between walks (see
        #: :meth:`_by_forecast`), the pages changed since it was built, and how many left.
        self._ranking: list[tuple[float, PageKey]] | None = None
        #: Held pages without a forecast, kept up to date on every event; the clock's
        #: part (predictions falling overdue) through ``_overdue``: (the time after which
        #: a page's predictions are all overdue, page), soonest first.
        self._plain: set[PageKey] = set()
        self._overdue: list[tuple[float, PageKey]] = []
        self._changed: set[PageKey] = set()
        self._fresh_scores: dict[PageKey, float | None] = {}
        self._ranking_head = 0
        self._left_since_ranking = 0
        self._dead: OrderedDict[PageKey, None] = OrderedDict()
        self._pinned: set[PageKey] = set()
        self._weight: dict[PageKey, float] = {}
        self._expiry: dict[PageKey, float] = {}
        # Hinted pages the tier does not hold, oldest first (bounded by ``history``).
        self._absent: OrderedDict[PageKey, None] = OrderedDict()
        self._next_use = NextUse()
        self.hints_seen = 0

    @property
    def c(self) -> int:
        """The most pages held at once (the capacity once the tier has filled)."""
        return max(self._seen_c, 1)

    # -- hints and time ---------------------------------------------------------------

    def on_time(self, now_s: float) -> None:
        if now_s > self.now:
            self.now = now_s

    def _note_absent(self, key: PageKey) -> None:
        if key in self._resident:
            return
        self._absent[key] = None
        self._absent.move_to_end(key)
        limit = self.history * self.c
        while len(self._absent) > limit:
            old, _ = self._absent.popitem(last=False)
            self._forget(old)

    def _forget(self, key: PageKey) -> None:
        self._predicted.pop(key, None)
        self._dead.pop(key, None)
        self._pinned.discard(key)
        self._weight.pop(key, None)
        self._expiry.pop(key, None)

    def on_hint(self, hint: Hint, now_s: float) -> None:
        self.on_time(now_s)
        now = self.now
        self.hints_seen += 1
        kind = hint.kind
        if (use := self._next_use.window(hint, now)) is not None:
            self._overdue = add_predictions(
                hint.keys, use, self._predicted, self._overdue, (self._dead, self._expiry)
            )
        elif kind == "close":
            for k in hint.keys:
                self._predicted.pop(k, None)
                self._dead[k] = None
                self._dead.move_to_end(k)
        elif kind == "ttl":
            assert hint.value is not None
            for k in hint.keys:
                self._expiry[k] = now + hint.value
        elif kind == "priority":
            assert hint.value is not None
            for k in hint.keys:
                if hint.value == 1.0:
                    self._weight.pop(k, None)
                else:
                    self._weight[k] = hint.value
        elif kind == "pin":
            self._pinned.update(hint.keys)
        elif kind == "unpin":
            self._pinned.difference_update(hint.keys)
        resident = self._resident
        for k in hint.keys:
            if k in resident:
                self._stale(k)
                self._recheck(k)
            else:
                self._note_absent(k)

    # -- the EvictionPolicy hooks -------------------------------------------------------

    def _rate_forecast(self, key: PageKey) -> float | None:
        """The page's next use by its unforeseen rate, if it has two such references."""
        seen = self._unforeseen.get(key)
        if seen is None or seen[2] < 2.0:
            return None
        first, last, count = seen
        at = last + (last - first) / (count - 1.0)
        if at >= self.now:
            return at
        late = self._rates.lateness * (self.now - at)
        return self.now + (self.now - first) / (count - 1.0) + late

    def _recheck(self, key: PageKey) -> None:
        """Put a held page in, or take it out of, the pages without a forecast
        (:meth:`forecast` is None: no rate, no live prediction), cheaply."""
        seen = self._unforeseen.get(key)
        if (
            key in self._resident
            and (seen is None or seen[2] < 2.0)
            and (key not in self._predicted or self._live_prediction(key) is None)
        ):
            self._plain.add(key)
        else:
            self._plain.discard(key)

    def _catch_up(self) -> None:
        """Recheck the pages whose predictions fell overdue since the last walk."""
        heap = self._overdue
        while heap and heap[0][0] < self.now:
            self._recheck(heapq.heappop(heap)[1])

    def forecast(self, key: PageKey) -> float | None:
        """When the page is expected next (trace or monotonic seconds): the sooner of its
        live prediction and its rate forecast; None when it has neither."""
        live = self._live_prediction(key)
        rate = self._rate_forecast(key)
        if live is None:
            return rate
        return live if rate is None else min(live, rate)

    def _stale(self, key: PageKey) -> None:
        """The page's forecast inputs changed: its ranked score is stale."""
        self._changed.add(key)
        if self._fresh_scores:
            self._fresh_scores.pop(key, None)

    def _referenced(self, key: PageKey) -> None:
        """A held page referenced: its count, rate, predictions, :meth:`_recheck`."""
        self._stale(key)
        now = self.now
        pending = self._predicted.get(key)
        seen = self._unforeseen.get(key)
        counted = False
        if pending and any(at <= now + tol and overdue >= now for at, overdue, tol in pending):
            pass  # a use the hints foretold
        elif seen is None:
            self._unforeseen[key] = (now, now, 1.0)  # tuples: no objects for the GC to track
        elif now >= seen[1] + SAME_REFERENCE_S:
            self._unforeseen[key] = seen = (seen[0], now, seen[2] + 1.0)
            counted = True
        rated = seen is not None and seen[2] >= 2.0
        if rated and seen and (counted or key not in self._rates):  # else it has it as is
            self._rates.set(key, *seen)
        if pending is not None:  # the predicted uses due by now happened
            left = tuple(p for p in pending if p[0] > now + p[2] and p[1] >= now)
            if left:
                self._predicted[key] = left
                heapq.heappush(self._overdue, (max(map(overdue_of, left)), key))
            else:
                del self._predicted[key]
        if self._dead:
            self._dead.pop(key, None)  # a closed page used again: the hint was wrong
        if self._expiry:
            exp = self._expiry.get(key)
            if exp is not None and exp <= now:
                del self._expiry[key]
        self._recheck(key)

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        resident = self._resident
        if key in resident:
            self.on_access(key)
            return
        resident.add(key)
        if self._absent:
            self._absent.pop(key, None)
        if self._rate_absent:
            self._rate_absent.pop(key, None)
        if self._once_absent:
            self._once_absent.pop(key, None)
        if len(resident) > self._seen_c:
            self._seen_c = len(resident)
        self._referenced(key)
        self.fallback.on_insert(key, parent)

    def on_access(self, key: PageKey) -> None:
        if key in self._resident:
            self._referenced(key)
            self.fallback.on_access(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._resident:
            return
        self._resident.discard(key)
        self._rates.discard(key)
        self.fallback.on_remove(key)
        self._changed.discard(key)
        if self._fresh_scores:
            self._fresh_scores.pop(key, None)
        self._plain.discard(key)
        self._left_since_ranking += 1
        unforeseen = self._unforeseen
        seen = unforeseen.get(key)
        if seen is not None:
            # a page used more than once keeps its rate longer (a shared prompt comes back)
            many = seen[2] >= 2.0
            absent = self._rate_absent if many else self._once_absent
            absent[key] = None
            limit = (self.rate_history if many else self.history) * max(self._seen_c, 1)
            while len(absent) > limit:
                unforeseen.pop(absent.popitem(last=False)[0], None)
        if (
            key in self._predicted
            or key in self._dead
            or key in self._pinned
            or key in self._weight
            or key in self._expiry
        ):
            self._note_absent(key)

    def _live_prediction(self, key: PageKey) -> float | None:
        """The soonest pending predicted use that is not overdue, if any."""
        pending = self._predicted.get(key)
        if not pending:
            return None
        for at, overdue, _ in pending:
            if overdue >= self.now:
                return at
        return None

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return victims_in_order(self.ordered_keys(evictable), n, evictable)

    def ordered_keys(
        self, evictable: Callable[[PageKey], bool] | None = None
    ) -> Generator[PageKey, None, None]:
        """The held pages, best victim first (see the module docstring), each once, read
        lazily: the forecasts are scored in one pass when the walk reaches them. The
        policy must not change while the order is read (:mod:`kvtier.policy.base`)."""
        done: set[PageKey] = set()

        def usable(key: PageKey) -> bool:
            return (
                key in self._resident and key not in done and (evictable is None or evictable(key))
            )

        pinned = self.honoured_pins()
        now = self.now
        # 1. dead pages: closed, then expired
        for key in [*self._dead, *(k for k, exp in self._expiry.items() if exp <= now)]:
            if key not in pinned and usable(key):
                done.add(key)
                yield key
        weight = self._weight

        # 2. no forecast (kept up to date): the fallback's order, light pages before heavy
        # ones, read only as far as the last of them (``left`` counts them down: a walk may
        # read a few of many), or (a few, and a fallback that can) sorted into it.
        self._catch_up()
        left = len(held := self._plain) - sum(1 for k in {*pinned, *done} if k in held)
        heavy: list[PageKey] = []
        if left:
            sort = getattr(self.fallback, "order_of", None)  # a few pages: sorted, not sought
            if callable(sort) and 4 * left < len(self._resident):
                order: Iterator[PageKey] = iter(sort(held.difference(pinned, done)))
            else:
                order = self._fallback_order(
                    lambda k: k in held and k not in pinned and k not in done
                )
            try:
                for key in order:
                    left -= 1
                    if weight.get(key, 1.0) > 1.0:
                        heavy.append(key)
                    elif usable(key):
                        done.add(key)
                        yield key
                    if not left:
                        break
            finally:
                close_order(order)
        for key in heavy:
            if usable(key):
                done.add(key)
                yield key
        # 3. forecasts, furthest (weighted) first
        for key in self._by_forecast():
            if key not in pinned and usable(key):
                done.add(key)
                yield key
        # 4. pinned pages, only when nothing else is left
        for key in self._fallback_order(usable):
            done.add(key)
            yield key

    def honoured_pins(self) -> set[PageKey] | frozenset[PageKey]:
        """The pinned pages, or none while the held ones fill over ``pin_share`` of it."""
        over = sum(1 for key in self._pinned if key in self._resident) > self.pin_share * self.c
        return frozenset() if over else self._pinned

    def _score(self, key: PageKey) -> float | None:
        """How far off the page's forecast is, divided by its weight (None: no forecast)."""
        at = self.forecast(key)
        return None if at is None else (at - self.now) / self._weight.get(key, 1.0)

    def _by_forecast(self) -> Iterator[PageKey]:
        """The held pages with a forecast, furthest (weighted) first.

        Forecasts move with the clock, so each walk scores the ranking afresh while the
        tier holds at most ``EXACT_RANKING_PAGES`` pages. Above, a walk reuses the last
        ranking, skipping the pages changed since (referenced, hinted, stored), scored once
        per change and merged in; it is rebuilt once ``RANKING_REUSE_SHARE`` of the pages
        changed or left. The cost per evicted page stays bounded on a large tier; the reused
        ranking misses the clock's drift (a prediction now overdue, a rate stretched)."""
        held = len(self._resident)
        ranking: Iterable[tuple[float, PageKey]]
        changed = self._changed
        scores = self._fresh_scores
        fresh: list[tuple[float, PageKey]] = []
        if (
            self._ranking is None
            or held <= EXACT_RANKING_PAGES
            or len(changed) > held * RANKING_REUSE_SHARE
            or self._left_since_ranking > held * RANKING_REUSE_SHARE
        ):
            if self._predicted or self._weight:
                built = [(sc, k) for k in self._resident if (sc := self._score(k)) is not None]
                built.sort(reverse=True)
                ranking = built
            else:  # rate forecasts alone: scored in one vectorised pass, sorted as read
                ranking = self._rates.ranked(self.now)
            if held > EXACT_RANKING_PAGES:
                self._ranking = ranking = list(ranking)
            else:
                self._ranking = None
            self._ranking_head = 0
            self._left_since_ranking = 0
            changed.clear()
            scores.clear()
        else:
            # Entries of pages changed or gone since the build are stale for good: the
            # head skips them once. Changed pages are scored once per change.
            ranking = listed = self._ranking
            head, resident = self._ranking_head, self._resident
            while head < len(listed) and (
                listed[head][1] in changed or listed[head][1] not in resident
            ):
                head += 1
            self._ranking_head = head
            for key in changed:
                if key not in scores:
                    scores[key] = self._score(key)
            fresh = [(sc, k) for k, sc in scores.items() if sc is not None]
            fresh.sort(reverse=True)
        kept = (
            item
            for item in itertools.islice(ranking, self._ranking_head, None)
            if item[1] not in changed
        )
        for _, key in heapq.merge(kept, fresh, reverse=True):
            if key in self._resident and self.forecast(key) is not None:
                yield key

    def _fallback_order(self, accept: Callable[[PageKey], bool]) -> Iterator[PageKey]:
        """The fallback's order over the pages ``accept`` takes (:func:`policy_offers`)."""
        order = iter(policy_offers(self.fallback, accept)(asked := set()))
        try:
            for key in order:
                if key not in asked and accept(key):
                    asked.add(key)
                    yield key
        finally:
            close_order(order)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident
