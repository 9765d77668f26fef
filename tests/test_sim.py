"""Trace readers, replay semantics on hand-computed cases, replay properties on an excerpt
of the Mooncake trace (``tests/data``), synthetic workloads and ``kvtier bench sim``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtier.policy  # noqa: F401
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.policy.admission import FrequencyAdmission
from kvtier.policy.eviction import LRUPolicy, make_policy
from kvtier.policy.prefetch import LookaheadPredictor
from kvtier.sim.belady import belady_min
from kvtier.sim.replay import SimTier, make_tiers, replay
from kvtier.sim.trace import Trace, read_azure_arrivals, read_mooncake, requests_from_ids
from kvtier.sim.workloads import WORKLOADS, workload

#: The first 400 requests of the Mooncake conversation trace (source, licence: the README
#: beside it); the full trace is for benchmarks (``kvtier bench sim --trace FILE``).
MOONCAKE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head400.jsonl"


def k(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def trace_of(*reqs: list[int]) -> Trace:
    rows = [(float(i), 4 * len(r), 1, r) for i, r in enumerate(reqs)]
    return Trace("t", 4, requests_from_ids(rows, 4))


def test_read_mooncake_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 2]}\n'
    )
    tr = read_mooncake(f, 512)
    assert len(tr.requests) == 2 and tr.total_refs == 4 and tr.distinct_blocks() == 3
    assert tr.requests[1].timestamp_s == 1.5
    assert tr.requests[0].last_partial and not tr.requests[1].last_partial
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}\n')
    with pytest.raises(KVTierUsageError, match=r"bad.jsonl:1: field 'hash_ids'"):
        read_mooncake(bad)
    with pytest.raises(KVTierUsageError, match="not found"):
        read_mooncake(tmp_path / "missing.jsonl")


def test_read_azure_arrivals(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:48.1805900,10,2\n"
    )
    arr = read_azure_arrivals(f)
    assert [a.context_tokens for a in arr] == [374, 10]
    assert arr[1].timestamp_s == pytest.approx(1.5)
    (tmp_path / "b.csv").write_text("x,y\n")
    with pytest.raises(KVTierUsageError, match="header"):
        read_azure_arrivals(tmp_path / "b.csv")


def test_replay_lru_hand_computed() -> None:
    # capacity 2, LRU. r0 [1,2]: miss miss. r1 [1,3]: 1 hit; 3 evicts 2. r2 [1,2]: 1 hit,
    # 2 miss (evicts 3). r3 [1,3]: 1 hit, 3 miss.
    tr = trace_of([1, 2], [1, 3], [1, 2], [1, 3])
    res = replay(tr, make_tiers([2], LRUPolicy, ["hbm"]))
    assert res.prefix_hits == {"hbm": 3}
    assert res.refs == 8
    assert res.req_hits[:, 0].tolist() == [0, 1, 1, 1]
    assert res.pages_moved == {"compute->hbm": 5}


def test_replay_prefix_stops_at_first_miss() -> None:
    # [1,2] then [3,2]: 2 is resident but behind a miss: not a prefix hit.
    res = replay(trace_of([1, 2], [3, 2]), make_tiers([10], LRUPolicy))
    assert res.total_prefix_hits == 0


def test_replay_two_tiers_write_back_moves_victims_down_and_fetches_up() -> None:
    tr = trace_of([1], [2], [1])
    res = replay(tr, make_tiers([1, 4], LRUPolicy, ["hbm", "dram"]), "write-back")
    # r1 evicts 1 to dram; r2 finds 1 in dram (hit of dram), fetches it up, evicts 2 down.
    assert res.prefix_hits == {"hbm": 0, "dram": 1}
    assert res.pages_moved == {"compute->hbm": 2, "hbm->dram": 2, "dram->hbm": 1}


def test_replay_write_through_writes_every_page_down() -> None:
    tr = trace_of([1, 2], [1, 2])
    res = replay(tr, make_tiers([4, 4], LRUPolicy, ["hbm", "dram"]), "write-through")
    assert res.pages_moved["hbm->dram"] == 2
    assert res.prefix_hits == {"hbm": 2, "dram": 0}


def test_replay_selective_write_uses_admission_of_lower_tier() -> None:
    tr = trace_of([1], [1], [2], [3])
    tiers = [
        SimTier("hbm", 1, LRUPolicy()),
        SimTier("dram", 4, LRUPolicy(), FrequencyAdmission(threshold=2)),
    ]
    res = replay(tr, tiers, "selective")
    # Only page 1 (referenced twice) is admitted below, when 2 evicts it.
    assert tiers[1].resident == {k(1)}
    assert res.pages_moved.get("hbm->dram") == 1


def test_replay_pins_the_running_request() -> None:
    # The loaded prefix is pinned while the request runs: r1 [1,2,3] stores in batches of
    # 2 (the tier's watermark), 3 evicts 1; r2 [2,3,4] hits 2 and 3 (pinned), so 4 finds
    # no room and is dropped (the live cache raises CapacityError there).
    tiers = make_tiers([2], LRUPolicy)
    res = replay(trace_of([1, 2, 3], [2, 3, 4]), tiers)
    assert res.req_hits[:, 0].tolist() == [0, 2]
    assert tiers[0].resident == {k(2), k(3)}


def test_replay_errors() -> None:
    tr = trace_of([1])
    with pytest.raises(KVTierUsageError, match="write policy"):
        replay(tr, make_tiers([1], LRUPolicy), "nope")  # type: ignore[arg-type]
    with pytest.raises(KVTierUsageError, match="at least one tier"):
        replay(tr, [])
    with pytest.raises(KVTierUsageError, match="capacity"):
        SimTier("x", -1, LRUPolicy())


def test_replay_prefetch_counts_useful_pages() -> None:
    # hbm 2 pages, dram below (LRU, write-back). After [1] the lookahead predictor
    # expects 2 (it followed 1 before); 2 sits in dram, so it is pulled up (evicting 4),
    # and the next request [1, 2] finds both pages in hbm.
    tr = trace_of([1, 2], [3], [4], [1], [1, 2])
    pred = LookaheadPredictor(lookahead=1, threshold=0.5)
    res = replay(tr, make_tiers([2, 8], LRUPolicy, ["hbm", "dram"]), predictor=pred)
    assert res.prefetch == {"issued": 1, "useful": 1, "wasted": 0}
    assert res.prefix_hits == {"hbm": 2, "dram": 1}
    assert res.pages_moved["prefetch->hbm"] == 1
    plain = replay(tr, make_tiers([2, 8], LRUPolicy, ["hbm", "dram"]))
    assert plain.prefix_hits == {"hbm": 1, "dram": 2} and plain.prefetch == {}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_follow_the_prefix_rule(name: str) -> None:
    tr = workload(name, n=300, seed=3)
    assert len(tr.requests) > 0
    assert all(
        a.timestamp_s <= b.timestamp_s for a, b in zip(tr.requests, tr.requests[1:], strict=False)
    )
    parent: dict[PageKey, PageKey | None] = {}
    for r in tr.requests:
        prev = None
        for b in r.blocks:
            assert parent.setdefault(b, prev) == prev  # a block id fixes its whole prefix
            prev = b
    with pytest.raises(KVTierUsageError, match="unknown workload"):
        workload("nope")


def test_mooncake_excerpt_reads_and_replays_consistently() -> None:
    """The reader agrees with the raw JSON; LRU and MIN meet the infinite-cache hit rate
    (every re-reference hits: the trace reuses only prefixes) when the cache holds every
    block, and LRU stays at or under MIN when it holds 5 %."""
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    refs = sum(len(r["hash_ids"]) for r in rows)
    distinct = len({h for r in rows for h in r["hash_ids"]})
    tr = read_mooncake(MOONCAKE)
    assert (len(tr.requests), tr.total_refs, tr.distinct_blocks()) == (len(rows), refs, distinct)
    infinite = (refs - distinct) / refs
    for cap in (distinct, max(1, distinct // 20)):
        lru = replay(tr, make_tiers([cap], LRUPolicy))
        ceiling = belady_min([r.blocks for r in tr.requests], cap)
        assert lru.prefix_hit_rate <= ceiling.prefix_hit_rate <= infinite + 1e-12
        if cap == distinct:
            assert lru.prefix_hit_rate == pytest.approx(infinite)
            assert ceiling.prefix_hit_rate == pytest.approx(infinite)


@pytest.mark.parametrize("policy", ["lru-k", "arc", "s3-fifo", "prefix-lru", "session"])
def test_policies_on_trace_head_stay_below_min(policy: str) -> None:
    tr = read_mooncake(MOONCAKE, limit=3000)
    cap = max(1, tr.distinct_blocks() // 50)
    res = replay(tr, make_tiers([cap], lambda: make_policy(policy)))
    ceiling = belady_min([r.blocks for r in tr.requests], cap)
    assert 0 < res.prefix_hit_rate <= ceiling.prefix_hit_rate


def test_cli_bench_sim_json_and_plot(tmp_path: Path) -> None:
    from kvtier.cli.app import get_app

    png = tmp_path / "p.png"
    out = CliRunner().invoke(
        get_app(),
        [
            "bench",
            "sim",
            "--workload",
            "chat",
            "--requests",
            "400",
            "--capacity",
            "2%",
            "--capacity",
            "10%",
            "--policy",
            "lru",
            "--policy",
            "session",
            "--tiers",
            "hbm,dram",
            "--json",
            "--plot",
            str(png),
            "--no-progress",
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert len(data["runs"]) == 4
    for run in data["runs"]:
        assert run["hit_rate"] <= run["min_hit_rate"] + 1e-12
        assert set(run["hit_rate_per_tier"]) == {"hbm", "dram"}
        assert run["cost"]["ttft_mean_s"] > 0
    assert png.stat().st_size > 1000


def test_cli_bench_sim_usage_errors() -> None:
    from kvtier.cli.app import get_app

    r = CliRunner().invoke(get_app(), ["bench", "sim", "--workload", "chat", "--policy", "nope"])
    assert r.exit_code == 2 and "unknown policy" in r.output
    r = CliRunner().invoke(get_app(), ["bench", "sim"])
    assert r.exit_code == 2 and "exactly one" in r.output
