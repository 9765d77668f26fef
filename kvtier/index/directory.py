"""The directory: the one index of which page is in which tier, and in what state.

For every page key it holds the state of the page in each tier (``reserved`` while a write
is in progress, ``committed`` once readable, ``evicting`` while it is being moved out),
a pin count (pages in use by the engine), an in-flight count per tier (pages being copied
out of that tier), its parent key and namespace label.

Rules it enforces (each violation raises :class:`DirectoryError`, a bug in the caller):

* states only move ``reserved -> committed -> evicting -> (removed | committed)``, or
  ``reserved -> (aborted)``;
* a page pinned or in flight in a tier is not evictable there;
* only ``committed`` (and ``evicting``, until removed) pages are visible to lookups.

The directory is owned by the event-loop thread: it takes no locks and must not be touched
from worker threads. Listeners (a prefix tree) subscribe to commits and removals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvtier.errors import KVTierError
from kvtier.keys import PageKey


class DirectoryError(KVTierError):
    """An illegal directory transition (a bug in the caller, never a user error)."""


class PageState(StrEnum):
    """State of a page in one tier."""

    RESERVED = "reserved"
    COMMITTED = "committed"
    EVICTING = "evicting"


class DirectoryListener(Protocol):
    """Receives directory changes (e.g. the prefix tree). Called on the loop thread."""

    def on_commit(self, key: PageKey, tier: str) -> None:
        """``key`` became readable in ``tier``."""

    def on_remove(self, key: PageKey, tier: str) -> None:
        """``key`` left ``tier`` (evicted, deleted or failed)."""


@dataclass(slots=True)
class Entry:
    """What the directory knows of one page (``__slots__``: one per page, so its size
    is the directory's memory per page)."""

    key: PageKey
    namespace: str = ""
    parent: PageKey | None = None
    states: dict[str, PageState] = field(default_factory=dict)
    pins: int = 0
    inflight: dict[str, int] = field(default_factory=dict)

    def visible_in(self, tier: str) -> bool:
        return self.states.get(tier) in (PageState.COMMITTED, PageState.EVICTING)


class Directory:
    """Index of pages across tiers. See the module docstring for the rules.

    Args:
        tiers: tier names, top first.
    """

    def __init__(self, tiers: Sequence[str]) -> None:
        if len(set(tiers)) != len(tiers) or not tiers:
            raise DirectoryError(f"tier names must be unique and non-empty, got {list(tiers)}")
        self.tiers: tuple[str, ...] = tuple(tiers)
        self._rank = {t: i for i, t in enumerate(self.tiers)}
        self._entries: dict[PageKey, Entry] = {}
        self._counts: dict[str, dict[PageState, int]] = {
            t: dict.fromkeys(PageState, 0) for t in self.tiers
        }
        self._listeners: list[DirectoryListener] = []
        # kept in step with the entries so that room-making never scans the directory
        self._pinned: dict[str, int] = dict.fromkeys(self.tiers, 0)
        self._busy: dict[str, int] = dict.fromkeys(self.tiers, 0)

    # -- listeners ---------------------------------------------------------------------

    def subscribe(self, listener: DirectoryListener) -> Callable[[], None]:
        """Call ``listener.on_commit``/``on_remove`` on every change; returns unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # -- queries -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[PageKey]:
        return iter(self._entries)

    def get(self, key: PageKey) -> Entry | None:
        return self._entries.get(key)

    def state(self, key: PageKey, tier: str) -> PageState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.states.get(tier)

    def is_committed(self, key: PageKey, tier: str) -> bool:
        """Readable in ``tier`` and not on its way out."""
        return self.state(key, tier) is PageState.COMMITTED

    def locate(self, key: PageKey) -> str | None:
        """The highest tier where ``key`` is readable (committed or evicting), or ``None``."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        for tier in self.tiers:
            if entry.visible_in(tier):
                return tier
        return None

    def tiers_of(self, key: PageKey) -> list[str]:
        """Every tier where ``key`` is readable, top first."""
        entry = self._entries.get(key)
        if entry is None:
            return []
        return [t for t in self.tiers if entry.visible_in(t)]

    def below(self, key: PageKey, tier: str, include_reserved: bool = False) -> bool:
        """Whether ``key`` is committed (or being written, if asked) in a tier under ``tier``."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        rank = self._rank[tier]
        for t, st in entry.states.items():
            if self._rank[t] > rank and (
                st is PageState.COMMITTED or (include_reserved and st is PageState.RESERVED)
            ):
                return True
        return False

    def count(self, tier: str, *states: PageState) -> int:
        """Pages of ``tier`` in any of ``states`` (all states when none given)."""
        counts = self._counts[self._check_tier(tier)]
        if not states:
            return sum(counts.values())
        return sum(counts[s] for s in states)

    def evicting(self, tier: str) -> int:
        """Pages of ``tier`` whose eviction is under way."""
        return self._counts[self._check_tier(tier)][PageState.EVICTING]

    def reserved(self, tier: str) -> int:
        """Pages reserved in ``tier`` (being written, not yet visible)."""
        return self._counts[self._check_tier(tier)][PageState.RESERVED]

    def used(self, tier: str) -> int:
        """Pages occupying space in ``tier`` (reserved, committed or evicting)."""
        return self.count(tier)

    def keys_in(self, tier: str, *states: PageState) -> list[PageKey]:
        """Keys of ``tier`` in any of ``states`` (committed when none given)."""
        wanted = states or (PageState.COMMITTED,)
        return [k for k, e in self._entries.items() if e.states.get(tier) in wanted]

    def is_pinned(self, key: PageKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    def evictable(self, key: PageKey, tier: str) -> bool:
        """Committed in ``tier``, not pinned, and not being copied out of ``tier``."""
        entry = self._entries.get(key)
        return (
            entry is not None
            and entry.states.get(tier) is PageState.COMMITTED
            and entry.pins == 0
            and entry.inflight.get(tier, 0) == 0
        )

    def busy(self, tier: str) -> int:
        """Pages of ``tier`` with copies in flight out of it (O(1))."""
        return self._busy[self._check_tier(tier)]

    def pinned(self, tier: str) -> int:
        """Pinned pages that occupy space in ``tier`` (O(1))."""
        return self._pinned[self._check_tier(tier)]

    # -- transitions -------------------------------------------------------------------

    def _check_tier(self, tier: str) -> str:
        if tier not in self._rank:
            raise DirectoryError(f"unknown tier {tier!r}; tiers: {', '.join(self.tiers)}")
        return tier

    def _set(self, entry: Entry, tier: str, new: PageState | None) -> None:
        old = entry.states.get(tier)
        if old is not None:
            self._counts[tier][old] -= 1
            if new is None and entry.pins:
                self._pinned[tier] -= 1
        elif new is not None and entry.pins:
            self._pinned[tier] += 1
        if new is None:
            entry.states.pop(tier, None)
        else:
            entry.states[tier] = new
            self._counts[tier][new] += 1

    def _drop_if_unused(self, entry: Entry) -> None:
        if not entry.states and entry.pins == 0 and not any(entry.inflight.values()):
            del self._entries[entry.key]

    def reserve(
        self, key: PageKey, tier: str, namespace: str = "", parent: PageKey | None = None
    ) -> Entry:
        """Record that space for ``key`` was taken in ``tier`` (not yet visible)."""
        self._check_tier(tier)
        entry = self._entries.get(key)
        if entry is None:
            entry = Entry(key, namespace, parent)
            self._entries[key] = entry
        else:
            if parent is not None and entry.parent is None:
                entry.parent = parent
            if namespace and not entry.namespace:
                entry.namespace = namespace
        if tier in entry.states:
            raise DirectoryError(
                f"page {key.hex()} is already {entry.states[tier]} in tier {tier!r}"
            )
        self._set(entry, tier, PageState.RESERVED)
        return entry

    def commit(self, key: PageKey, tier: str) -> None:
        """``reserved -> committed``: the page is readable in ``tier``. Notifies listeners."""
        entry = self._require(key, tier, PageState.RESERVED, "commit")
        self._set(entry, tier, PageState.COMMITTED)
        for listener in list(self._listeners):
            listener.on_commit(key, tier)

    def abort(self, key: PageKey, tier: str) -> None:
        """Drop a reservation that will not be committed (invisible: no notification)."""
        entry = self._require(key, tier, PageState.RESERVED, "abort")
        self._set(entry, tier, None)
        self._drop_if_unused(entry)

    def begin_evict(self, key: PageKey, tier: str) -> None:
        """``committed -> evicting``; the page must be evictable (not pinned, not in flight)."""
        entry = self._require(key, tier, PageState.COMMITTED, "evict")
        if entry.pins or entry.inflight.get(tier, 0):
            raise DirectoryError(
                f"page {key.hex()} is pinned or in flight in tier {tier!r}: cannot evict"
            )
        self._set(entry, tier, PageState.EVICTING)

    def cancel_evict(self, key: PageKey, tier: str) -> None:
        """``evicting -> committed`` (the page stays: pinned meanwhile, or no room below)."""
        entry = self._require(key, tier, PageState.EVICTING, "cancel eviction of")
        self._set(entry, tier, PageState.COMMITTED)

    def remove(self, key: PageKey, tier: str) -> None:
        """A committed or evicting page left ``tier``. Notifies listeners."""
        entry = self._entries.get(key)
        state = None if entry is None else entry.states.get(tier)
        if entry is None or state not in (PageState.COMMITTED, PageState.EVICTING):
            raise DirectoryError(
                f"cannot remove page {key.hex()} from tier {tier!r}: state is {state}"
            )
        if entry.inflight.get(tier, 0):
            raise DirectoryError(f"page {key.hex()} is in flight in tier {tier!r}: cannot remove")
        self._set(entry, tier, None)
        self._drop_if_unused(entry)
        for listener in list(self._listeners):
            listener.on_remove(key, tier)

    def pin(self, key: PageKey) -> None:
        """Protect ``key`` from eviction in every tier until :meth:`unpin`. Pins count."""
        entry = self._entries.get(key)
        if entry is None:
            entry = Entry(key)
            self._entries[key] = entry
        if entry.pins == 0:
            for tier in entry.states:
                self._pinned[tier] += 1
        entry.pins += 1

    def unpin(self, key: PageKey) -> None:
        """Drop one pin; unpinning a page that holds none raises."""
        entry = self._entries.get(key)
        if entry is None or entry.pins == 0:
            raise DirectoryError(f"page {key.hex()} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            for tier in entry.states:
                self._pinned[tier] -= 1
        self._drop_if_unused(entry)

    def begin_copy(self, key: PageKey, tier: str) -> None:
        """A copy out of ``tier`` starts: the page may not be evicted there meanwhile."""
        entry = self._entries.get(key)
        if entry is None or not entry.visible_in(tier):
            raise DirectoryError(f"page {key.hex()} is not readable in tier {tier!r}")
        if not entry.inflight.get(tier):
            self._busy[tier] += 1
        entry.inflight[tier] = entry.inflight.get(tier, 0) + 1

    def end_copy(self, key: PageKey, tier: str) -> None:
        """A copy out of ``tier`` finished (successfully or not)."""
        entry = self._entries.get(key)
        if entry is None or entry.inflight.get(tier, 0) == 0:
            raise DirectoryError(f"no copy of page {key.hex()} in flight in tier {tier!r}")
        entry.inflight[tier] -= 1
        if entry.inflight[tier] == 0:
            del entry.inflight[tier]
            self._busy[tier] -= 1
        self._drop_if_unused(entry)

    def _require(self, key: PageKey, tier: str, state: PageState, what: str) -> Entry:
        self._check_tier(tier)
        entry = self._entries.get(key)
        actual = None if entry is None else entry.states.get(tier)
        if entry is None or actual is not state:
            raise DirectoryError(
                f"cannot {what} page {key.hex()} in tier {tier!r}: state is {actual}, "
                f"expected {state}"
            )
        return entry

    # -- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify internal consistency; raises :class:`DirectoryError` on the first breach.

        Checks: per-tier state, pinned and busy counts equal a recount; no entry is empty
        (no state, no pin, no copy in flight); pin and in-flight counts are positive; no
        copy is in flight out of a tier where the page is not readable; every tier named
        is known.
        """
        recount: dict[str, dict[PageState, int]] = {
            t: dict.fromkeys(PageState, 0) for t in self.tiers
        }
        for key, entry in self._entries.items():
            if entry.key != key:
                raise DirectoryError(f"entry for {key.hex()} holds key {entry.key.hex()}")
            if not entry.states and entry.pins == 0 and not entry.inflight:
                raise DirectoryError(f"empty entry kept for page {key.hex()}")
            if entry.pins < 0:
                raise DirectoryError(f"negative pin count on page {key.hex()}")
            for tier, state in entry.states.items():
                if tier not in self._rank:
                    raise DirectoryError(f"page {key.hex()} in unknown tier {tier!r}")
                recount[tier][state] += 1
            for tier, n in entry.inflight.items():
                if n <= 0:
                    raise DirectoryError(f"bad in-flight count {n} on {key.hex()} in {tier}")
                if not entry.visible_in(tier):
                    raise DirectoryError(
                        f"copy of page {key.hex()} in flight out of tier {tier!r} where it "
                        f"is {entry.states.get(tier)}"
                    )
        if recount != self._counts:
            raise DirectoryError(f"tier counts {self._counts} differ from recount {recount}")
        pinned = {
            t: sum(1 for e in self._entries.values() if e.pins and t in e.states)
            for t in self.tiers
        }
        if pinned != self._pinned:
            raise DirectoryError(f"pinned counts {self._pinned} differ from recount {pinned}")
        busy = {t: sum(1 for e in self._entries.values() if e.inflight.get(t)) for t in self.tiers}
        if busy != self._busy:
            raise DirectoryError(f"busy counts {self._busy} differ from recount {busy}")
