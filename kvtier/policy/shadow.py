"""Miniature caches: sampled shadow simulations that run beside a real tier.

A :class:`KeySampler` keeps a page when a 64-bit hash of its key falls below a threshold
(spatial sampling, as in SHARDS, Waldspurger et al., FAST'15): every reference of a kept
page is seen, none of the others. A :class:`MiniCache` of ``rate x capacity`` pages fed
with the sampled references of a cache of ``capacity`` pages behaves like a scaled-down
copy of it, so its hit ratio estimates the full cache's ("miniature simulation",
Waldspurger et al., ATC'17). The sampling rate only ever halves (when the estimated
capacity grows past what the miniature may hold), and halving drops the pages whose
hash no longer falls below the threshold, so a miniature stays a valid sample.

Everything is deterministic (xxhash of the key, no Python ``hash``), so the live
pipeline and the replay drive miniatures to the same state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import xxhash

from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy

_FULL = 1 << 64


#: The hash seed of the policies' own samples (:class:`KeySampler`).
_SEED = 0x6B76


def key_hash(key: PageKey, seed: int = _SEED) -> int:
    """A 64-bit hash of ``key`` used for sampling (stable across processes). Samplers
    stacked on one another (what-if miniatures of a tier whose policy samples itself)
    use different ``seed`` values, so the inner sample is independent of the outer."""
    return xxhash.xxh3_64_intdigest(key, seed=seed)


class KeySampler:
    """Keeps keys whose hash is below ``rate x 2**64``; ``rate`` starts at 1 and halves."""

    def __init__(self) -> None:
        self.rate = 1.0
        #: Keys whose hash is below this are kept (``2**64``: every key).
        self.threshold = _FULL

    def keeps(self, key: PageKey) -> bool:
        """Whether ``key`` is in the sample."""
        return self.threshold >= _FULL or key_hash(key) < self.threshold

    def sample(self, keys: tuple[PageKey, ...]) -> tuple[PageKey, ...]:
        """The keys of ``keys`` in the sample, in order (``keys`` itself when all are)."""
        threshold = self.threshold
        if threshold >= _FULL:
            return keys
        h = xxhash.xxh3_64_intdigest
        return tuple(k for k in keys if h(k, seed=_SEED) < threshold)

    def halve(self) -> None:
        """Keep half as many keys from now on (a subset of the keys kept so far)."""
        self.rate /= 2
        self.threshold = int(_FULL * self.rate)


class RecentPins:
    """The pages of the last ``recent`` references (at most a quarter of the capacity),
    which a miniature does not evict: a real tier pins the pages of the requests it is
    serving; without this, the pages of one request could evict each other before a hint
    about them arrives. Miniatures fed the same references at the same capacity share one
    (it depends on nothing else), so it is kept once for all of them."""

    def __init__(self, recent: int = 32) -> None:
        self.recent = recent
        self._recent: deque[PageKey] = deque()
        #: Page -> how many of the recent references were to it (read by miniatures).
        self.counts: dict[PageKey, int] = {}

    def push(self, key: PageKey, capacity: float) -> None:
        """``key`` was referenced, in miniatures of ``capacity`` pages."""
        limit = min(self.recent, max(int(capacity) // 4, 0))
        self._recent.append(key)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        while len(self._recent) > limit:
            old = self._recent.popleft()
            n = counts[old] - 1
            if n:
                counts[old] = n
            else:
                del counts[old]


class MiniCache:
    """A cache of ``capacity`` pages driven by references only: a resident page referenced
    is a hit (``on_access``), another is a miss (victims evicted, then ``on_insert``).
    Counts hits and references; ``score`` is an exponentially decayed hit count.

    The pages of the last ``recent`` references are not evicted (:class:`RecentPins`).
    Given ``pins`` shared with other miniatures, the caller pushes each reference to it
    once, before feeding the miniatures; otherwise the miniature keeps its own."""

    def __init__(
        self,
        policy: EvictionPolicy,
        capacity: float = 0.0,
        recent: int = 32,
        pins: RecentPins | None = None,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self._own_pins = pins is None
        self.pins = RecentPins(recent) if pins is None else pins
        self._pinned = self.pins.counts
        self.resident: set[PageKey] = set()
        self.hits = 0
        self.refs = 0
        self.score = 0.0
        #: Whether the miniature has evicted anything yet (before that, every policy
        #: of the same size holds the same pages).
        self.evicted = False

    def _evictable(self, key: PageKey) -> bool:
        return key in self.resident and key not in self._pinned

    def reference(self, key: PageKey, parent: PageKey | None, decay: float) -> bool:
        """Reference ``key``; returns whether it was a hit."""
        self.refs += 1
        if self._own_pins:
            self.pins.push(key, self.capacity)
        resident = self.resident
        if key in resident:
            self.policy.on_access(key)
            self.hits += 1
            self.score = self.score * decay + 1.0
            return True
        self.score *= decay
        cap = int(self.capacity)
        if cap < 1:
            return False
        if len(resident) >= cap:
            # Evict a small batch at once (1/32 of the pages): one victim search serves
            # several misses, as a real tier evicting down to its low watermark does.
            self.shrink_to(cap - 1 - cap // 32)
        resident.add(key)
        self.policy.on_insert(key, parent if parent in resident else None)
        return False

    def shrink_to(self, size: int) -> None:
        """Evict per policy until at most ``size`` pages stay."""
        over = len(self.resident) - max(size, 0)
        if over <= 0:
            return
        self.evicted = True
        for v in self.policy.victims(over, self._evictable):
            self.resident.discard(v)
            self.policy.on_remove(v)
        if len(self.resident) > max(size, 0):  # a policy offering too few: drop the rest
            for v in sorted(self.resident)[: len(self.resident) - max(size, 0)]:
                self.resident.discard(v)
                self.policy.on_remove(v)

    def drop(self, keep: Callable[[PageKey], bool]) -> None:
        """Forget resident pages ``keep`` rejects (after the sample shrank), by the
        policy's ``forget(key)`` where it has one (a page that left the sample strands
        nothing: :meth:`PrefixCutPolicy.forget
        <kvtier.policy.prefix_cut.PrefixCutPolicy.forget>`), else its ``on_remove``."""
        forget = getattr(self.policy, "forget", self.policy.on_remove)
        for k in sorted(k for k in self.resident if not keep(k)):  # sorted: deterministic
            self.resident.discard(k)
            forget(k)
