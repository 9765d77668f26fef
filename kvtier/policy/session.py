"""``session``: kvtier's own policy, aimed at the gap between LRU and Belady's MIN.

Three facts of real multi-turn LLM traffic drive it (none is tied to a trace's ids):

1. Only prefixes are reused, so a page without its parent is worthless: like
   :mod:`~kvtier.policy.prefix_aware` it evicts leaves only, and a cold sequence leaves
   as a unit, from its end back to the first page it shares with another sequence.
2. Most pages are never reused, but sessions that already came back come back again:
   the probability that a conversation continues grows with the number of turns it has
   had (a Lindy effect). Each page carries a *turn*: a page inserted under a parent that
   was just reused (hit, or recomputed after eviction) starts a new turn, ``turn(parent)
   + 1``; pages inserted under a fresh parent inherit its turn. The policy learns online,
   per turn (capped at ``max_turn``), the share of turns that were continued: ``p(turn)``.
3. Return gaps are heavy-tailed: a session silent for long is unlikely to return soon.
   With a Lomax gap law of scale ``tau`` (learned online as the geometric mean of observed
   reuse ages, in page events) the chance that a session of continuation probability
   ``p`` and age ``a`` returns in the next instant is
   ``p*tau / ((a+tau) * ((1-p)*(a+tau) + p*tau))``: the eviction score.

Victims are chosen by sampling ``samples`` leaves (a seeded generator, so runs repeat) and
evicting the lowest score, walking up its chain. Recently evicted keys are remembered
(ghosts, at most as many as pages tracked) so that a session recomputed after eviction
keeps its turn count. Time is counted in page events (inserts + accesses), which makes the
policy independent of wall-clock rates.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy


class SessionPolicy(EvictionPolicy):
    """Leaf-first eviction scored by learned session-continuation odds and age."""

    name: ClassVar[str] = "session"

    def __init__(
        self, samples: int = 16, max_turn: int = 8, ghost_factor: int = 8, seed: int = 0
    ) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"session: samples must be an integer >= 1, got {samples!r}")
        if isinstance(max_turn, bool) or not isinstance(max_turn, int) or max_turn < 1:
            raise ConfigError(f"session: max_turn must be an integer >= 1, got {max_turn!r}")
        self.samples = samples
        self.max_turn = max_turn
        self.ghost_factor = ghost_factor
        self._rng = random.Random(seed)
        self._clock = 0
        self._parent: dict[PageKey, PageKey | None] = {}
        self._children: dict[PageKey, int] = {}
        self._last: dict[PageKey, int] = {}
        self._turn: dict[PageKey, int] = {}
        self._reused: set[PageKey] = set()  # accessed since insert: a child starts a turn
        self._leaves: list[PageKey] = []
        self._leaf_pos: dict[PageKey, int] = {}
        self._ghost: OrderedDict[PageKey, tuple[int, int]] = OrderedDict()  # key -> (turn, last)
        self._starts = [1.0] * (max_turn + 1)  # turns started, per turn (prior 1)
        self._continued = [0.5] * (max_turn + 1)  # of which continued (prior 0.5)
        self._log_tau = math.log(1024.0)

    # -- learned quantities -------------------------------------------------------------
    def continuation(self, turn: int) -> float:
        """Learned probability that a session at ``turn`` continues."""
        t = min(turn, self.max_turn)
        return self._continued[t] / self._starts[t]

    @property
    def tau(self) -> float:
        """Learned scale of reuse ages, in page events."""
        return math.exp(self._log_tau)

    def score(self, key: PageKey) -> float:
        """Instantaneous return rate of ``key``'s session (lower = better victim)."""
        p = self.continuation(self._turn[key])
        tau = self.tau
        a = float(self._clock - self._last[key]) + tau
        return p * tau / (a * ((1.0 - p) * a + p * tau))

    def _learn_age(self, age: int) -> None:
        if age > 1:
            self._log_tau += 0.001 * (math.log(age) - self._log_tau)

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
        ghost = self._ghost.pop(key, None)
        ghost_turn = None
        if ghost is not None:
            ghost_turn = ghost[0]
            self._learn_age(self._clock - ghost[1])
        if parent is not None and parent not in self._parent:
            parent = None
        if ghost_turn is not None:
            turn = ghost_turn  # recomputed after eviction: a reuse of this page
            self._reused.add(key)
        elif parent is None:
            turn = 0
            self._starts[0] += 1
        elif parent in self._reused:
            turn = self._turn[parent] + 1
            t_prev = min(self._turn[parent], self.max_turn)
            self._continued[t_prev] += 1
            self._starts[min(turn, self.max_turn)] += 1
            self._reused.discard(parent)  # one continuation per reuse
        else:
            turn = self._turn[parent]
        self._parent[key] = parent
        self._children[key] = 0
        self._last[key] = self._clock
        self._turn[key] = turn
        self._add_leaf(key)
        if parent is not None:
            self._children[parent] += 1
            self._drop_leaf(parent)
            self._last[parent] = self._clock

    def on_access(self, key: PageKey) -> None:
        last = self._last.get(key)
        if last is None:
            return
        self._clock += 1
        if key not in self._reused:  # first reuse since the last turn: one sample
            self._learn_age(self._clock - last)
        self._last[key] = self._clock
        self._reused.add(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        self._children.pop(key, None)
        self._reused.discard(key)
        self._ghost[key] = (self._turn.pop(key), self._last.pop(key))
        while len(self._ghost) > self.ghost_factor * max(len(self._parent), 1):
            self._ghost.popitem(last=False)
        self._drop_leaf(key)
        if parent is not None and parent in self._children:
            self._children[parent] -= 1
            if self._children[parent] == 0:
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
                left = pending.get(parent, self._children[parent]) - 1
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
