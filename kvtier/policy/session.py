"""``session``: kvtier's own eviction policy, aimed at the gap between LRU and MIN.

Facts of multi-turn LLM traffic drive it (none is tied to a trace's ids):

1. Only prefixes are reused, so a page without its parent is worthless: like
   :mod:`~kvtier.policy.prefix_aware` it evicts *leaves* only, and a cold sequence leaves
   as a unit, from its end back to the first page it shares with another sequence.
2. Most pages are never reused, and whether one will be depends on what kind of sequence
   it belongs to. Each page gets a *class* when it is inserted: its session's *turn*
   (a page inserted under a parent that was reused starts a new turn, ``turn(parent) +
   1``; under a fresh parent it inherits the turn), capped at ``max_turn``, and the
   log2 bucket of its depth in the sequence (long prompts are reused less often per
   page). The policy learns online, per class, the share of pages that were reused at
   least once: ``p(class)``. Sessions that came back tend to come back again.
3. When a session continues from a page on a new branch, the leaves it left under that
   page (typically the partial last page of the previous prompt, or an abandoned
   regeneration) are *superseded*: they go first.
4. Return gaps are heavy-tailed: a session silent for long is unlikely to return soon.
   With a Lomax gap law of scale ``tau`` (learned online as the geometric mean of the
   observed reuse ages, in page events) the chance that a page of reuse probability
   ``p`` and age ``a`` is reused in the next instant is
   ``p*tau / ((a+tau) * ((1-p)*(a+tau) + p*tau))``: the eviction score.

Victims are chosen by sampling ``samples`` leaves (a seeded generator, so runs repeat),
evicting the lowest score and walking up its chain. Recently evicted keys are remembered
(ghosts, at most ``ghost_factor`` times the pages tracked) so that a page recomputed
after eviction counts as a reuse and keeps its turn. Time is counted in page events
(inserts + accesses), so the policy does not depend on wall-clock rates.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar, NamedTuple

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy

_DEPTH_BUCKETS = 8


class _Ghost(NamedTuple):
    turn: int
    last: int
    depth: int
    cls: int


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"session: {name} must be an integer >= 1, got {value!r}")
    return value


class SessionPolicy(EvictionPolicy):
    """Leaf-first eviction scored by learned per-class reuse odds and age."""

    name: ClassVar[str] = "session"

    def __init__(
        self, samples: int = 64, max_turn: int = 4, ghost_factor: int = 8, seed: int = 0
    ) -> None:
        self.samples = _positive_int("samples", samples)
        self.max_turn = _positive_int("max_turn", max_turn)
        self.ghost_factor = _positive_int("ghost_factor", ghost_factor)
        self._rng = random.Random(seed)
        self._clock = 0
        self._parent: dict[PageKey, PageKey | None] = {}
        self._kids: dict[PageKey, set[PageKey]] = {}
        self._last: dict[PageKey, int] = {}
        self._turn: dict[PageKey, int] = {}
        self._depth: dict[PageKey, int] = {}
        self._cls: dict[PageKey, int] = {}
        self._reused: set[PageKey] = set()  # reused since the last continuation from it
        self._hit: set[PageKey] = set()  # reused at least once since insert
        self._superseded: set[PageKey] = set()
        self._leaves: list[PageKey] = []
        self._leaf_pos: dict[PageKey, int] = {}
        self._ghost: OrderedDict[PageKey, _Ghost] = OrderedDict()
        n_cls = (self.max_turn + 1) * _DEPTH_BUCKETS
        self._inserted = [2.0] * n_cls  # pages inserted per class (prior 2)
        self._reuses = [1.0] * n_cls  # of which reused (prior 1: p starts at 0.5)
        self._log_tau = math.log(1024.0)

    # -- learned quantities -------------------------------------------------------------
    def class_of(self, turn: int, depth: int) -> int:
        """Class index of a page at ``turn`` and ``depth``."""
        bucket = min(depth.bit_length(), _DEPTH_BUCKETS - 1)
        return min(turn, self.max_turn) * _DEPTH_BUCKETS + bucket

    def reuse_probability(self, turn: int, depth: int = 0) -> float:
        """Learned probability that a page of this class is reused."""
        c = self.class_of(turn, depth)
        return self._reuses[c] / self._inserted[c]

    @property
    def tau(self) -> float:
        """Learned scale of reuse ages, in page events."""
        return math.exp(self._log_tau)

    def score(self, key: PageKey) -> float:
        """Instantaneous reuse rate of ``key`` (lower = better victim; superseded < 0)."""
        if key in self._superseded:
            return -1.0
        c = self._cls[key]
        p = self._reuses[c] / self._inserted[c]
        tau = self.tau
        a = float(self._clock - self._last[key]) + tau
        return p * tau / (a * ((1.0 - p) * a + p * tau))

    def _learn_age(self, age: int) -> None:
        if age > 1:
            self._log_tau += 0.001 * (math.log(age) - self._log_tau)

    def _note_reuse(self, key: PageKey, cls: int) -> None:
        if key not in self._hit:
            self._hit.add(key)
            self._reuses[cls] += 1

    # -- leaves -------------------------------------------------------------------------
    def _add_leaf(self, key: PageKey) -> None:
        if key not in self._leaf_pos:
            self._leaf_pos[key] = len(self._leaves)
            self._leaves.append(key)

    def _drop_leaf(self, key: PageKey) -> None:
        pos = self._leaf_pos.pop(key, None)
        if pos is None:
            return
        last = self._leaves.pop()
        if last != key:
            self._leaves[pos] = last
            self._leaf_pos[last] = pos

    # -- interface ----------------------------------------------------------------------
    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._parent:
            self.on_access(key)
            return
        self._clock += 1
        if parent is not None and parent not in self._parent:
            parent = None
        ghost = self._ghost.pop(key, None)
        continued = False
        if ghost is not None:  # recomputed after eviction: a reuse of this page
            turn, depth, cls = ghost.turn, ghost.depth, ghost.cls
            self._learn_age(self._clock - ghost.last)
            self._inserted[cls] += 1
            self._note_reuse(key, cls)
            self._reused.add(key)
        else:
            if parent is None:
                turn, depth = 0, 0
            elif parent in self._reused:
                turn, depth = self._turn[parent] + 1, self._depth[parent] + 1
                continued = True
            else:
                turn, depth = self._turn[parent], self._depth[parent] + 1
            cls = self.class_of(turn, depth)
            self._inserted[cls] += 1
        self._parent[key] = parent
        self._kids[key] = set()
        self._last[key] = self._clock
        self._turn[key] = turn
        self._depth[key] = depth
        self._cls[key] = cls
        self._add_leaf(key)
        if parent is not None:
            siblings = self._kids[parent]
            if continued:
                # A new branch from a reused page: leaves left under it are superseded.
                self._superseded.update(s for s in siblings if not self._kids.get(s, True))
                self._reused.discard(parent)
            siblings.add(key)
            self._drop_leaf(parent)
            self._last[parent] = self._clock

    def on_access(self, key: PageKey) -> None:
        last = self._last.get(key)
        if last is None:
            return
        self._clock += 1
        if key not in self._reused:
            self._learn_age(self._clock - last)
        self._note_reuse(key, self._cls[key])
        self._last[key] = self._clock
        self._reused.add(key)
        self._superseded.discard(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        for kid in self._kids.pop(key, ()):  # orphans (removed out of order) become roots
            if kid in self._parent:
                self._parent[kid] = None
        self._reused.discard(key)
        self._hit.discard(key)
        self._superseded.discard(key)
        self._ghost[key] = _Ghost(
            self._turn.pop(key), self._last.pop(key), self._depth.pop(key), self._cls.pop(key)
        )
        while len(self._ghost) > self.ghost_factor * max(len(self._parent), 1):
            self._ghost.popitem(last=False)
        self._drop_leaf(key)
        if parent is not None and parent in self._kids:
            kids = self._kids[parent]
            kids.discard(key)
            if not kids:
                self._add_leaf(parent)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        pending: dict[PageKey, int] = {}
        leaves = self._leaves
        misses = 0
        while len(out) < n and leaves and misses < 4:
            best: PageKey | None = None
            best_score = math.inf
            for _ in range(min(self.samples, len(leaves))):
                k = leaves[self._rng.randrange(len(leaves))]
                if k in chosen or not evictable(k):
                    continue
                s = self.score(k)
                if s < best_score:
                    best, best_score = k, s
            if best is None:
                misses += 1
                continue
            key: PageKey | None = best
            while key is not None and len(out) < n:
                if key in chosen or not evictable(key):
                    break
                out.append(key)
                chosen.add(key)
                parent = self._parent.get(key)
                if parent is None:
                    break
                left = pending.get(parent, len(self._kids[parent])) - 1
                pending[parent] = left
                key = parent if left == 0 else None
        if len(out) < n:  # sampling found too few: fall back to a full scan
            for k in list(leaves):
                if len(out) >= n:
                    break
                if k not in chosen and evictable(k):
                    out.append(k)
                    chosen.add(k)
        return out

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent
