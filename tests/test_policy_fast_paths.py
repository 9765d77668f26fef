"""The per-call helpers that replaced per-key work in the policies give what the per-key
code gave, on random inputs: a sampled hint (:func:`kvtier.policy.hints.sub_hint`) is the
hint built and checked again, a key sample (:meth:`KeySampler.sample`) is the keys
``keeps`` accepts, and the predictions added for a whole hint
(:func:`kvtier.policy.hint_predict.add_predictions`) are those added key by key."""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict

import pytest

from kvtier.keys import PageKey
from kvtier.policy.hint_predict import Use, add_predictions
from kvtier.policy.hints import Hint, sub_hint
from kvtier.policy.shadow import KeySampler


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


@pytest.mark.parametrize("seed", range(5))
def test_sub_hint_equals_a_checked_hint(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        kind = rng.choice(["next_turn", "open", "close", "ttl", "priority", "pin", "unpin"])
        value = rng.uniform(0.1, 100.0) if kind in ("next_turn", "ttl", "priority") else None
        keys = tuple(k(rng.randrange(1000)) for _ in range(rng.randrange(0, 40)))
        hint = Hint(kind, keys, value)
        part = tuple(x for x in keys if rng.random() < 0.5)
        fast = sub_hint(hint, part)
        assert fast == Hint(kind, part, value)
        assert (fast.kind, fast.keys, fast.value) == (kind, part, hint.value)
    whole = Hint("pin", (k(1), k(2)))
    assert sub_hint(whole, whole.keys) is whole


@pytest.mark.parametrize("halvings", range(5))
def test_key_sample_equals_keeps(halvings: int) -> None:
    sampler = KeySampler()
    for _ in range(halvings):
        sampler.halve()
    rng = random.Random(halvings)
    keys = tuple(k(rng.randrange(10**9)) for _ in range(2000))
    sampled = sampler.sample(keys)
    assert sampled == tuple(x for x in keys if sampler.keeps(x))
    if halvings:
        assert 0 < len(sampled) < len(keys)
    else:
        assert sampled is keys


def _predict_one_by_one(
    keys: tuple[PageKey, ...],
    use: Use,
    predicted: dict[PageKey, list[Use]],
    overdue: list[tuple[float, PageKey]],
    dead: OrderedDict[PageKey, None],
    expiry: dict[PageKey, float],
) -> list[tuple[float, PageKey]]:
    """The per-key code that ``add_predictions`` replaced (``HintedPolicy._predict``)."""
    at, due, tolerance = use
    for key in keys:
        pending = predicted.setdefault(key, [])
        pending.append((at, due, tolerance))
        pending.sort()
        del pending[8:]
        heapq.heappush(overdue, (max(p[1] for p in pending), key))
        if len(overdue) > 4 * len(predicted) + 64:
            overdue = [(max(p[1] for p in pend), x) for x, pend in predicted.items() if pend]
            heapq.heapify(overdue)
        dead.pop(key, None)
        expiry.pop(key, None)
    return overdue


@pytest.mark.parametrize("seed", range(6))
def test_add_predictions_equals_one_key_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    slow: tuple = ({}, [], OrderedDict(), {})
    fast: tuple = ({}, [], OrderedDict(), {})
    for step in range(300):
        pool = rng.choice([20, 200, 2000])
        keys = tuple(k(rng.randrange(pool)) for _ in range(rng.randrange(0, 60)))
        now = step * rng.choice([0.5, 3.0])
        gap = rng.choice([1.0, 5.0, 5.0, 60.0])  # repeated uses: ties in the sort
        use = (now + gap, now + 2 * gap + 1.0, 0.1 * gap + 1.0)
        for state in (slow, fast):  # closes and ttls the predictions clear
            for key in keys[: rng.randrange(0, 4)]:
                state[2][key] = None
                state[3][key] = now + 9.0
        predicted, overdue, dead, expiry = slow
        slow = (predicted, _predict_one_by_one(keys, use, *slow), dead, expiry)
        predicted, overdue, dead, expiry = fast
        fast = (
            predicted,
            add_predictions(keys, use, predicted, overdue, (dead, expiry)),
            dead,
            expiry,
        )
        assert fast[0] == {key: tuple(uses) for key, uses in slow[0].items()}  # as tuples
        assert list(fast[0]) == list(slow[0])  # the same insertion order
        assert fast[1] == slow[1]  # the same heap, entry for entry
        assert list(fast[2]) == list(slow[2])
        assert fast[3] == slow[3]
        if rng.random() < 0.1:  # some pages referenced: their predictions consumed
            for key in list(slow[0])[: rng.randrange(0, 30)]:
                del slow[0][key]
                del fast[0][key]
