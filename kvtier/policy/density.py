"""``density``: evict the page with the lowest expected hit density, learned online.

Hit density (after Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit
Density", NSDI'18) is the hits a page is expected to earn per unit of cache space-time it
would still occupy. Keeping the pages of highest density maximises hits for a given
capacity. Nothing here is tied to a trace: the policy learns, from the traffic it sees,
how likely a page is to be referenced again as a function of two things it can observe:

* its *class*: how many times it was referenced so far (1, 2, ..., ``max_refs`` or more);
  on real KV traffic most pages are used once, and a page's chance of another use grows
  with its use count; and whether a page was ever stored after it (the last page of a
  prompt, often partial, is rarely reused, while a page inside a chain is reused whenever
  its conversation continues);
* its *age*: page insertions (the cache's clock) since its last reference; sessions come
  back after a gap, so that chance also falls with age.

Per class it keeps two histograms over logarithmic age buckets: *reuses* (a page
referenced again at that age) and *censorings* (a page whose history was dropped at that
age without a reuse). Evicted pages keep a ghost entry (key, class, last reference; no
data) for ``ghost_factor`` times the capacity, so reuses after an eviction are still seen
and the estimate is not biased by the policy's own evictions. From the histograms a
hazard per bucket (reuses over pages still observed at that age) gives, for each (class,
age), the density ``E[hits before the page's history ends] / E[insertions it spans]``,
where a history ends at a reuse or when its ghost is dropped (so ``ghost_factor`` sets how
far ahead the policy looks; the default of 3 capacities was measured against 2 and 4:
shorter windows favour large tiers, longer ones small tiers). Tables are recomputed
every ``capacity / 4`` insertions; histograms are halved every ``16 x capacity``
insertions, so the policy follows drifting traffic.

Prefix structure: when a page is evicted, its children still in the tier cannot produce a
prefix hit until it is recomputed, so these *orphans* are evicted before anything else. (A
page stored while its parent is not in this tier is not an orphan: in a lower tier the
parent is usually in a tier above.) A page whose
class has no evidence yet scores zero; ties go to the oldest page (LRU), which is what the
policy does on a cold start.

Eviction compares, for each class, the least recently referenced evictable page (within a
class density falls with age in practice) and takes the lowest. All hooks are O(1)
amortised apart from ``victims`` (O(classes) per victim) and the periodic table rebuild
(O(classes x buckets), independent of the number of pages).

``capacity`` is the tier's size in pages; without it the policy uses the most pages it has
held at once, which equals the capacity once the tier has filled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.params import capacity_param, number_param

#: Age buckets per doubling of age.
_SUB = 4


def bucket(age: int) -> int:
    """Logarithmic age bucket: exact below 8, then ``_SUB`` buckets per doubling."""
    if age < 8:
        return max(age, 0)
    e = age.bit_length() - 1  # 2**e <= age < 2**(e+1), e >= 3
    return 8 + (e - 3) * _SUB + ((age - (1 << e)) * _SUB >> e)


def bucket_start(b: int) -> int:
    """The smallest age of bucket ``b`` (the inverse of :func:`bucket`)."""
    if b < 8:
        return b
    e, s = divmod(b - 8, _SUB)
    e += 3
    return (1 << e) + ((s << e) + _SUB - 1) // _SUB


class HitDensityPolicy(EvictionPolicy):
    """Evict the lowest learned hit density (use count, parent-of-a-page, age); orphans
    first."""

    name: ClassVar[str] = "density"

    def __init__(
        self,
        max_refs: int = 3,
        ghost_factor: float = 3.0,
        capacity: int | None = None,
    ) -> None:
        """``max_refs``: use counts at and above it share a class. ``ghost_factor``: ghost
        entries kept, in capacities (how far past an eviction reuses are still seen).
        ``capacity``: the tier's pages, if known.
        Raises :class:`~kvtier.errors.ConfigError` for a value out of range."""
        if isinstance(max_refs, bool) or not isinstance(max_refs, int) or max_refs < 1:
            raise ConfigError(f"density: max_refs must be an integer >= 1, got {max_refs!r}")
        if not number_param("density", "ghost_factor", ghost_factor) >= 1.0:
            raise ConfigError(f"density: ghost_factor must be >= 1, got {ghost_factor!r}")
        capacity = capacity_param("density", capacity)
        self.max_refs = max_refs
        self.ghost_factor = float(ghost_factor)
        self._fixed_c = capacity
        self._seen_c = 0
        #: Insertions so far: the clock ages are measured in.
        self.clock = 0
        n_cls = 2 * max_refs  # (use count) x (has had a child page)
        self._n_cls = n_cls
        self._n_buckets = bucket(1 << 40) + 1
        nb = self._n_buckets
        self._widths = [bucket_start(b + 1) - bucket_start(b) for b in range(nb)]
        #: Per class: pages by last reference, oldest first (value: last reference time).
        self._lists: list[OrderedDict[PageKey, int]] = [OrderedDict() for _ in range(n_cls)]
        self._cls: dict[PageKey, int] = {}
        self._refs: dict[PageKey, int] = {}  # use count - 1, capped at max_refs - 1
        self._parented: dict[PageKey, bool] = {}  # a page was ever inserted after it
        self._parent: dict[PageKey, PageKey | None] = {}  # resident parent, else None
        self._kids: dict[PageKey, dict[PageKey, None]] = {}  # resident children, in order
        self._orphans: OrderedDict[PageKey, None] = OrderedDict()
        #: Evicted pages: key -> (class, last reference time), oldest eviction first.
        self._ghosts: OrderedDict[PageKey, tuple[int, int]] = OrderedDict()
        self._reuses = [[0.0] * nb for _ in range(n_cls)]
        self._censored = [[0.0] * nb for _ in range(n_cls)]
        self._table: list[list[float]] = [[0.0] * nb for _ in range(n_cls)]
        self._next_rebuild = 0
        self._next_decay = 0

    # -- capacity and learning ------------------------------------------------------------

    @property
    def c(self) -> int:
        """The capacity in pages (given, or the most pages held at once)."""
        return self._fixed_c or max(self._seen_c, 1)

    def density(self, refs: int, age: int, parented: bool = True) -> float:
        """The current density estimate for a page used ``refs`` times, last ``age``
        insertions ago, that has (``parented``) or never had a child page; 0 where the
        policy has no evidence yet. Raises :class:`~kvtier.errors.KVTierUsageError` for
        ``refs`` < 1 or a negative ``age``."""
        if refs < 1 or age < 0:
            raise KVTierUsageError(f"density: need refs >= 1 and age >= 0, got {refs}, {age}")
        cls = self._class(min(refs - 1, self.max_refs - 1), parented)
        return self._table[cls][min(bucket(age), self._n_buckets - 1)]

    def _record(self, hist: list[list[float]], cls: int, age: int) -> None:
        hist[cls][min(bucket(age), self._n_buckets - 1)] += 1.0

    def refresh(self) -> None:
        """Recompute the density tables from the histograms now (the policy also does
        this by itself every quarter capacity of insertions)."""
        widths = self._widths
        top = min(bucket(self.clock) + 1, self._n_buckets)  # no age exceeds the clock
        for cls in range(self._n_cls):
            reuses, censored = self._reuses[cls], self._censored[cls]
            table = self._table[cls]
            at_risk = hits = occupied = 0.0
            for b in range(top - 1, -1, -1):
                ended = reuses[b] + censored[b]
                if ended:
                    at_risk += ended
                    p_hit = reuses[b] / at_risk
                    p_end = ended / at_risk
                    hits = p_hit + (1.0 - p_end) * hits
                    occupied = widths[b] * (1.0 - p_end / 2) + (1.0 - p_end) * occupied
                else:
                    occupied += widths[b]
                table[b] = hits / occupied if occupied > 0 else 0.0
        self._next_rebuild = self.clock + max(self.c // 4, 1)

    def _tick(self) -> None:
        self.clock += 1
        if self.clock >= self._next_decay:
            if self._next_decay:
                for hist in (self._reuses, self._censored):
                    for row in hist:
                        for i, v in enumerate(row):
                            row[i] = v / 2
            self._next_decay = self.clock + 16 * self.c
        if self.clock >= self._next_rebuild:
            self.refresh()

    def _trim_ghosts(self) -> None:
        limit = self.ghost_factor * self.c
        while len(self._ghosts) > limit:
            _, (cls, last) = self._ghosts.popitem(last=False)
            self._record(self._censored, cls, self.clock - last)

    @staticmethod
    def _class(refs: int, parented: bool) -> int:
        return 2 * refs + (1 if parented else 0)

    def _move(self, key: PageKey, cls: int, last: int) -> None:
        self._cls[key] = cls
        self._lists[cls][key] = last

    # -- the EvictionPolicy hooks ---------------------------------------------------------

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._cls:
            self.on_access(key)
            return
        self._tick()
        ghost = self._ghosts.pop(key, None)
        parented = False
        if ghost is None:
            refs = 0
        else:
            old, last = ghost
            self._record(self._reuses, old, self.clock - last)
            refs = min(old // 2 + 1, self.max_refs - 1)
            parented = bool(old % 2)
        self._refs[key] = refs
        self._parented[key] = parented
        self._move(key, self._class(refs, parented), self.clock)
        if parent is not None and parent not in self._cls:
            # Not an orphan: in a lower tier the parent usually sits in a tier above.
            parent = None
        self._parent[key] = parent
        self._kids[key] = {}
        if parent is not None:
            self._kids[parent][key] = None
            if not self._parented[parent]:
                self._parented[parent] = True
                pcls = self._cls[parent]
                last = self._lists[pcls].pop(parent)
                self._move(parent, self._class(self._refs[parent], True), last)
        self._seen_c = max(self._seen_c, len(self._cls))
        self._trim_ghosts()

    def on_access(self, key: PageKey) -> None:
        cls = self._cls.get(key)
        if cls is None:
            return
        last = self._lists[cls].pop(key)
        self._record(self._reuses, cls, self.clock - last)
        refs = min(self._refs[key] + 1, self.max_refs - 1)
        self._refs[key] = refs
        self._move(key, self._class(refs, self._parented[key]), self.clock)
        self._orphans.pop(key, None)

    def on_remove(self, key: PageKey) -> None:
        cls = self._cls.pop(key, None)
        if cls is None:
            return
        last = self._lists[cls].pop(key)
        self._orphans.pop(key, None)
        self._refs.pop(key)
        self._parented.pop(key)
        parent = self._parent.pop(key)
        if parent is not None:
            self._kids[parent].pop(key, None)
        for kid in self._kids.pop(key):
            self._parent[kid] = None
            self._orphans[kid] = None
        self._ghosts[key] = (cls, last)
        self._trim_ghosts()

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        chosen: set[PageKey] = set()
        for key in self._orphans:
            if len(out) >= n:
                return out
            if evictable(key):
                out.append(key)
                chosen.add(key)
        iters = [iter(lst.items()) for lst in self._lists]
        heads: list[tuple[PageKey, int] | None] = [None] * self._n_cls

        def advance(cls: int) -> None:
            for item in iters[cls]:
                if item[0] not in chosen and evictable(item[0]):
                    heads[cls] = item
                    return
            heads[cls] = None

        for cls in range(self._n_cls):
            advance(cls)
        while len(out) < n:
            best: tuple[float, int, int] | None = None
            for cls, head in enumerate(heads):
                if head is None:
                    continue
                age = self.clock - head[1]
                cand = (self._table[cls][min(bucket(age), self._n_buckets - 1)], -age, cls)
                if best is None or cand < best:
                    best = cand
            if best is None:
                break
            cls = best[2]
            head = heads[cls]
            assert head is not None
            out.append(head[0])
            chosen.add(head[0])
            advance(cls)
        return out

    def __len__(self) -> int:
        return len(self._cls)

    def __contains__(self, key: object) -> bool:
        return key in self._cls
