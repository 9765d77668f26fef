"""Does reusing a prefix's KV change greedy answers, with vLLM's own prefix cache as with
kvtier? A check of bfloat16 numerics, not a timing.

Three offline vLLM engines of SmolLM2-135M-Instruct (bfloat16, CPU) answer the same
prompts, each a prefix ``P`` and a suffix ``S`` of random tokens, greedily:

* **fresh**: prefix caching off, no connector: ``P + S`` is computed in one prefill;
* **vllm-prefix**: vLLM's prefix cache on: ``P`` is sent first (one token generated), then
  ``P + S`` reuses ``P``'s blocks from vLLM's cache;
* **kvtier**: prefix caching off, kvtier's connector (a DRAM tier): ``P`` first, then
  ``P + S`` loads ``P``'s pages from kvtier.

If reused KV were simply the KV a fresh prefill computes, all three would agree. Reported:
answers that differ between each pair (with the first differing token), and the cached
prompt tokens of each arm (to show the prefix really was reused). Run in the vLLM
environment::

    .venv-vllm/bin/python benchmarks/prefix_numerics.py --out bench-out/prefix_numerics.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

# vllm_serve puts tests/vllm_connector (vllm_engines, vllm_models) on sys.path
from vllm_serve import first_difference

PAIRS = (("vllm-prefix", "fresh"), ("kvtier", "fresh"), ("kvtier", "vllm-prefix"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from vllm_engines import Engine, base_env, connector, llm_kwargs
    from vllm_models import smollm2

    model = smollm2()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(args.seed)
    cases = []
    for i in range(args.prompts):
        prefix_len = args.block_size * int(rng.integers(8, 21))  # 256-640 tokens
        suffix_len = int(rng.integers(64, 321))
        toks = [int(t) for t in rng.integers(100, vocab - 100, prefix_len + suffix_len)]
        cases.append({"id": i, "prefix": toks[:prefix_len], "prompt": toks})
    work = Path(tempfile.mkdtemp(prefix="kvtier-prefix-numerics-"))
    env = base_env(work / "run")
    (work / "run").mkdir(mode=0o700)
    kv = {
        "tiers": [{"name": "dram", "backend": "dram", "capacity": "512MiB"}],
        "log": {"level": "warning"},
    }
    arms = {
        "fresh": llm_kwargs(enable_prefix_caching=False),
        "vllm-prefix": llm_kwargs(enable_prefix_caching=True),
        "kvtier": llm_kwargs(enable_prefix_caching=False, kv_transfer_config=connector(kv)),
    }
    answers: dict[str, list[list[int]]] = {}
    cached: dict[str, list[int]] = {}
    for name, llm in arms.items():
        with Engine(model, llm, env, work / f"{name}.log") as eng:
            got, hit = [], []
            for case in cases:
                if name != "fresh":
                    eng.generate([case["prefix"]], 1)
                    if name == "kvtier":
                        eng.settled_metrics()  # the prefix's pages are in kvtier
                out = eng.generate([case["prompt"]], args.answer_tokens)
                got.append(out["tokens"][0])
                hit.append(out["cached"][0])
            answers[name], cached[name] = got, hit
    result: dict[str, Any] = {"params": vars(args) | {"model": str(model), "logs": str(work)}}
    for a, b in PAIRS:
        diffs = [
            {
                "prompt": c["id"],
                "prefix_tokens": len(c["prefix"]),
                "prompt_tokens": len(c["prompt"]),
                "first_divergent_token": first_difference(x, y),
            }
            for c, x, y in zip(cases, answers[a], answers[b], strict=True)
            if x != y
        ]
        result[f"{a} vs {b}"] = {"divergent_answers": len(diffs), "cases": diffs}
    result["prefix_reused"] = {
        name: sum(h >= len(c["prefix"]) for h, c in zip(hits, cases, strict=True))
        for name, hits in cached.items()
    }
    result["prompts"] = len(cases)
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.prompts < 1 or args.answer_tokens < 1:
        p.error("--prompts and --answer-tokens must be >= 1")
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
