"""Hints sent through vLLM reach kvtier's eviction policy: a request's
``kv_transfer_params = {"kvtier": {"pin_tokens": ...}}`` keeps its system prompt in a
DRAM tier that a stream of other prompts overflows, where the same prompt without the hint
is evicted (a real vLLM engine on the CPU, a tiny random Llama)."""

from __future__ import annotations

from pathlib import Path

from vllm_engines import Engine, base_env, connector, llm_kwargs

BLOCK = 32
PAGE_BYTES = 16 << 10  # tiny Llama: 2 layers x (K|V) x 32 tokens x 2 KV heads x head dim 32 x bf16
SYSTEM = 4 * BLOCK  # a system prompt of 4 whole pages


def _prompt(first: int, length: int) -> list[int]:
    return [(first + 7 * j) % 500 + 3 for j in range(length)]


def test_a_pinned_system_prompt_survives_pressure_that_evicts_an_unpinned_one(
    tiny_model: Path, runtime_dir: Path, tmp_path: Path
) -> None:
    kv = {
        "tiers": [
            # 16 pages, the only tier: an evicted page is gone
            {"name": "dram", "backend": "dram", "capacity": 16 * PAGE_BYTES, "eviction": "hinted"}
        ],
        "log": {"level": "warning"},
    }
    pinned_system, other_system = _prompt(1, SYSTEM), _prompt(2, SYSTEM)
    llm = llm_kwargs(num_gpu_blocks_override=72, kv_transfer_config=connector(kv))
    with Engine(tiny_model, llm, base_env(runtime_dir), tmp_path / "engine.log") as eng:
        eng.generate(
            [pinned_system + _prompt(3, 40), other_system + _prompt(4, 40)],
            8,
            kv_params=[{"kvtier": {"pin_tokens": SYSTEM, "next_turn_s": 60}}, None],
        )
        first = eng.settled_metrics()
        # 16 prompts of 6 pages, one at a time: through vLLM's 72-block pool and kvtier's
        # 16 pages (4 pinned)
        for i in range(16):
            eng.generate([_prompt(100 + i, 5 * BLOCK + 20)], 8)
        eng.settled_metrics()
        second = eng.generate([pinned_system + _prompt(5, 40), other_system + _prompt(6, 40)], 8)
    assert first.get("hinted_pages", 0) >= SYSTEM // BLOCK  # the pin reached a worker
    assert first.get("hint_errors", 0) == 0
    # the pinned system prompt comes back from kvtier; the other was evicted everywhere
    assert second["cached"] == [SYSTEM, 0]
