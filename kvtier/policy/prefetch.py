"""Prefetch predictors: which pages to pull up before they are needed.

* :class:`LookaheadPredictor` - the source article's lookahead predictor (section 6.2),
  as kvtier reads it: after a sequence used pages ``..., x``, the pages that followed
  ``x`` before are scored by how often they followed it, each step further ahead weighted
  by ``decay`` (up to ``lookahead`` steps); pages scoring at least ``threshold`` are
  prefetched, best first.
* :class:`PrefixPredictor` - prefix-driven: when a request arrives, its cached prefix is
  pulled up tier by tier in order (the pipeline does this on arrival; the predictor just
  returns the request's own pages in prefix order).

Predictors only name pages; the pipeline (live) or the replay (offline) moves them, with
deadlines, and reports what arrived in time.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtier.errors import ConfigError
from kvtier.keys import PageKey

#: The predictors a live cache can run (``KVCache(predictor=...)``, config
#: ``observe.predictor``): the request's own cached prefix, the lookahead, or both.
LIVE_PREDICTORS: tuple[str, ...] = ("prefix", "lookahead", "prefix+lookahead")


class LookaheadPredictor:
    """Successor statistics with a decaying lookahead window.

    Bounded: at most ``memory`` pages have statistics (least recently seen dropped
    first), each keeps at most ``max_successors`` successors (when a new one arrives at
    a full page, the counts are halved and those at zero dropped, then the rarest if it
    is still full), and a prediction follows at most ``max_frontier`` pages per level
    (the likeliest). Before, a page every session starts with (a shared system prompt)
    kept one successor per session ever seen, and every lookup walked them all: 20x
    slower after 6,000 sessions, 30x after 14,000.
    """

    def __init__(
        self,
        lookahead: int = 4,
        decay: float = 0.5,
        threshold: float = 0.5,
        max_pages: int = 64,
        memory: int = 1 << 18,
        max_successors: int = 32,
        max_frontier: int = 64,
    ) -> None:
        if lookahead < 1:
            raise ConfigError(f"lookahead must be >= 1, got {lookahead}")
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"decay must lie in (0, 1], got {decay}")
        if max_successors < 1 or max_frontier < 1:
            raise ConfigError(
                f"max_successors and max_frontier must be >= 1, got {max_successors} and "
                f"{max_frontier}"
            )
        self.lookahead = lookahead
        self.decay = decay
        self.threshold = threshold
        self.max_pages = max_pages
        self.memory = memory
        self.max_successors = max_successors
        self.max_frontier = max_frontier
        self._next: OrderedDict[PageKey, Counter[PageKey]] = OrderedDict()

    def observe(self, blocks: Sequence[PageKey]) -> None:
        """Learn the successor of every page of a used sequence."""
        for a, b in itertools.pairwise(blocks):
            succ = self._next.get(a)
            if succ is None:
                succ = self._next[a] = Counter()
            else:
                self._next.move_to_end(a)
            if b not in succ and len(succ) >= self.max_successors:
                self._make_room(succ)
            succ[b] += 1
        while len(self._next) > self.memory:
            self._next.popitem(last=False)

    def _make_room(self, succ: Counter[PageKey]) -> None:
        """Room for one more successor: halve the counts (dropping those at zero), then,
        if none reached zero, drop the rarest."""
        for k in list(succ):
            succ[k] //= 2
            if not succ[k]:
                del succ[k]
        if len(succ) >= self.max_successors:
            del succ[min(succ, key=succ.__getitem__)]

    def predict(self, blocks: Sequence[PageKey]) -> list[PageKey]:
        """Pages likely to follow the last page of ``blocks``, best first."""
        if not blocks:
            return []
        scores: dict[PageKey, float] = {}
        frontier: dict[PageKey, float] = {blocks[-1]: 1.0}
        weight = 1.0
        for _ in range(self.lookahead):
            nxt: dict[PageKey, float] = {}
            for page, p in frontier.items():
                succ = self._next.get(page)
                if not succ:
                    continue
                total = sum(succ.values())
                for s, c in succ.items():
                    q = p * c / total
                    nxt[s] = nxt.get(s, 0.0) + q
                    scores[s] = scores.get(s, 0.0) + weight * q
            if len(nxt) > self.max_frontier:
                nxt = dict(sorted(nxt.items(), key=lambda kv: -kv[1])[: self.max_frontier])
            frontier = nxt
            weight *= self.decay
            if not frontier:
                break
        ranked = sorted(
            (k for k, v in scores.items() if v >= self.threshold), key=lambda k: -scores[k]
        )
        return ranked[: self.max_pages]


class PrefixPredictor:
    """On a request's arrival, its own pages in prefix order (the cached ones get pulled
    up tier by tier; the rest are misses the engine computes)."""

    def observe(self, blocks: Sequence[PageKey]) -> None:
        """Nothing to learn."""

    def predict(self, blocks: Sequence[PageKey]) -> list[PageKey]:
        """``blocks`` in order."""
        return list(blocks)
