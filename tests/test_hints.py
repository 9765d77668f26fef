"""Engine hints: the model, the trace format, the ``hinted`` policy, and the goals on
chat-like traffic (exact hints close to MIN, wrong hints never below no hints)."""

from __future__ import annotations

import functools
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.eviction import make_policy
from kvtier.policy.hinted import HintedPolicy
from kvtier.policy.hints import Hint, hint_target, make_hint, parse_hint
from kvtier.policy.prefix_cut import PrefixCutPolicy
from kvtier.sim.belady import belady_min
from kvtier.sim.hintnoise import corrupt_hints
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import block_key, read_mooncake
from kvtier.sim.workloads import workload


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def every(_key: PageKey) -> bool:
    return True


def test_hint_validation_names_the_problem() -> None:
    assert make_hint("next_turn", [k(1)], 3).value == 3.0
    with pytest.raises(KVTierUsageError, match="unknown hint kind 'later'"):
        make_hint("later", [k(1)])
    with pytest.raises(KVTierUsageError, match="needs a finite number"):
        make_hint("ttl", [k(1)])
    with pytest.raises(KVTierUsageError, match="takes no value"):
        make_hint("close", [k(1)], 2.0)
    with pytest.raises(KVTierUsageError, match="> 0"):
        make_hint("priority", [k(1)], 0)
    with pytest.raises(KVTierUsageError, match="keys\\[0\\]"):
        make_hint("pin", [b"short"])  # type: ignore[list-item]
    with pytest.raises(KVTierUsageError, match="not a single key"):
        make_hint("pin", k(1))
    with pytest.raises(KVTierUsageError, match=r"t\.jsonl:3: field 'hash_ids'"):
        parse_hint({"hint": "pin", "hash_ids": "x"}, block_key, "t.jsonl:3")


def test_the_hint_dataclass_checks_what_make_hint_checks() -> None:
    """``Hint`` itself (documented, so built directly too) turns real numbers into floats
    and key lists into tuples, and names what it refuses."""
    assert Hint("ttl", (), np.float32(5)).value == 5.0
    assert type(Hint("next_turn", (), np.int64(5)).value) is float
    assert Hint("open", [k(1)]).keys == (k(1),)  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match=r"integer too large for a float \(401 digits\)"):
        Hint("ttl", (), 10**400)
    with pytest.raises(
        KVTierUsageError, match=r"value Fraction\(.*\.\.\. is beyond the float range"
    ):
        make_hint("ttl", [], Fraction(10**400, 3))  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match=r"needs a finite number value, got np\.True_"):
        Hint("ttl", (), np.bool_(True))  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match="sequence of page keys"):
        Hint("pin", k(1))  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match="sequence of page keys"):
        Hint("pin", None)  # type: ignore[arg-type]


