"""The cost model against hand arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import KVTierUsageError
from kvtier.sim.cost import (
    article_table,
    decode_step_seconds,
    evaluate,
    kv_bytes_per_token,
    prefill_seconds,
    transfer_seconds,
    ttft_seconds,
)
from kvtier.sim.hardware import MODEL_COMPUTE, HardwareProfile, LinkProfile, profile
from kvtier.sim.replay import ReplayResult
from kvtier.spec import preset

HW = HardwareProfile(
    "hand",
    gpus=1,
    flops=1e12,
    mem_bw=1e9,
    mem_bytes=1e9,
    links={"hbm": LinkProfile(1e12), "dram": LinkProfile(1e9, 0.001)},
)


def test_prefill_and_transfer_by_hand() -> None:
    spec = preset("tiny")  # 2 layers, 2 kv heads, dim 8, fp16: 2*2*8*2*2 = 128 B/token
    mc = MODEL_COMPUTE["tiny"]  # 1e6 params, q width 16
    assert kv_bytes_per_token(spec) == 128
    # 10 new tokens after 20 cached: 2*1e6*10 + 2*(2*16*2*10*(20+5)) FLOPs
    flops = 2 * 1e6 * 10 + 2 * (2 * mc.q_width * 2 * 10 * (20 + 10 / 2))
    assert prefill_seconds(spec, HW, 10, 20) == pytest.approx(flops / 1e12)
    # 1000 tokens from dram: 1 ms + 128000 B / 1e9 B/s
    assert transfer_seconds(spec, HW, {"dram": 1000}) == pytest.approx(0.001 + 128e-6)
    assert transfer_seconds(spec, HW, {"dram": 0}) == 0.0
    assert ttft_seconds(2.0, 1.0, 4) == pytest.approx(2.25)
    # decode: (2e6 weight bytes + 4 * 100 * 128) / 1e9
    assert decode_step_seconds(spec, HW, 4, 100) == pytest.approx((2e6 + 51200) / 1e9)
    with pytest.raises(KVTierUsageError, match="no tier 'nvme'"):
        transfer_seconds(spec, HW, {"nvme": 1})
    with pytest.raises(KVTierUsageError, match="unknown hardware profile"):
        profile("nope")


def test_evaluate_by_hand() -> None:
    spec = preset("tiny")
    res = ReplayResult(
        tiers=["hbm", "dram"],
        capacities=[1, 1],
        refs=4,
        requests=2,
        prefix_hits={"hbm": 1, "dram": 1},
        pages_moved={},
        req_hits=np.array([[0, 0], [1, 1]], dtype=np.int32),
        req_blocks=np.array([2, 2]),
        req_input_tokens=np.array([8, 8]),
        req_output_tokens=np.array([0, 0]),
        req_arrival_s=np.array([0.0, 1.0]),
        block_tokens=4,
    )
    cost = evaluate(res, spec, HW, batch=1)
    t0 = prefill_seconds(spec, HW, 8, 0)
    t1c = prefill_seconds(spec, HW, 0, 8)
    t1x = transfer_seconds(spec, HW, {"dram": 4})  # hbm hits are free
    t1 = ttft_seconds(t1c, t1x, spec.num_layers)
    assert cost.ttft_mean_s == pytest.approx((t0 + t1) / 2)
    assert cost.prefill_saved == pytest.approx(8 / 16)
    assert (cost.fetches, cost.fetches_hidden) == (1, 0)  # no compute to hide behind
    assert cost.throughput_tok_s == pytest.approx(16 / (t0 + t1))


def test_article_table_shape() -> None:
    rows = article_table(preset("llama3-70b"), profile("h200-gen5"))
    assert [r.config for r in rows[:3]] == ["HBM only", "+ DRAM", "+ DRAM + NVMe"]
    for ctx_rows in (rows[:3], rows[3:]):
        cached = [r.sessions_cached for r in ctx_rows]
        gains = [r.throughput_rel for r in ctx_rows]
        hit_ttft = [r.ttft_hit_s for r in ctx_rows]
        assert cached == sorted(cached) and gains == sorted(gains)  # more room, more hits
        assert hit_ttft[2] > hit_ttft[0]  # a hit served from NVMe waits longer
