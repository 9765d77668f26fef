"""``adaptive``: kvtier's default eviction policy. It tunes itself to the traffic it sees.

No classic policy wins on every workload and at every size: LRU-2 is best on small caches
of conversation traffic, ARC or S3-FIFO at medium sizes, LRU when almost everything fits.
This policy covers that range with one bookkeeping and picks the point that fits:

1. **One family, one book.** Pages are *cold* (referenced once within their retained
   history) or *hot* (at least twice); a hot page's eviction score gets a head start of
   ``bonus`` capacities of traffic, on its last reference or on its second most recent
   one (:mod:`kvtier.policy.twoclass`). ``bonus = 0`` is LRU, ``bonus = inf`` with the
   second-most-recent order is LRU-2, and the values between behave like the probation /
   protected splits of ARC and S3-FIFO. The bookkeeping does not depend on the point, so
   moving from one point to another costs nothing.
2. **Miniature caches pick the point.** Each of a few ``points`` (by default LRU, a
   short frequency-weighted head start, a long one and LRU-2), and each of a few
   ``experts`` with their own bookkeeping (by default S3-FIFO and ``interval``, which
   evicts the page whose next use, forecast from the mean interval of its uses, is
   furthest: :mod:`kvtier.policy.interval`; experts that keep time get the policy's
   clock, :meth:`AdaptivePolicy.on_time`), also runs alone in a miniature cache
   (:mod:`kvtier.policy.shadow`): a spatially sampled shadow of ``rate x capacity``
   pages fed with the sampled references. Their exponentially decayed hit counts
   (memory: ``window`` miniature capacities of references) say which does best on this
   traffic now; the tier follows the best (the *leader*), switching only when
   another leads it by ``margin`` of the references seen since the miniatures began to
   evict, plus 4 hits (so noise does not make it thrash). Until then the tier follows
   ``interval`` (LRU-2's order for pages used once, forecasts for the rest), the part
   that is level with or ahead of LRU-2 alone in most cells, so a short trace does not
   pay for a weak start. An expert is fed every event of the tier while another leads,
   but S3-FIFO's queues only take their shape when it chooses; so when an expert that
   offers ``copy_holding`` (:mod:`kvtier.policy.base`) takes the lead and its miniature
   is exact (sample rate 1, tiers up to ``2 x mini_pages`` pages), the tier takes a copy
   of the miniature's policy, holding the tier's pages (those the miniature evicted go
   first once its small queue is down to its share): a *takeover*.
3. **Prefix cuts** (:mod:`kvtier.policy.prefix_cut`): orphans go first and a victim's
   descendants leave before it, deepest first, whatever the point; the miniatures apply
   the same rule, so they measure what the tier really does.
4. **Hints** (:mod:`kvtier.policy.hints`): the first hint adds a ``hinted`` expert
   (:mod:`kvtier.policy.hinted`, engine hints first, LRU-2 for the rest) with its own
   miniature. It takes the lead only after half a window of references since the
   miniatures began to evict, only while its miniature hits more than the leader's by
   five times that margin (plus 16 hits) in the window, and only while it has hit more
   than the leader's since the first hint. The hints themselves are audited
   (:mod:`kvtier.policy.hint_audit`: a ``next_turn`` that came true, a ``close`` of a page
   used again): once 32 were judged and fewer than 80 % came true, the ``hinted`` expert
   neither leads nor stays leader until they improve, so the tier does what it would do
   without hints (exact hints: all true; half of them wrong: 20-50 % true). Pins hold
   whoever leads, as long as the hints are trusted (an engine that sends only pins gives
   the audit nothing to judge, so they hold): the pages the ``hinted`` expert holds
   pinned (while they fill at most its ``pin_share`` of the tier) come last in the
   tier's order.

Nothing is tied to a trace: the points, the experts and four numbers are the whole
configuration; they were chosen on half of kvtier's workloads and seeds and checked on
the other half, on fresh seeds, on traffic whose popularity moves and on five more mixes
(docs/benchmarks.md, "Policy suite"), where the policy is ahead of the best classic
policy in 33 of 44 held-out, 27 of 40 fresh, 9 of 16 shifts and 30 of 40 mixes cells,
level in 6, 3, 1 and 1, and behind by at most 0.0049 in the rest, except ARC's lead on
tenants active in turn at 25 % (0.0075 and 0.0106), while each classic policy is 0.04 to
0.12 behind somewhere. On short sessions behind one shared prompt (outside the suite)
it is within 0.0008 of LRU, which equals MIN there from 30 % capacity.

``capacity`` is the tier's size in pages when known, else the most pages held at once.
Miniatures hold every sampled page until the tier first evicts, then ``rate x capacity``
pages. The rate halves whenever a miniature would pass ``2 x mini_pages`` (8,192 pages by
default; below, miniatures are exact replays), and a page that leaves the sample strands
none of its children there. Sampled miniatures estimate block hits, which narrows the gaps
between points in prefix hit rate, so they pick less surely. Everything is deterministic
(hash sampling, no Python ``hash``): the live pipeline and the replay make the same
decisions given the same clock (``interval`` and ``hinted`` forecast by time: the
replay's timestamps, a live cache's ``time.monotonic()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy, copy_holding_of, pins_last, victims_in_order
from kvtier.policy.eviction import LRUPolicy
from kvtier.policy.hint_audit import HintAudit
from kvtier.policy.hints import Hint, HintAware, hint_target, sub_hint
from kvtier.policy.prefix_cut import PageForest, PrefixCutPolicy, policy_offers
from kvtier.policy.shadow import _FULL, KeySampler, MiniCache, RecentPins, key_hash
from kvtier.policy.twoclass import TwoClassBook, TwoClassPolicy, check_two_class

#: The points of the family the miniatures compare, as ``"bonus:order"``: LRU, a short
#: frequency-weighted head start, a long one, and LRU-2.
DEFAULT_POINTS: tuple[str, ...] = ("0:last", "1:freq", "16:last", "inf:kth")
#: The experts run beside the points by default, each with its own bookkeeping.
DEFAULT_EXPERTS: tuple[str, ...] = ("s3-fifo", "interval")

#: The ``hinted`` expert may not lead once ``TRUST_JUDGED`` hints were judged and fewer
#: than this share came true (:mod:`kvtier.policy.hint_audit`; exact hints: 1.0, half of
#: them wrong: 0.2-0.5 on the session generators).
TRUST_ACCURACY = 0.8
TRUST_JUDGED = 32

_UNBOUNDED = float(1 << 62)  # a miniature's capacity before the tier first evicts


def _expert(name: str) -> EvictionPolicy:
    from kvtier.policy.eviction import make_policy

    if name in ("adaptive", "hinted"):
        raise ConfigError(f"adaptive: {name!r} cannot be an expert here")
    try:
        return make_policy(name)
    except ConfigError as exc:
        raise ConfigError(f"adaptive: experts: {exc}") from None


def point_policy(bonus: float, order: str, history: float) -> EvictionPolicy:
    """A point of the family alone (for its miniature). With no head start (``bonus``
    0) and an order by last reference (``last``, ``freq``) every page's score is its last
    reference, a unique tick: that is LRU's order exactly, kept without the book."""
    if bonus == 0 and order != "kth":
        return LRUPolicy()
    return TwoClassPolicy(bonus, order, history)


