"""Hints from the client through vLLM: do they change what kvtier keeps?

Two ``vllm serve`` servers run side by side on 127.0.0.1, identical (kvtier with one DRAM
tier of ``--dram-pages`` pages, the eviction policy of ``--eviction``, default the config
default ``adaptive``; a small vLLM block pool so that vLLM's own prefix cache loses most
of the history): **plain** gets no hints, **hints** gets each request's
``kv_transfer_params = {"kvtier": {...}}`` as a client that knows its sessions would send
them (docs/integrations.md). Every request goes to both servers in turn, rotating which
goes first, so every ratio compares requests of one run. Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/vllm_hints.py --out bench-out/vllm_hints.json

The workload: ``--conversations`` conversations over one shared system prompt, visited
round-robin for ``--turns`` turns; after each turn, ``--one-shots`` one-shot requests
(the system prompt and a document of their own, never seen again: RAG or classification
traffic). The hints a client knows:

* every request: ``pin_tokens`` = the system prompt;
* a conversation turn but the last: ``next_turn_s`` = the time one round of the workload
  took so far (the gap until this conversation's next turn);
* a conversation's last turn and every one-shot: ``session: "close"``.

Reported per server, for conversation turns after the first (the only requests whose
history can be cached) and for the one-shots: the cached fraction of prompt tokens
(``usage.prompt_tokens_details``: vLLM's own prefix cache plus kvtier's loads), mean TTFT,
and the hints server's ratios to plain (TTFT ratio of means and median of per-request
ratios); kvtier's counters of each server (hit tokens, loaded pages, hinted pages); greedy
answers that differ between the two servers, each with its first differing token and the
cached prompt tokens of both (hints change what stays cached, not what is computed; a
prompt whose prefix one server loads and the other recomputes is attended over KV
computed in another batch, which in bfloat16 need not be bit-identical). ``--no-hints``
sends hints to neither server: the two then differ only by noise, which bounds what a
difference with hints can be credited to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# vllm_serve puts tests/vllm_connector (vllm_engines, vllm_models) on sys.path
from vllm_serve import Server, _complete, _tokens, clients_when_ready, first_difference

SERVERS = ("plain", "hints")


@dataclass
class Sample:
    workload: str
    server: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float


def page_bytes(model: Path, block_size: int) -> int:
    """Bytes of one kvtier page (a vLLM block over all layers, K and V, 16-bit)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return int(cfg["num_hidden_layers"]) * 2 * block_size * kv_heads * head_dim * 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from vllm_engines import base_env, connector
    from vllm_models import smollm2, tiny_llama

    model = Path(args.model) if args.model else (smollm2() if args.smollm2 else tiny_llama())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    page = page_bytes(model, args.block_size)
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-hints-"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    tier: dict[str, Any] = {
        "name": "dram",
        "backend": "dram",
        "capacity": args.dram_pages * page,
    }
    if args.eviction:
        tier["eviction"] = args.eviction
    kv = {"tiers": [tier], "log": {"level": "warning"}}
    common = [
        "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
        "--seed", "0", "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override", str(args.pool_blocks), "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
        "--kv-transfer-config", json.dumps(connector(kv)),
    ]  # fmt: skip
    env = base_env(runtime)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    servers = {n: Server(n, model, common, env, work / f"{n}.log") for n in SERVERS}
    samples: list[Sample] = []
    mismatches: list[dict[str, Any]] = []
    metrics: dict[str, dict[str, float]] = {}
    try:
        clients = clients_when_ready(servers)
        calls = 0
        started = time.perf_counter()

        def both(workload: str, turn: int, prompt: list[int], hints: dict[str, Any]) -> list[int]:
            nonlocal calls
            calls += 1
            answers: dict[str, list[int]] = {}
            for name in SERVERS[calls % 2 :] + SERVERS[: calls % 2]:
                params = {"kvtier": hints} if name == "hints" and args.hints else None
                ttft, total, toks, cached = _complete(
                    clients[name], str(model), prompt, args.answer_tokens, params
                )
                answers[name] = toks
                samples.append(Sample(workload, name, turn, len(prompt), cached, ttft, total))
            a, b = answers["plain"], answers["hints"]
            if a != b:
                mismatches.append(
                    {
                        "workload": workload,
                        "turn": turn,
                        "first_divergent_token": first_difference(a, b),
                        "cached_tokens": {x.server: x.cached_tokens for x in samples[-2:]},
                    }
                )
            return a

        rng = np.random.default_rng(args.seed)
        both("warmup", 0, _tokens(rng, 64, vocab), {})
        system = _tokens(rng, args.system_tokens, vocab)
        pin = {"pin_tokens": len(system)}
        history = [list(system) for _ in range(args.conversations)]
        per_round = args.conversations * (1 + args.one_shots)
        for turn in range(1, args.turns + 1):
            for c in range(args.conversations):
                gap = (time.perf_counter() - started) / calls * per_round
                last = turn == args.turns
                hints = pin | ({"session": "close"} if last else {"next_turn_s": round(gap, 1)})
                prompt = history[c] + _tokens(rng, args.question_tokens, vocab)
                history[c] = prompt + both("conversations", turn, prompt, hints)
                for _ in range(args.one_shots):
                    doc = system + _tokens(rng, args.doc_tokens, vocab)
                    both("one-shots", turn, doc, pin | {"session": "close"})
        time.sleep(2.0)  # the last finished request's saves and hints ride the next step
        both("warmup", 0, _tokens(rng, 40, vocab), {})
        metrics = {n: s.metrics() for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    params = vars(args) | {"model": str(model), "page_bytes": page, "logs": str(work)}
    return summarize(samples, mismatches, metrics, params)


def summarize(
    samples: list[Sample],
    mismatches: list[dict[str, Any]],
    metrics: dict[str, dict[str, float]],
    params: dict[str, Any],
) -> dict[str, Any]:
    """Per workload: each server's figures and the hints server's ratios to plain."""

    def figures(xs: list[Sample]) -> dict[str, float]:
        return {
            "requests": len(xs),
            "cached_fraction": round(
                sum(x.cached_tokens for x in xs) / sum(x.prompt_tokens for x in xs), 3
            ),
            "mean_ttft_s": round(statistics.mean(x.ttft_s for x in xs), 3),
        }

    out: dict[str, Any] = {
        "params": params,
        "divergent_answers": len(mismatches),
        "answer_mismatches": mismatches,
    }
    selections = {
        "conversations, turns 2+": lambda x: x.workload == "conversations" and x.turn >= 2,
        "one-shots": lambda x: x.workload == "one-shots",
    }
    for label, pick in selections.items():
        arms = {n: [x for x in samples if x.server == n and pick(x)] for n in SERVERS}
        if not arms["plain"]:
            continue
        pairs = list(zip(arms["plain"], arms["hints"], strict=True))
        section: dict[str, Any] = {n: figures(xs) for n, xs in arms.items()}
        section["hints_vs_plain"] = {
            "ttft_ratio_of_means": round(
                sum(h.ttft_s for _, h in pairs) / sum(p.ttft_s for p, _ in pairs), 3
            ),
            "ttft_ratio_median": round(statistics.median(h.ttft_s / p.ttft_s for p, h in pairs), 3),
        }
        out[label] = section
    out["kvtier_metrics"] = {
        n: {k.removeprefix("vllm:kvtier_"): v for k, v in m.items()} for n, m in metrics.items()
    }
    out["samples"] = [asdict(s) for s in samples]
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a model directory (default: SmolLM2, or --no-smollm2)")
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--one-shots", type=int, default=2, help="one-shot requests after each turn")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-blocks", type=int, default=48, help="vLLM's block pool (each server)")
    p.add_argument("--dram-pages", type=int, default=48, help="kvtier's one DRAM tier, in pages")
    p.add_argument("--eviction", default="", help="kvtier's policy (default: the config default)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-hints: send none to either server (an A/A control: the noise between them)",
    )
    p.add_argument("--omp-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the servers")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    for name in ("conversations", "turns", "dram_pages", "pool_blocks", "answer_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2, default=str))


if __name__ == "__main__":
    main()
