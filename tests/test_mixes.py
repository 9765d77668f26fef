"""The workloads of :mod:`kvtier.sim.mixes` have the trait each is named for (the common
checks, seeded and prefix-consistent, are in ``tests/test_scenarios.py``)."""

from __future__ import annotations

import statistics
from collections import Counter

from kvtier.sim.workloads import workload


def test_rotation_serves_one_tenant_at_a_time_and_comes_back_to_the_first() -> None:
    tr = workload("rotation", n=2000, seed=0, tenants=4, turn=250)
    tenant_of = [r.blocks[0] for r in tr.requests]  # each tenant's own system prompt
    for start in range(0, 2000, 250):
        turn = Counter(tenant_of[start : start + 250])
        assert turn.most_common(1)[0][1] > 0.8 * 250  # loyal 0.9, plus chance
    first, back = Counter(tenant_of[:250]), Counter(tenant_of[1000:1250])
    assert first.most_common(1)[0][0] == back.most_common(1)[0][0]  # the first returns
    middle = Counter(tenant_of[250:1000])
    assert middle[first.most_common(1)[0][0]] < 0.1 * 750  # away in between
    assert len(set(tenant_of)) == 4


def test_longchat_grows_long_conversations_with_heavy_tailed_pauses() -> None:
    tr = workload("longchat", n=3000, seed=0)
    last_seen: dict[tuple[int, ...], float] = {}
    gaps: list[float] = []
    continued = 0
    for r in tr.requests:
        for cut in range(len(r.blocks) - 1, 0, -1):  # the longest earlier request it extends
            earlier = last_seen.pop(tuple(r.blocks[:cut]), None)
            if earlier is not None:
                gaps.append(r.timestamp_s - earlier)
                continued += 1
                break
        last_seen[tuple(r.blocks)] = r.timestamp_s
    assert continued > 0.85 * len(tr.requests)  # 10-60 turns a conversation
    assert min(gaps) >= 5.0
    assert max(gaps) > 20 * statistics.median(gaps)  # Pareto think times


def test_templates_share_several_levels_and_end_in_one_off_queries() -> None:
    tr = workload("templates", n=3000, seed=0)
    count = Counter(blk for r in tr.requests for blk in r.blocks)
    roots = {r.blocks[0] for r in tr.requests}
    assert len(roots) <= 4
    assert all(count[r.blocks[-1]] == 1 for r in tr.requests)  # the query
    depth = Counter(sum(count[blk] > 1 for blk in r.blocks) for r in tr.requests)
    assert statistics.median(depth.elements()) >= 4  # system, template, example blocks
    assert len({r.blocks[-2] for r in tr.requests}) > 100  # many examples in use


def test_sizes_mixes_short_prompts_with_very_long_documents() -> None:
    tr = workload("sizes", n=3000, seed=0)
    lengths = [len(r.blocks) for r in tr.requests]
    assert statistics.median(lengths) <= 6
    long = sum(n >= 100 for n in lengths)
    assert 0.08 * len(lengths) < long < 0.25 * len(lengths)  # doc_share 0.15
    assert max(lengths) > 150


def test_uniform_has_no_favourite_prefix() -> None:
    tr = workload("uniform", n=6000, seed=0)
    docs = Counter(r.blocks[1] for r in tr.requests)
    assert len(docs) > 1300  # nearly all of the 1,500 drawn
    assert docs.most_common(1)[0][1] < 6 * len(tr.requests) / 1500
    zipf = Counter(r.blocks[1] for r in workload("zipf", n=6000, seed=0).requests)
    assert zipf.most_common(1)[0][1] > 50 * len(tr.requests) / 1500  # what skew looks like