def test_trace_reader_takes_hint_lines(tmp_path: Path) -> None:
    f = tmp_path / "h.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 10, "hint": "next_turn", "hash_ids": [0, 1], "value": 30.0},
        {"timestamp": 20, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 30, "hint": "close", "hash_ids": [2]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = read_mooncake(f)
    assert len(tr.requests) == 2
    # The close after the last request precedes nothing and is dropped.
    assert [(h.before, h.hint.kind, h.hint.value) for h in tr.hints] == [(1, "next_turn", 30.0)]
    assert tr.hints[0].hint.keys == (block_key(0), block_key(1))
    assert tr.head(1).hints == []
    assert [h.before for h in tr.slice(1, 2).hints] == [0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hint": "nap", "hash_ids": [1]}\n')
    with pytest.raises(KVTierUsageError, match=r"bad\.jsonl:1: unknown hint kind"):
        read_mooncake(bad)


def test_hinted_victim_order() -> None:
    p = HintedPolicy(fallback="lru")
    p.on_time(100.0)
    for i in range(1, 7):
        p.on_insert(k(i))
    p.on_hint(Hint("pin", (k(1),)), 100.0)
    p.on_hint(Hint("next_turn", (k(2),), 50.0), 100.0)  # wanted at 150
    p.on_hint(Hint("next_turn", (k(3),), 5.0), 100.0)  # wanted at 105
    p.on_hint(Hint("close", (k(4),)), 100.0)
    p.on_hint(Hint("ttl", (k(5),), 10.0), 100.0)
    # 4 is dead; 5 and 6 have no live prediction (fallback LRU: 5 before 6); then the
    # furthest predicted use (2 before 3); the pinned page last.
    assert p.victims(6, every) == [k(4), k(5), k(6), k(2), k(3), k(1)]
    p.on_time(111.0)  # 5's ttl ran out: dead now; 3 is late but not yet overdue (105+5+1)
    assert p.victims(2, every) == [k(4), k(5)]
    p.on_time(200.0)  # 3 is overdue (>111): back to the fallback's order
    assert p.victims(4, every)[:4] == [k(4), k(5), k(3), k(6)]
    p.on_access(k(4))  # a closed page used again: the hint was wrong, it lives
    assert k(4) not in p.victims(1, every)
    p.on_hint(Hint("unpin", (k(1),)), 200.0)
    assert p.victims(6, every)[-1] != k(1)


def test_hinted_forecasts_shared_pages_by_their_unforeseen_rate() -> None:
    p = HintedPolicy(fallback="lru")
    prompt, session, once, foretold, twice = k(1), k(2), k(3), k(4), k(5)
    p.on_time(0.0)
    p.on_insert(prompt)
    p.on_insert(foretold)
    for t in (2.0, 4.0):
        p.on_hint(Hint("next_turn", (foretold,), 2.0), t - 2.0)
        p.on_time(t)
        p.on_access(prompt)  # a new session reuses the prompt: no hint foretold it
        p.on_access(foretold)  # its hint foretold this use: no rate from it
    p.on_time(6.0)
    p.on_access(prompt)
    p.on_insert(session)
    p.on_hint(Hint("next_turn", (session,), 100.0), 6.0)  # wanted at 106
    p.on_insert(once)
    p.on_insert(twice)
    p.on_access(twice)  # the same request touching it twice: one reference
    # No forecast (fallback LRU: foretold, once, twice), then the furthest forecast:
    # the session page (106) before the prompt (its rate: every 2 s, next at 8).
    assert p.victims(5, every) == [foretold, once, twice, session, prompt]
    # Evicted and fetched again, the prompt keeps its rate: four uses 0-6, one at 30,
    # every 7.5 s on average, next at 37.5 (still before the session's 106).
    p.on_remove(prompt)
    p.on_time(30.0)
    p.on_insert(prompt)
    assert p.victims(5, every)[-2:] == [session, prompt]
    # At 300 the session is overdue (past 6 + 2 x 100 + 1): no forecast for its page any
    # more; the prompt's wait stretches its rate (300 + 300 / 4) but it keeps one.
    p.on_time(300.0)
    assert p.victims(5, every)[-1] == prompt
    assert p.victims(5, every).index(session) < 3


def test_hinted_rejects_a_bad_rate_history() -> None:
    with pytest.raises(ConfigError, match="rate_history"):
        HintedPolicy(rate_history=-1)


def test_hinted_keeps_hints_for_pages_not_yet_held() -> None:
    p = HintedPolicy(fallback="lru")
    p.on_hint(Hint("pin", (k(9),)), 0.0)  # the system prompt is pinned before it is stored
    p.on_insert(k(9))
    p.on_insert(k(8))
    assert p.victims(1, every) == [k(8)]
    p.on_hint(Hint("close", (k(8),)), 1.0)
    p.on_insert(k(8))  # already held: a reference, which revives it
    p.on_hint(Hint("unpin", (k(9),)), 2.0)
    assert p.victims(1, every) == [k(9)]


def test_hint_target_unwraps_wrappers() -> None:
    inner = HintedPolicy()
    assert hint_target(PrefixCutPolicy(inner)) is inner
    assert hint_target(make_policy("lru")) is None
    assert hint_target(make_policy("adaptive")) is not None


def test_replay_gives_hints_only_when_asked() -> None:
    tr = workload("chat", n=300, seed=1)
    assert tr.hints
    pols: list[HintedPolicy] = []

    def fac() -> HintedPolicy:
        pols.append(HintedPolicy())
        return pols[-1]

    replay(tr, make_tiers([40], fac))
    replay(tr, make_tiers([40], fac), hints=True)
    assert pols[0].hints_seen == 0 and pols[1].hints_seen == len(tr.hints)


def test_corrupt_hints_changes_the_share_asked() -> None:
    tr = workload("tenants", n=400, seed=2)
    bad = corrupt_hints(tr, 0.5, seed=3)
    assert len(bad.hints) == len(tr.hints)
    changed = sum(a.hint != b.hint for a, b in zip(tr.hints, bad.hints, strict=True))
    assert 0.35 * len(tr.hints) < changed < 0.65 * len(tr.hints)
    assert corrupt_hints(tr, 0.0).hints == tr.hints
    with pytest.raises(KVTierUsageError, match="share"):
        corrupt_hints(tr, 1.5)


def _rate(trace: object, cap: int, policy: str, hints: bool = True) -> float:
    """Prefix hit rate of ``policy`` on ``trace``, with or without its hints."""
    res = replay(trace, make_tiers([cap], functools.partial(make_policy, policy)), hints=hints)  # type: ignore[arg-type]
    return res.prefix_hit_rate


@pytest.mark.parametrize("name", ["chat", "bursty", "tenants"])
def test_exact_hints_reach_0_8_of_min_at_1_percent(name: str) -> None:
    tr = workload(name, n=2000, seed=5)
    cap = max(1, tr.distinct_blocks() // 100)
    ceiling = belady_min([r.blocks for r in tr.requests], cap).prefix_hit_rate
    with_hints = _rate(tr, cap, "adaptive")
    without = _rate(tr, cap, "adaptive", hints=False)
    assert with_hints >= 0.8 * ceiling
    assert with_hints > without


@pytest.mark.parametrize(
    ("name", "seed"),
    # toolagent seed 2: half-wrong hints led for a while and ended 0.0002 below no hints
    # before the hint audit barred their expert (kvtier/policy/hint_audit.py)
    [("chat", 6), ("tenants", 6), ("toolagent", 2)],
)
def test_half_wrong_hints_never_below_no_hints(name: str, seed: int) -> None:
    tr = workload(name, n=2000, seed=seed)
    cap = max(1, tr.distinct_blocks() // 100)
    without = _rate(tr, cap, "adaptive", hints=False)
    half_wrong = _rate(corrupt_hints(tr, 0.5, seed=seed + 1), cap, "adaptive")
    assert half_wrong >= without


def test_own_pages_leave_out_prefixes_other_sequences_continue() -> None:
    from kvtier.policy.prefix_cut import PageForest

    f = PageForest()
    p0, p1, a0, a1, b0 = k(1), k(2), k(3), k(4), k(5)
    f.add(p0, None)
    f.add(p1, p0)
    f.add(a0, p1)
    f.add(a1, a0)
    assert f.own_pages((p0, p1, a0, a1)) == (p0, p1, a0, a1)  # nobody else continues it
    f.add(b0, p1)  # another session under the same prompt
    assert f.own_pages((p0, p1, a0, a1)) == (a0, a1)
    f.remove(b0)  # evicted: the prompt was still a branch point
    assert f.own_pages((p0, p1, a0, a1)) == (a0, a1)
    assert f.own_pages((p1, b0)) == (b0,)


def test_close_hints_naming_the_shared_prompt_too_still_pay(tmp_path: Path) -> None:
    """An engine that names a session's whole context in its ``close`` (its system
    prompt included, which other sessions go on using): ``adaptive`` closes the pages no
    other sequence continues. Before, every such close was judged wrong when the prompt
    was used again, the audit barred the hints, and exact hints gained nothing (a
    docs-only probe: 0.4757 with and without hints at 1 %)."""
    import dataclasses

    tr = workload("chat", n=2000, seed=5)
    prompt_of = {tuple(r.blocks[2:]): tuple(r.blocks[:2]) for r in tr.requests}
    whole = []
    for h in tr.hints:
        if h.hint.kind == "close":
            keys = prompt_of[h.hint.keys] + h.hint.keys
            h = dataclasses.replace(h, hint=Hint("close", keys))
        whole.append(h)
    named_whole = dataclasses.replace(tr, hints=whole)
    assert sum(h.hint.kind == "close" for h in whole) > 100
    cap = max(1, tr.distinct_blocks() // 100)
    ceiling = belady_min([r.blocks for r in tr.requests], cap).prefix_hit_rate
    without = _rate(tr, cap, "adaptive", hints=False)
    own = _rate(tr, cap, "adaptive")
    with_whole = _rate(named_whole, cap, "adaptive")
    assert with_whole >= 0.8 * ceiling and with_whole > without + 0.02
    assert abs(with_whole - own) < 0.01


async def test_live_cache_hints_reach_the_policy() -> None:
    import numpy as np

    from kvtier.cache import KVCache

    cfg = {
        "model": {"preset": "tiny"},
        # the bare policy's order (the leaf-first wrapper offers one leaf per chain a call)
        "pipeline": {"leaf_first": False},
        "tiers": [
            {
                "name": "dram",
                "backend": "dram",
                "capacity": 8 * 512,
                "high_watermark": 1.0,
                "low_watermark": 1.0,
                "eviction": "hinted",
                "eviction_params": {"fallback": "lru"},
            }
        ],
    }
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        a = np.arange(0, 16, dtype=np.uint32)  # 4 pages, stored first (LRU would drop them)
        b = np.arange(100, 116, dtype=np.uint32)
        ka = (await cache.store(a, np.zeros((4, 512), np.uint8))).keys
        kb = (await cache.store(b, np.zeros((4, 512), np.uint8))).keys
        cache.hint("close", kb)  # b's session is over: its pages go first, not a's
        cache.hint("next_turn", ka, 30.0)
        await cache.store(np.arange(200, 208, dtype=np.uint32), np.zeros((2, 512), np.uint8))
        assert all(cache.directory.is_committed(k, "dram") for k in ka)
        assert sum(cache.directory.is_committed(k, "dram") for k in kb) == 2
        assert cache.metrics.raw()["counters"]["kvtier_hints_total"]["kind=close"] == 1
        with pytest.raises(KVTierUsageError, match="unknown hint kind"):
            cache.hint("someday", ka)
        with pytest.raises(KVTierUsageError, match="hint keys"):
            cache.hint("close", [b"x"])  # type: ignore[list-item]