def _points(points: Sequence[str]) -> list[tuple[float, str]]:
    out = []
    for p in points:
        b, _, o = str(p).partition(":")
        try:
            bonus = float(b)
        except ValueError:
            raise ConfigError(f"adaptive: bad point {p!r}: use 'bonus:order'") from None
        check_two_class(bonus, o, 8.0, None, owner=f"adaptive: point {p!r}")
        out.append((bonus, o))
    if len(set(out)) != len(out):
        raise ConfigError(f"adaptive: points repeat: {list(points)}")
    return out


class AdaptivePolicy(EvictionPolicy):
    """Two-class recency tuned online by miniature caches, with prefix cuts and hints."""

    name: ClassVar[str] = "adaptive"

    def __init__(
        self,
        points: Sequence[str] = DEFAULT_POINTS,
        experts: Sequence[str] = DEFAULT_EXPERTS,
        history: float = 8.0,
        capacity: int | None = None,
        mini_pages: int = 4096,
        window: float = 16.0,
        margin: float = 0.002,
        start: str | None = None,
    ) -> None:
        """``points``: the family's points, ``"bonus:order"`` (see
        :mod:`kvtier.policy.twoclass`; ``"inf:kth"`` is LRU-2). ``experts``: registered
        policies run beside the family with their own bookkeeping (each costs one more
        policy's work and one more miniature). ``history``: capacities of evicted pages
        whose references are remembered. ``mini_pages``, ``window``, ``margin``: see the
        module docstring. ``start``: the point or expert followed until the miniatures have
        evicted anything and shown a lead; by default ``interval`` (LRU-2's order for pages
        used once, forecasts for the rest: level with or ahead of LRU-2 alone in most suite
        cells), else LRU-2 when ``interval`` is not an expert. Raises :class:`ConfigError`
        for a bad value, naming it."""
        if isinstance(points, str) or not isinstance(points, Sequence) or not points:
            raise ConfigError(f"adaptive: points must be a list of 'bonus:order', got {points!r}")
        check_two_class(0.0, "last", history, capacity, owner="adaptive")
        if isinstance(mini_pages, bool) or not isinstance(mini_pages, int) or mini_pages < 16:
            raise ConfigError(f"adaptive: mini_pages must be an integer >= 16, got {mini_pages!r}")
        if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
            raise ConfigError(f"adaptive: window must be > 0, got {window!r}")
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not margin >= 0:
            raise ConfigError(f"adaptive: margin must be >= 0, got {margin!r}")
        self.grid = _points(points)
        self.history = float(history)
        self.book = TwoClassBook(self.history, capacity)
        self.forest = PageForest()
        self.sampler = KeySampler()
        #: The recent references the miniatures may not evict, kept once for all of them.
        self.pins = RecentPins()
        self._tier_full = False  # whether the tier has evicted (asked for its order) yet
        self.minis = [
            MiniCache(PrefixCutPolicy(point_policy(b, o, self.history)), pins=self.pins)
            for b, o in self.grid
        ]
        self.names = [f"two-class(bonus={b:g},order={o})" for b, o in self.grid]
        if isinstance(experts, str) or not isinstance(experts, Sequence):
            raise ConfigError(f"adaptive: experts must be a list of names, got {experts!r}")
        if len({str(e) for e in experts}) != len(experts):
            raise ConfigError(f"adaptive: experts repeat: {list(experts)}")
        #: Experts with their own bookkeeping, by position in ``minis`` / ``names``.
        self.experts: dict[int, EvictionPolicy] = {}
        #: ``experts.values()``, kept as a list for the per-page hooks.
        self._expert_list: list[EvictionPolicy] = []
        #: The experts and miniature policies that keep time.
        self._clocked: list[HintAware] = []
        self._now = 0.0
        for name in experts:
            self._add_expert(str(name), _expert(str(name)), _expert(str(name)))
        self.mini_pages = mini_pages
        self.window = float(window)
        self.margin = float(margin)
        # The leader until the miniatures tell.
        self.leader = self._start_index(start)
        self.switches = 0
        #: Switches on which an expert took over its miniature's state (see the module
        #: docstring).
        self.takeovers = 0
        self._since_check = 0
        self._refs_decayed = 0.0
        self._hinted: EvictionPolicy | None = None
        self._hinted_at = -1
        self._hits_at_hints: list[int] = []
        #: How often the hints came true (made on the first hint).
        self.audit: HintAudit | None = None

    def _start_index(self, start: str | None) -> int:
        """The position of ``start`` (one of the points or the experts) in ``minis``; for
        ``None``, of ``interval`` if it is an expert, else of LRU-2 (``inf:kth``) if it is
        a point, else of the last point."""
        experts = self.names[len(self.grid) :]
        if start is None:
            if "interval" in experts:
                return self.names.index("interval")
            lru2 = (math.inf, "kth")
            return self.grid.index(lru2) if lru2 in self.grid else len(self.grid) - 1
        start = str(start)
        if start in experts:
            return self.names.index(start)
        if ":" in start:
            first = _points([start])[0]
            if first in self.grid:
                return self.grid.index(first)
        points = [f"{b:g}:{o}" for b, o in self.grid]
        raise ConfigError(
            f"adaptive: start {start!r} is neither one of the points {points} "
            f"nor one of the experts {experts}"
        )

    @property
    def c(self) -> int:
        """The capacity in pages (given, or the most pages held at once)."""
        return self.book.c

    # -- the miniatures ----------------------------------------------------------------

    def _mini_capacity(self) -> float:
        """``rate x c`` once the tier has evicted; before, unbounded (as the tier is)."""
        return self.sampler.rate * self.c if self._tier_full else _UNBOUNDED

    def _resize(self) -> None:
        c = self.c
        while self.sampler.rate * c > 2 * self.mini_pages:
            self.sampler.halve()
            for m in self.minis:
                m.drop(self.sampler.keeps)
        cap = self._mini_capacity()
        for m in self.minis:
            if cap < m.capacity:
                m.shrink_to(int(cap))
            m.capacity = cap

    def _reference(self, key: PageKey, parent: PageKey | None) -> None:
        sampler = self.sampler
        if sampler.threshold < _FULL and key_hash(key) >= sampler.threshold:
            return  # not in the sample (``sampler.keeps``)
        book = self.book
        c = book._fixed_c or max(book._seen_c, 1)  # self.c
        cap = sampler.rate * c
        if cap < 1.0:
            cap = 1.0
        decay = 1.0 - 1.0 / (self.window * cap)
        minis = self.minis
        self.pins.push(key, minis[0].capacity)
        for m in minis:
            m.reference(key, parent, decay)
        if minis[0].evicted:  # scores only differ from the first eviction on
            self._refs_decayed = self._refs_decayed * decay + 1.0
        self._since_check += 1
        if self._since_check >= 32:
            self._since_check = 0
            self._choose()

    def _choose(self) -> None:
        scores = [m.score for m in self.minis]
        choices: Sequence[int] = range(len(scores))
        if self._hinted_at >= 0 and not self._hints_trusted():
            # hints that came true too rarely: their expert neither leads nor stays leader
            choices = [i for i in choices if i != self._hinted_at]
            if self.leader == self._hinted_at:
                self._follow(max(choices, key=scores.__getitem__))
                return
        best = max(choices, key=scores.__getitem__)
        lead = scores[best] - scores[self.leader]
        # Hints must prove themselves more: the hinted expert takes the lead only after half
        # a window of evictions, with five times the margin and 16 hits, and only while its
        # miniature has hit more than the leader's since the first hint (exact hints win by
        # far more; wrong ones may lead a window, but not the whole run).
        if best == self._hinted_at:
            window = self.window * max(self.sampler.rate * self.c, 1.0)
            ahead = self._hits_since_hints(best) > self._hits_since_hints(self.leader)
            proven = ahead and self._refs_decayed >= 0.5 * window
            need = 5.0 * self.margin * self._refs_decayed + 16.0 if proven else math.inf
        else:
            need = self.margin * self._refs_decayed + 4.0
        if best != self.leader and lead > need:
            self._follow(best)

    def follow(self, part: str) -> None:
        """Follow ``part`` from now on, as a switch to it would (an expert may take over,
        see the module docstring): one of the points as ``"bonus:order"`` or an expert's
        name, as for ``start``. The miniatures may choose another part at their next
        check. Raises :class:`ConfigError` naming the parts for an unknown one."""
        self._follow(self._start_index(str(part)))

    def _follow(self, i: int) -> None:
        """Make ``minis[i]``'s point or expert the leader. An expert that offers
        ``copy_holding`` takes over its miniature's state when that miniature is exact
        (sample rate 1: it saw every reference, so its policy is the expert as if it had
        chosen all along), given the tier's pages oldest first."""
        self.leader = i
        self.switches += 1
        if i not in self.experts or self.sampler.rate < 1.0:
            return
        mini_policy = self.minis[i].policy
        alone = getattr(mini_policy, "inner", mini_policy)  # inside its prefix cuts
        copied = copy_holding_of(alone, self._oldest_first())
        if copied is None:
            return
        old_clock, new_clock = hint_target(self.experts[i]), hint_target(copied)
        self._clocked = [t for t in self._clocked if t is not old_clock]
        if new_clock is not None:
            new_clock.on_time(self._now)
            self._clocked.append(new_clock)
        self.experts[i] = copied
        self._expert_list = list(self.experts.values())
        self.takeovers += 1

    def _oldest_first(self) -> Generator[PageKey, None, None]:
        """The tier's pages by last reference, oldest first (sorted only once read)."""
        refs = self.book.refs
        yield from sorted(self.book.resident, key=lambda k: refs[k][2])

    def _hints_trusted(self) -> bool:
        """Whether the hints may be followed: not once ``TRUST_JUDGED`` of them were
        judged and fewer than ``TRUST_ACCURACY`` (decayed) came true."""
        audit = self.audit
        return audit is None or audit.judged < TRUST_JUDGED or audit.accuracy >= TRUST_ACCURACY

    def _hits_since_hints(self, i: int) -> int:
        """Miniature ``i``'s hits since the ``hinted`` expert was added."""
        return self.minis[i].hits - self._hits_at_hints[i]

    def _add_expert(self, name: str, expert: EvictionPolicy, mini: EvictionPolicy) -> None:
        """Run ``expert`` on the tier's pages and ``mini`` (a fresh one of its kind) in a
        miniature; the expert learns the pages held now in the order they came."""
        for key, parent in self.forest.parent.items():
            expert.on_insert(key, parent)
        self.minis.append(MiniCache(PrefixCutPolicy(mini), self._mini_capacity(), pins=self.pins))
        for policy in (expert, mini):
            target = hint_target(policy)
            if target is not None:
                target.on_time(self._now)
                self._clocked.append(target)
        self.names.append(name)
        self.experts[len(self.minis) - 1] = expert
        self._expert_list = list(self.experts.values())

    # -- hints ---------------------------------------------------------------------------

    def _add_hinted(self) -> EvictionPolicy:
        """The ``hinted`` expert (on the first hint): it learns the pages held now in the
        order they came; its miniature starts empty, so it leads only once it has proved
        better on the traffic since."""
        from kvtier.policy.hinted import HintedPolicy

        expert = HintedPolicy()
        self._add_expert("hinted", expert, HintedPolicy())
        self._hinted_at = len(self.minis) - 1
        self._hinted = expert
        self._hits_at_hints = [m.hits for m in self.minis]
        return expert

    def on_time(self, now_s: float) -> None:
        """The clock (trace time in replay, ``time.monotonic()`` live), passed on to the
        experts that keep time (``interval``, ``hinted``) and their miniatures."""
        self._now = max(self._now, now_s)
        for target in self._clocked:
            target.on_time(now_s)

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """Give ``hint`` to the hint-driven expert (created on the first hint) and, for
        the sampled pages, to its miniature."""
        expert = self._hinted if self._hinted is not None else self._add_hinted()
        self.on_time(now_s)
        if hint.kind == "close":  # a session's close says nothing of prefixes others continue
            hint = sub_hint(hint, self.forest.own_pages(hint.keys))
        if self.audit is None:
            self.audit = HintAudit(self.history)
        self.audit.hint(hint, self._now, self.c, self.book.resident)
        target = hint_target(expert)
        if target is not None:
            target.on_hint(hint, now_s)
        sampled = self.sampler.sample(hint.keys)
        if sampled or not hint.keys:
            mini_target = hint_target(self.minis[self._hinted_at].policy)
            if mini_target is not None:
                mini_target.on_hint(sub_hint(hint, sampled), now_s)

    # -- the EvictionPolicy hooks ------------------------------------------------------

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        book = self.book
        if key in book.resident:
            self.on_access(key)
            return
        before = book._seen_c  # ``c`` is max(_seen_c, 1), which grows by 1 at most
        book.insert(key)
        self.forest.add(key, parent)
        if self.audit is not None:
            self.audit.referenced(key, self._now)
        for expert in self._expert_list:
            expert.on_insert(key, parent)
        grew = before >= 1 and book._seen_c != before and not book._fixed_c  # ``c`` moved
        if grew or not self.minis[0].capacity:
            self._resize()
        self._reference(key, parent)

    def on_access(self, key: PageKey) -> None:
        book = self.book
        if key not in book.resident:
            return
        book._touch(key)  # book.access
        self.forest.orphans.pop(key, None)  # forest.touch
        if self.audit is not None:
            self.audit.referenced(key, self._now)
        for expert in self._expert_list:
            expert.on_access(key)
        self._reference(key, None)

    def on_remove(self, key: PageKey) -> None:
        if key not in self.book.resident:
            return
        self.book.remove(key)
        self.forest.remove(key)
        if self.audit is not None:
            self.audit.forget(key)
        for expert in self._expert_list:
            expert.on_remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return victims_in_order(self.ordered_keys(evictable), n, evictable)

    def ordered_keys(
        self, evictable: Callable[[PageKey], bool] | None = None
    ) -> Generator[PageKey, None, None]:
        """The tier's whole preference order, read lazily: prefix cuts over the leader's
        order (a point's two-class order, or an expert asked page by page; see
        :mod:`kvtier.policy.base`). The engine's pins hold whoever leads while its hints
        are trusted: the pages the ``hinted`` expert holds pinned (its ``pin_share`` bound
        included) come last."""
        if not self._tier_full:  # the tier's first eviction: the miniatures get bounded
            self._tier_full = True
            self._resize()
        expert = self.experts.get(self.leader)
        if expert is not None:
            order = self.forest.order(policy_offers(expert, evictable), evictable)
        else:
            bonus, kind = self.grid[self.leader]
            order = self.forest.order(lambda _done: self.book.ordered(bonus, kind), evictable)
        pins = getattr(self._hinted, "honoured_pins", None)
        pinned = pins() if callable(pins) and self._hints_trusted() else None
        return pins_last(order, pinned) if pinned else order

    def describe(self) -> dict[str, Any]:
        """The leader, how often it changed (and how often an expert took over its
        miniature's state), the sampling rate and every point's miniature hit ratio."""
        return {
            "leader": self.names[self.leader],
            "switches": self.switches,
            "takeovers": self.takeovers,
            "sample_rate": self.sampler.rate,
            **(
                {"hint_accuracy": self.audit.accuracy, "hints_judged": self.audit.judged}
                if self.audit is not None
                else {}
            ),
            "mini_hit_ratio": {
                n: (m.hits / m.refs if m.refs else 0.0)
                for n, m in zip(self.names, self.minis, strict=True)
            },
        }

    def __len__(self) -> int:
        return len(self.book.resident)

    def __contains__(self, key: object) -> bool:
        return key in self.book.resident
