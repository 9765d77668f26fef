"""``session``: kvtier's own eviction policy, aimed at the gap between LRU and MIN.

It is ARC (adaptive split between recency and frequency, see
:mod:`~kvtier.policy.arc`) reshaped for prefix-structured, multi-turn KV traffic. Facts of
such traffic drive each change (none is tied to a trace's ids):

1. *Most pages are used once, and sessions return after minutes.* A page used twice is
   about twice as likely to be used again as a new one, but its second use typically
   comes long after a cache of realistic size has forgotten it. So the ghost lists (keys
   of evicted pages, no data) remember ``ghost_factor`` times the capacity instead of one
   capacity: a session that returns after its pages were evicted is recognised, and its
   recomputed pages enter the frequency list ``T2`` where one-use pages cannot push them
   out. ARC's adaptation of the ``T1``/``T2`` split does the rest.
2. *A continued session supersedes its old tail.* When a session continues from a
   reused page on a new branch, the leaf pages left under that page (the partial last
   page of the previous prompt, an abandoned regeneration) are moved to the cold end of
   ``T1``: they go first.

``victims`` reorders nothing and removes nothing; removal happens in :meth:`on_remove`.
Every hook is O(1) amortised.

Why not leaf-only eviction: on real traces it changes nothing measurable (ARC's ``T1``
already drops a cold request from its first page to its last), and protecting interior
pages lets dead sessions' prefixes linger; see docs/benchmarks.md (section "Trace
replay, policies and the cost model").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from kvtier.keys import PageKey
from kvtier.policy.arc import ARCPolicy


class SessionPolicy(ARCPolicy):
    """ARC with long ghost memory, prefix-aware victims and superseded-tail demotion.

    The lists, the adaptation of ``p`` on ghost hits, ghost trimming and the move to the
    ghost lists on removal are ARC's (:class:`~kvtier.policy.arc.ARCPolicy`); this class
    adds the page tree and its own victim order."""

    name: ClassVar[str] = "session"

    def __init__(self, ghost_factor: float = 4.0, capacity: int | None = None) -> None:
        # ARC's constructor checks both, naming this policy (``self.name``)
        super().__init__(capacity, ghost_factor)
        self._parent: dict[PageKey, PageKey | None] = {}
        self._kids: dict[PageKey, set[PageKey]] = {}
        self._reused: set[PageKey] = set()  # accessed since a child was last added

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._parent:
            self.on_access(key)
            return
        if parent is not None and parent not in self._parent:
            parent = None
        self._enter(key)
        self._parent[key] = parent
        self._kids[key] = set()
        if parent is not None:
            siblings = self._kids[parent]
            if parent in self._reused:
                # The session continued from ``parent`` on a new branch: demote old tails.
                for s in siblings:
                    if not self._kids[s] and s in self.t1:
                        self.t1.move_to_end(s, last=False)
                self._reused.discard(parent)
            siblings.add(key)
        self._seen_c = max(self._seen_c, len(self._parent))
        self._trim_ghosts()

    def on_access(self, key: PageKey) -> None:
        if key in self.t1 or key in self.t2:
            super().on_access(key)
            self._reused.add(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        for kid in self._kids.pop(key, ()):  # removed out of order: children become roots
            if kid in self._parent:
                self._parent[kid] = None
        if parent is not None and parent in self._kids:
            self._kids[parent].discard(key)
        self._reused.discard(key)
        super().on_remove(key)  # to the ghost list it came from

    @staticmethod
    def _take(
        lst: OrderedDict[PageKey, None],
        chosen: set[PageKey],
        evictable: Callable[[PageKey], bool],
    ) -> PageKey | None:
        """The coldest page of ``lst`` not yet chosen and evictable."""
        for key in lst:
            if key not in chosen and evictable(key):
                return key
        return None

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        n1 = len(self.t1)
        while len(out) < n:
            first, second = (
                (self.t1, self.t2) if (n1 > self.p or not self.t2) else (self.t2, self.t1)
            )
            key = self._take(first, chosen, evictable)
            if key is None:
                key = self._take(second, chosen, evictable)
                if key is None:
                    break
            out.append(key)
            chosen.add(key)
            if key in self.t1:
                n1 -= 1
        return out
