"""Cost model: replay results -> time to first token (TTFT) and throughput.

For one request with ``c`` cached prompt tokens (served by tiers) and ``m`` missed tokens:

* prefill compute ``T_c = (2 P m + 2 A m (c + m/2) * L') / F`` where ``P`` is the
  (active) parameter count, ``A`` the attention width (query heads x head dim) times the
  layers, ``F`` the node's effective FLOP/s; ``2 A m (c + m/2)`` covers QK^T and AV
  over the cached and the causal new context (``L'`` folded into ``A``);
* KV transfer ``T_x = sum over tiers t of latency_t + bytes_t / bandwidth_t`` for the
  cached tokens held below the compute memory (``bytes = tokens x KV bytes per token``);
* overlap: transfers run layer by layer ahead of compute (the pipeline's prefetch on
  arrival), so ``TTFT = max(T_c, T_x) + min(T_c, T_x) / layers``; a fetch is *hidden*
  when ``T_x <= T_c``.
* decode: memory-bound; one step reads the weights once and every running sequence's KV:
  ``(W + B * ctx * kv) / mem_bw`` for a batch of ``B``, shared by the ``B`` sequences.

Throughput = (prompt + generated tokens) / node-seconds spent (prefill + decode share).
Queueing is not modeled (TTFT is the service time of an idle node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.sim.hardware import MODEL_COMPUTE, HardwareProfile, ModelCompute
from kvtier.sim.replay import ReplayResult
from kvtier.spec import KVSpec


def model_compute(spec: KVSpec) -> ModelCompute:
    """Compute figures of a preset spec; :class:`KVTierUsageError` for unknown models."""
    try:
        return MODEL_COMPUTE[spec.name]
    except KeyError:
        known = ", ".join(sorted(MODEL_COMPUTE))
        raise KVTierUsageError(
            f"no compute figures for model {spec.name!r}; known: {known}"
        ) from None


def kv_bytes_per_token(spec: KVSpec) -> int:
    """KV bytes one token takes over all layers."""
    return spec.bytes_per_token_per_layer * spec.num_layers


def prefill_seconds(
    spec: KVSpec, hw: HardwareProfile, new_tokens: float, cached_tokens: float = 0.0
) -> float:
    """Compute time to prefill ``new_tokens`` after ``cached_tokens`` of reused context."""
    if new_tokens < 0 or cached_tokens < 0:
        raise KVTierUsageError("token counts must be >= 0")
    mc = model_compute(spec)
    attn = 2.0 * mc.q_width * spec.num_layers * new_tokens * (cached_tokens + new_tokens / 2)
    return (2.0 * mc.params * new_tokens + 2.0 * attn) / hw.flops


def transfer_seconds(
    spec: KVSpec, hw: HardwareProfile, tokens_by_tier: Mapping[str, float]
) -> float:
    """Time to bring cached tokens up from their tiers (serially per tier)."""
    per_tok = kv_bytes_per_token(spec)
    return sum(hw.link(t).seconds(n * per_tok) for t, n in tokens_by_tier.items() if n > 0)


def ttft_seconds(compute_s: float, transfer_s: float, layers: int) -> float:
    """Layer-pipelined overlap of prefill compute and KV transfer."""
    return max(compute_s, transfer_s) + min(compute_s, transfer_s) / max(layers, 1)


def decode_step_seconds(spec: KVSpec, hw: HardwareProfile, batch: int, context: float) -> float:
    """One decode step of ``batch`` sequences of ``context`` tokens (memory-bound)."""
    mc = model_compute(spec)
    weights = mc.params * mc.weight_bytes_per_param
    return (weights + batch * context * kv_bytes_per_token(spec)) / hw.mem_bw


@dataclass(frozen=True)
class CostSummary:
    """Modeled service figures of a replay."""

    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    prefill_saved: float  # share of prompt tokens not recomputed
    fetches: int  # requests that fetched from below the top tier
    fetches_hidden: int  # ... whose transfer hid behind compute

    def to_dict(self) -> dict[str, float | int]:
        """Plain-data form."""
        return dict(self.__dict__)


def evaluate(
    result: ReplayResult,
    spec: KVSpec,
    hw: HardwareProfile,
    tier_links: Mapping[str, str] | None = None,
    batch: int = 32,
) -> CostSummary:
    """Turn per-request replay hits into TTFT and throughput on ``hw``.

    ``tier_links`` maps replay tier names to the profile's link names (identity by
    default). The top replay tier is treated as the compute memory when its link is the
    profile's first link (``hbm``), else its hits are transferred like any other tier.
    """
    links = dict(tier_links or {})
    names = [links.get(t, t) for t in result.tiers]
    for n in names:
        hw.link(n)
    top_is_compute = names[0] == next(iter(hw.links))
    bt = result.block_tokens
    ttfts = np.zeros(result.requests)
    busy = 0.0
    fetches = hidden = 0
    saved = 0.0
    # float64 sums: int64 sums of long traces of large lengths wrap around silently
    prompt = float(result.req_input_tokens.sum(dtype=np.float64))
    for i in range(result.requests):
        n_in = float(result.req_input_tokens[i])
        hit_tokens = [min(float(h) * bt, n_in) for h in result.req_hits[i]]
        cached = min(sum(hit_tokens), n_in)
        new = n_in - cached
        by_tier = {
            names[j]: hit_tokens[j] for j in range(len(names)) if not (j == 0 and top_is_compute)
        }
        t_c = prefill_seconds(spec, hw, new, cached)
        t_x = transfer_seconds(spec, hw, by_tier)
        if t_x > 0:
            fetches += 1
            hidden += t_x <= t_c
        ttfts[i] = ttft_seconds(t_c, t_x, spec.num_layers)
        out = float(result.req_output_tokens[i])
        step = decode_step_seconds(spec, hw, batch, n_in + out / 2)
        busy += ttfts[i] + out * step / batch
        saved += cached
    total_tokens = prompt + float(result.req_output_tokens.sum(dtype=np.float64))
    return CostSummary(
        ttft_mean_s=float(ttfts.mean()) if result.requests else 0.0,
        ttft_p50_s=float(np.percentile(ttfts, 50)) if result.requests else 0.0,
        ttft_p99_s=float(np.percentile(ttfts, 99)) if result.requests else 0.0,
        throughput_tok_s=total_tokens / busy if busy > 0 else 0.0,
        prefill_saved=saved / prompt if prompt else 0.0,
        fetches=fetches,
        fetches_hidden=hidden,
    )


@dataclass(frozen=True)
class ArticleRow:
    """One row of the article-style table."""

    context: int
    config: str
    sessions_cached: float
    throughput_rel: float
    ttft_rel: float
    ttft_hit_s: float


def article_table(
    spec: KVSpec,
    hw: HardwareProfile,
    contexts: tuple[int, ...] = (32 * 1024, 128 * 1024),
    sessions: int = 400,
    new_tokens: int = 1024,
    output_tokens: int = 512,
    hbm_kv_share: float = 0.8,
) -> list[ArticleRow]:
    """The shape of the source article's benchmark table, from first principles.

    ``sessions`` multi-turn sessions of ``context`` tokens take turns uniformly; a turn
    adds ``new_tokens`` and generates ``output_tokens``. A configuration caches as many
    sessions as fit in HBM (``hbm_kv_share`` of HBM left after weights), then DRAM, then
    NVMe (``hw.tier_bytes``); a turn whose session is cached prefills only its new tokens,
    fetching the context from the tier that holds it; others recompute everything. Rows
    give throughput and TTFT relative to HBM-only (and the TTFT of a hit itself).
    """
    mc = model_compute(spec)
    kv_tok = kv_bytes_per_token(spec)
    hbm_kv = max(hw.mem_bytes - mc.params * mc.weight_bytes_per_param, 0.0) * hbm_kv_share
    configs = {
        "HBM only": ["hbm"],
        "+ DRAM": ["hbm", "dram"],
        "+ DRAM + NVMe": ["hbm", "dram", "nvme"],
    }
    rows: list[ArticleRow] = []
    for ctx in contexts:
        per_session = ctx * kv_tok
        base: tuple[float, float] | None = None
        for label, tiers in configs.items():
            left = float(sessions)
            time_total = ttft_total = 0.0
            ttft_hit = 0.0
            cached_sessions = 0.0
            for tier in tiers:
                cap = hbm_kv if tier == "hbm" else hw.tier_bytes.get(tier, 0.0)
                n = min(left, cap / per_session)
                left -= n
                cached_sessions += n
                t_x = 0.0 if tier == "hbm" else hw.link(tier).seconds(per_session)
                t_c = prefill_seconds(spec, hw, new_tokens, ctx)
                t = ttft_seconds(t_c, t_x, spec.num_layers)
                ttft_hit = max(ttft_hit, t)
                ttft_total += n * t
            miss = prefill_seconds(spec, hw, ctx + new_tokens)
            ttft_total += left * miss
            decode = output_tokens * decode_step_seconds(spec, hw, 32, ctx) / 32
            time_total = ttft_total + sessions * decode
            tput = sessions * (ctx + new_tokens + output_tokens) / time_total
            ttft = ttft_total / sessions
            if base is None:
                base = (tput, ttft)
            rows.append(
                ArticleRow(ctx, label, cached_sessions, tput / base[0], ttft / base[1], ttft_hit)
            )
    return rows
