"""S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

New pages enter the small queue (``small_ratio`` of the pages, 10 % by default); pages
whose key is in the ghost queue (recently evicted from the small queue) enter the main
queue directly. Each page has a 2-bit access counter. Evicting from the small queue moves
a page that was accessed to the main queue, else drops it (its key goes to the ghost
queue). Evicting from the main queue gives an accessed page another round (counter - 1).
Most one-hit pages therefore leave quickly through the small queue.

``victims`` reorganises the queues as it scans (moves, counter decrements) but removes
nothing: removal happens in :meth:`on_remove`, as the interface requires. So the queues
only take their shape when the policy chooses: fed the events of a tier that another
policy evicts for (an expert of ``adaptive`` that is not leading), used pages never move
from the small to the main queue and no counter ever falls (most reach their cap), so
when it starts choosing, its order says little about recent use.
:meth:`S3FIFOPolicy.copy_holding` (the optional hook of :mod:`kvtier.policy.base`) lets
``adaptive`` hand the tier a copy of the S3-FIFO that ran alone in its miniature instead.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.params import number_param


class S3FIFOPolicy(EvictionPolicy):
    """Small + main + ghost FIFO queues with 2-bit access counters."""

    name: ClassVar[str] = "s3-fifo"

    def __init__(self, small_ratio: float = 0.1, ghost_factor: float = 1.0) -> None:
        if not 0.0 < number_param(self.name, "small_ratio", small_ratio) < 1.0:
            raise ConfigError(f"s3-fifo: small_ratio must lie in (0, 1), got {small_ratio!r}")
        if not number_param(self.name, "ghost_factor", ghost_factor) > 0:
            raise ConfigError(f"s3-fifo: ghost_factor must be > 0, got {ghost_factor!r}")
        self.small_ratio = small_ratio
        self.ghost_factor = ghost_factor
        self.small: OrderedDict[PageKey, None] = OrderedDict()
        self.main: OrderedDict[PageKey, None] = OrderedDict()
        self.ghost: OrderedDict[PageKey, None] = OrderedDict()
        self.freq: dict[PageKey, int] = {}
        self._seen_c = 0

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self.freq:
            self.on_access(key)
            return
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self._seen_c = max(self._seen_c, len(self.freq))

    def on_access(self, key: PageKey) -> None:
        f = self.freq.get(key)
        if f is not None and f < 3:
            self.freq[key] = f + 1

    def on_remove(self, key: PageKey) -> None:
        if self.freq.pop(key, None) is None:
            return
        if key in self.small:
            del self.small[key]
            self.ghost[key] = None
            while len(self.ghost) > max(self.ghost_factor * self._seen_c, 1):
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def copy_holding(self, keys: Iterable[PageKey]) -> S3FIFOPolicy:
        """A copy of this policy (queues, counters, ghost queue; this one is left as it
        is) that tracks exactly ``keys``: its pages that ``keys`` lacks leave as if
        evicted (:meth:`on_remove`), and those of ``keys`` it does not track, in the
        order given, come in unused at the head of the main queue (they leave the ghost
        queue): the next to go once the small queue is down to its share."""
        wanted = dict.fromkeys(keys)
        new = copy.copy(self)
        new.small = OrderedDict(self.small)
        new.main = OrderedDict(self.main)
        new.ghost = OrderedDict(self.ghost)
        new.freq = dict(self.freq)
        for key in [k for k in new.freq if k not in wanted]:
            new.on_remove(key)
        extra = [k for k in wanted if k not in new.freq]
        if extra:
            for key in extra:
                new.ghost.pop(key, None)
                new.freq[key] = 0
            main = OrderedDict.fromkeys(extra)
            main.update(new.main)
            new.main = main
            new._seen_c = max(new._seen_c, len(new.freq))
        return new

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        small_target = self.small_ratio * max(self._seen_c, 1)
        # Each page is examined a bounded number of times (counters only go down).
        budget = 4 * (len(self.small) + len(self.main)) + n
        while len(out) < n and budget > 0:
            budget -= 1
            small_left = len(self.small) - sum(1 for k in chosen if k in self.small)
            if self.small and (small_left > small_target or not self.main):
                key = self._scan_small(chosen, evictable)
            else:
                key = self._scan_main(chosen, evictable)
            if key is None:
                key = self._scan_small(chosen, evictable) or self._scan_main(chosen, evictable)
                if key is None:
                    break
            out.append(key)
            chosen.add(key)
        return out

    def _scan_small(
        self, chosen: set[PageKey], evictable: Callable[[PageKey], bool]
    ) -> PageKey | None:
        for _ in range(len(self.small)):
            key = next(iter(self.small))
            if key in chosen or not evictable(key):
                self.small.move_to_end(key)
                continue
            if self.freq[key] > 0:
                del self.small[key]
                self.freq[key] = 0
                self.main[key] = None
                continue
            return key
        return None

    def _scan_main(
        self, chosen: set[PageKey], evictable: Callable[[PageKey], bool]
    ) -> PageKey | None:
        for _ in range(4 * len(self.main) + 1):
            if not self.main:
                return None
            key = next(iter(self.main))
            if key in chosen or not evictable(key):
                self.main.move_to_end(key)
                continue
            f = self.freq[key]
            if f > 0:
                self.freq[key] = f - 1
                self.main.move_to_end(key)
                continue
            return key
        return None

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: object) -> bool:
        return key in self.freq
