"""Policy interfaces: what should be where.

Policies are pure bookkeeping on the event-loop thread: they never move bytes and never
touch a backend. The pipeline (live) and the trace replayer (offline) drive the very same
objects, so a policy measured in replay behaves the same in a live run.

An :class:`EvictionPolicy` instance tracks the pages of one tier. The tier tells it about
every insert, access and removal, and asks it for victims when the tier passes its high
watermark. ``victims`` must only return keys that ``evictable(key)`` accepts (pinned
pages and pages in flight are not evictable) and must not assume its answer is acted on:
the tier calls :meth:`EvictionPolicy.on_remove` for what it really removed.

An :class:`AdmissionPolicy` decides whether a page enters a tier at all (selective
write-through, TinyLFU-style filters).

**Optional hook: one preference order.** A policy whose ``victims(n, evictable)`` is
always the first ``n`` keys of a single order that ``evictable`` accepts (LRU, LRU-K) may
expose that order as ``ordered_keys(evictable=None)`` (an iterator over every tracked key,
best victim first; an order that depends on which pages may go, as prefix cuts do, takes
``evictable`` into account, and the keys it rejects may still appear). Wrappers that
filter victims structurally can then walk the order once instead of calling ``victims``
again and again: :class:`~kvtier.policy.leaf_first.LeafFirstPolicy`
uses it to take a chain tail-first in one pass (without it, every call rescans the
ancestors that precede each leaf in the order, quadratic in the chain length).
:func:`ordered_keys_of` gives a policy's order, or ``None`` for a policy without the hook
(or one whose ``ordered_keys`` returns ``None``: it has no single order now). A policy
with that order may also offer ``order_of(keys)``: the resident ones of ``keys`` in it,
sorted directly (LRU-K does); ``hinted`` uses it to place a few pages in its fallback's
order without walking the whole order.

**Optional hook: a copy that takes over.** A policy whose state takes its shape only when
it chooses victims (S3-FIFO's queues) drifts when it is fed the events of a tier that
another policy evicts for, as an expert of ``adaptive`` that is not leading is. Such a
policy may offer ``copy_holding(keys)``: a copy of itself that tracks exactly ``keys``
(given oldest first; the pages it lacks come in as the next to go, the pages ``keys``
lacks leave as if evicted), leaving itself unchanged. :func:`copy_holding_of` gives it,
or ``None`` for a policy without the hook. ``adaptive`` hands the tier such a copy of
the expert that ran alone in an exact miniature when that expert takes the lead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Generator, Iterable, Iterator, Sequence
from typing import ClassVar

from kvtier.keys import PageKey


class EvictionPolicy(ABC):
    """Chooses which resident pages of one tier to evict."""

    #: Name used in config (``eviction = "lru"``).
    name: ClassVar[str]
    #: Whether the policy keeps a page's parent in the tier while the page is there
    #: (leaf-first eviction): room made for a batch then never evicts a parent of a page
    #: in the batch.
    keeps_parents: ClassVar[bool] = False

    @abstractmethod
    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        """A page was committed to the tier. ``parent`` is the page before it in its
        sequence (``None`` for the first page or when unknown)."""

    @abstractmethod
    def on_access(self, key: PageKey) -> None:
        """A resident page was read (a hit)."""

    @abstractmethod
    def on_remove(self, key: PageKey) -> None:
        """A page left the tier (evicted, deleted, or failed). Unknown keys are ignored."""

    @abstractmethod
    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Up to ``n`` distinct resident keys to evict, best victim first, each accepted
        by ``evictable``. Fewer when not enough pages are evictable."""

    def should_keep(self, key: PageKey) -> bool:
        """Whether a victim should stay after all, asked just before it leaves the tier
        (its eviction ran in the background meanwhile). Leaf-first: it gained a child in
        the tier. ``False`` by default."""
        return False

    def may_drop(self, keys: Sequence[PageKey]) -> set[PageKey]:
        """The pages of ``keys`` (victims, children before parents) that could leave the
        whole hierarchy together without orphaning a cached page (leaf-first: those whose
        cached children all leave too). All of them by default: a policy that does not
        keep parents drops any page from the last tier."""
        return set(keys)

    def fallback_victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Victims for when :meth:`victims` offers none and the tier would otherwise refuse
        room: pages the policy would rather keep but may give up (leaf-first eviction
        offers ancestors here). None by default."""
        return []

    @abstractmethod
    def __len__(self) -> int:
        """Pages tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""


class AdmissionPolicy(ABC):
    """Decides whether a page may enter a tier."""

    name: ClassVar[str]

    @abstractmethod
    def admit(self, key: PageKey) -> bool:
        """Whether to admit ``key`` now."""

    def on_access(self, key: PageKey) -> None:  # noqa: B027 - optional hook
        """A page was referenced (stored, looked up, loaded or read; hit or miss);
        frequency-based filters count here."""

    def note_parent(self, key: PageKey, parent: PageKey | None) -> None:  # noqa: B027
        """``key`` was stored as the page after ``parent`` (``None``: first or unknown);
        reuse predictors that follow prefix chains learn here. Optional hook."""


class AdmitAll(AdmissionPolicy):
    """Admits every page."""

    name: ClassVar[str] = "all"

    def admit(self, key: PageKey) -> bool:
        return True


def ordered_keys_of(
    policy: EvictionPolicy, evictable: Callable[[PageKey], bool] | None = None
) -> Iterator[PageKey] | None:
    """``policy``'s one preference order given ``evictable`` (its optional
    ``ordered_keys``), or ``None`` when it exposes none now."""
    order = getattr(policy, "ordered_keys", None)
    if not callable(order):
        return None
    keys: Iterator[PageKey] | None = order(evictable)
    return keys


def copy_holding_of(policy: EvictionPolicy, keys: Iterable[PageKey]) -> EvictionPolicy | None:
    """``policy``'s copy tracking exactly ``keys`` (its optional ``copy_holding``, see
    the module docstring), or ``None`` when it has no such hook."""
    copier = getattr(policy, "copy_holding", None)
    if not callable(copier):
        return None
    copied: EvictionPolicy = copier(keys)
    return copied


def close_order(order: Iterator[PageKey]) -> None:
    """Release an order from ``ordered_keys()`` read only in part (a generator's
    ``close``: a policy may hold state aside while its order is read)."""
    close = getattr(order, "close", None)
    if callable(close):
        close()


def victims_in_order(
    order: Iterator[PageKey], n: int, evictable: Callable[[PageKey], bool]
) -> list[PageKey]:
    """``victims`` of a policy whose ``ordered_keys`` is its whole answer: the first ``n``
    keys of ``order`` that ``evictable`` accepts; the order is closed afterwards (see
    :func:`close_order`)."""
    try:
        return first_evictable(order, n, evictable)
    finally:
        close_order(order)


def first_evictable(
    order: Iterable[PageKey], n: int, evictable: Callable[[PageKey], bool]
) -> list[PageKey]:
    """The first ``n`` keys of ``order`` that ``evictable`` accepts."""
    out: list[PageKey] = []
    if n <= 0:
        return out
    for key in order:
        if evictable(key):
            out.append(key)
            if len(out) >= n:
                break
    return out


def pins_last(
    order: Generator[PageKey, None, None], pinned: Container[PageKey]
) -> Generator[PageKey, None, None]:
    """``order`` with the ``pinned`` pages held back until everything else was read."""
    held: list[PageKey] = []
    try:
        for key in order:
            if key in pinned:
                held.append(key)
            else:
                yield key
        yield from held
    finally:
        order.close()
