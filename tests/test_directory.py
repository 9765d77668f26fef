"""The directory: legal transitions, visibility, pins, copies in flight, listeners, and a
hypothesis state machine checking it against a plain model after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.index.directory import Directory, DirectoryError, PageState
from kvtier.keys import PageKey

TIERS = ("dram", "nvme", "remote")
K = [PageKey(bytes([i]) * 16) for i in range(6)]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, bytes, str]] = []

    def on_commit(self, key: PageKey, tier: str) -> None:
        self.events.append(("commit", key, tier))

    def on_remove(self, key: PageKey, tier: str) -> None:
        self.events.append(("remove", key, tier))


def test_two_phase_visibility_and_listeners():
    d = Directory(TIERS)
    rec = Recorder()
    unsubscribe = d.subscribe(rec)
    d.reserve(K[0], "nvme", "ns", parent=K[1])
    assert d.locate(K[0]) is None  # reserved pages are invisible
    assert d.used("nvme") == 1
    d.commit(K[0], "nvme")
    assert d.locate(K[0]) == "nvme" and d.tiers_of(K[0]) == ["nvme"]
    d.reserve(K[0], "dram")
    d.commit(K[0], "dram")
    assert d.locate(K[0]) == "dram" and d.below(K[0], "dram")
    assert d.get(K[0]).parent == K[1]  # type: ignore[union-attr]
    d.begin_evict(K[0], "dram")
    assert d.locate(K[0]) == "dram"  # still readable until removed
    assert not d.evictable(K[0], "dram")
    d.remove(K[0], "dram")
    assert rec.events == [
        ("commit", K[0], "nvme"),
        ("commit", K[0], "dram"),
        ("remove", K[0], "dram"),
    ]
    unsubscribe()
    d.begin_evict(K[0], "nvme")
    d.remove(K[0], "nvme")
    assert len(rec.events) == 3  # unsubscribed
    assert K[0] not in d and len(d) == 0
    d.check_invariants()


def test_pins_and_copies_block_eviction():
    d = Directory(TIERS)
    d.reserve(K[0], "dram")
    d.commit(K[0], "dram")
    d.pin(K[0])
    assert not d.evictable(K[0], "dram") and d.pinned("dram") == 1
    with pytest.raises(DirectoryError, match="pinned or in flight"):
        d.begin_evict(K[0], "dram")
    d.unpin(K[0])
    d.begin_copy(K[0], "dram")
    assert not d.evictable(K[0], "dram") and d.busy("dram") == 1
    with pytest.raises(DirectoryError, match="pinned or in flight"):
        d.begin_evict(K[0], "dram")
    d.end_copy(K[0], "dram")
    assert d.evictable(K[0], "dram")
    with pytest.raises(DirectoryError, match="not pinned"):
        d.unpin(K[0])


@pytest.mark.parametrize(
    ("steps", "match"),
    [
        (["reserve", "reserve"], "already reserved"),
        (["commit"], "cannot commit"),
        (["reserve", "begin_evict"], "cannot evict"),
        (["reserve", "remove"], "cannot remove"),
        (["reserve", "commit", "abort"], "cannot abort"),
        (["reserve", "commit", "cancel_evict"], "cannot cancel eviction"),
        (["begin_copy"], "not readable"),
        (["end_copy"], "no copy"),
    ],
)
def test_illegal_transitions_raise(steps, match):
    d = Directory(TIERS)
    with pytest.raises(DirectoryError, match=match):
        for step in steps:
            fn = getattr(d, step)
            fn(K[0], "dram")


def test_unknown_tier_and_bad_tiers():
    d = Directory(TIERS)
    with pytest.raises(DirectoryError, match="unknown tier 'gpu'"):
        d.reserve(K[0], "gpu")
    with pytest.raises(DirectoryError, match="unique"):
        Directory(["a", "a"])


def test_check_invariants_detects_corruption():
    d = Directory(TIERS)
    d.reserve(K[0], "dram")
    d.check_invariants()
    d._counts["dram"][PageState.COMMITTED] += 1  # simulate a lost update
    with pytest.raises(DirectoryError, match="differ from recount"):
        d.check_invariants()


class DirectoryMachine(RuleBasedStateMachine):
    """Random transitions; the directory must agree with a dict model at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Directory(TIERS)
        self.rec = Recorder()
        self.d.subscribe(self.rec)
        self.states: dict[tuple[bytes, str], PageState] = {}
        self.pins: dict[bytes, int] = {}
        self.copies: dict[tuple[bytes, str], int] = {}
        self.visible: set[tuple[bytes, str]] = set()  # from listener events

    keys = st.sampled_from(K)
    tiers = st.sampled_from(TIERS)

    def _expect_error(self, fn, *args) -> None:
        with pytest.raises(DirectoryError):
            fn(*args)

    @rule(key=keys, tier=tiers)
    def reserve(self, key, tier):
        if (key, tier) in self.states:
            self._expect_error(self.d.reserve, key, tier)
            return
        self.d.reserve(key, tier)
        self.states[(key, tier)] = PageState.RESERVED

    @rule(key=keys, tier=tiers)
    def commit(self, key, tier):
        if self.states.get((key, tier)) is not PageState.RESERVED:
            self._expect_error(self.d.commit, key, tier)
            return
        self.d.commit(key, tier)
        self.states[(key, tier)] = PageState.COMMITTED

    @rule(key=keys, tier=tiers)
    def abort(self, key, tier):
        if self.states.get((key, tier)) is not PageState.RESERVED:
            self._expect_error(self.d.abort, key, tier)
            return
        self.d.abort(key, tier)
        del self.states[(key, tier)]

    @rule(key=keys, tier=tiers)
    def begin_evict(self, key, tier):
        ok = (
            self.states.get((key, tier)) is PageState.COMMITTED
            and not self.pins.get(key)
            and not self.copies.get((key, tier))
        )
        assert self.d.evictable(key, tier) == ok
        if not ok:
            self._expect_error(self.d.begin_evict, key, tier)
            return
        self.d.begin_evict(key, tier)
        self.states[(key, tier)] = PageState.EVICTING

    @rule(key=keys, tier=tiers)
    def cancel_evict(self, key, tier):
        if self.states.get((key, tier)) is not PageState.EVICTING:
            self._expect_error(self.d.cancel_evict, key, tier)
            return
        self.d.cancel_evict(key, tier)
        self.states[(key, tier)] = PageState.COMMITTED

    @rule(key=keys, tier=tiers)
    def remove(self, key, tier):
        state = self.states.get((key, tier))
        if state not in (PageState.COMMITTED, PageState.EVICTING) or self.copies.get((key, tier)):
            self._expect_error(self.d.remove, key, tier)
            return
        self.d.remove(key, tier)
        del self.states[(key, tier)]

    @rule(key=keys)
    def pin(self, key):
        self.d.pin(key)
        self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(key=keys)
    def unpin(self, key):
        if not self.pins.get(key):
            self._expect_error(self.d.unpin, key)
            return
        self.d.unpin(key)
        self.pins[key] -= 1

    @rule(key=keys, tier=tiers)
    def begin_copy(self, key, tier):
        if self.states.get((key, tier)) not in (PageState.COMMITTED, PageState.EVICTING):
            self._expect_error(self.d.begin_copy, key, tier)
            return
        self.d.begin_copy(key, tier)
        self.copies[(key, tier)] = self.copies.get((key, tier), 0) + 1

    @rule(key=keys, tier=tiers)
    def end_copy(self, key, tier):
        if not self.copies.get((key, tier)):
            self._expect_error(self.d.end_copy, key, tier)
            return
        self.d.end_copy(key, tier)
        self.copies[(key, tier)] -= 1

    @invariant()
    def agrees_with_model(self):
        self.d.check_invariants()
        for key in K:
            for tier in TIERS:
                assert self.d.state(key, tier) == self.states.get((key, tier))
            visible = [
                t
                for t in TIERS
                if self.states.get((key, t)) in (PageState.COMMITTED, PageState.EVICTING)
            ]
            assert self.d.tiers_of(key) == visible
            assert self.d.is_pinned(key) == bool(self.pins.get(key))
        for tier in TIERS:
            assert self.d.pinned(tier) == sum(
                1 for key in K if self.pins.get(key) and (key, tier) in self.states
            )
            assert self.d.busy(tier) == sum(1 for key in K if self.copies.get((key, tier)))
            live = (
                any((key, t) in self.states for t in TIERS)
                or self.pins.get(key)
                or any(self.copies.get((key, t)) for t in TIERS)
            )
            assert (key in self.d) == bool(live)  # no leaked or lost entries
        for tier in TIERS:
            assert self.d.used(tier) == sum(1 for (_, t) in self.states if t == tier)

    @invariant()
    def listeners_see_every_commit_and_remove(self):
        visible: set[tuple[bytes, str]] = set()
        for kind, key, tier in self.rec.events:
            if kind == "commit":
                visible.add((key, tier))
            else:
                visible.discard((key, tier))
        model = {
            kt for kt, s in self.states.items() if s in (PageState.COMMITTED, PageState.EVICTING)
        }
        assert visible == model


TestDirectoryMachine = DirectoryMachine.TestCase
TestDirectoryMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
