"""Synchronous against asynchronous kvtier loads in ``vllm serve``, with a slow tier.

Two servers run side by side on 127.0.0.1, identical but for ``kvtier_load_async``:
``sync`` (``"never"``: a hit loads within the step that needs it) and ``async``
(``"below-top"``: a hit with pages below the top tier loads across steps while its request
waits). kvtier is a small DRAM tier over a file store whose reads take ``--delay-s``
longer (``benchmarks/vllm_slow_store.py``: a stand-in for a remote pool or a loaded
disk); vLLM's own prefix cache and kvtier's prefetch on lookup are off, so every reused
page comes through that slow read. Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/vllm_async_loads.py --out bench-out/vllm_async_loads.json

Each round, on each server in turn (rotating which goes first):

1. ``--hits`` long prompts are sent once (one token each) and stored by kvtier; they leave
   the DRAM tier for the slow store;
2. the same prompts are sent again (the *reusing* requests: kvtier hits on the slow tier)
   and, ``--lag-s`` later, ``--misses`` new short prompts (the *other* requests), all
   concurrently, each for ``--tokens`` greedy tokens.

Reported per server: the median TTFT of the other requests (what a slow load costs the
requests that share its steps) and of the reusing ones, and the ratios async / sync
(same machine, same moment, same prompts), and the means (the reusing requests' TTFTs
are bimodal: one load or two, see the docs); whether both servers gave the same greedy
tokens for every request; kvtier's counters (``async_loads``, ``loaded_pages``,
``load_errors``). A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# vllm_serve puts tests/vllm_connector (vllm_engines, vllm_models) on sys.path
from vllm_serve import ROOT, Server, _complete, _tokens, clients_when_ready


def _kv(store: Path, delay_s: float) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "64KiB"},
            {"name": "slow", "backend": "vllm_slow_store:SlowFileStore", "capacity": "64MiB",
             "options": {"path": str(store), "delay_s": delay_s}},
        ],
        "log": {"level": "warning"},
    }  # fmt: skip


def _concurrently(
    client: Any, model: str, hits: list[list[int]], misses: list[list[int]], args: Any
) -> list[tuple[str, float, list[int]]]:
    """Send ``hits`` at once and ``misses`` ``args.lag_s`` later, all concurrently: (kind,
    TTFT, tokens) per request, hits first."""
    out: list[tuple[str, float, list[int]] | None] = [None] * (len(hits) + len(misses))

    def one(i: int, kind: str, prompt: list[int]) -> None:
        ttft, _total, toks, _cached = _complete(client, model, prompt, args.tokens)
        out[i] = (kind, ttft, toks)

    threads = [threading.Thread(target=one, args=(i, "reusing", p)) for i, p in enumerate(hits)]
    for t in threads:
        t.start()
    time.sleep(args.lag_s)
    later = [
        threading.Thread(target=one, args=(len(hits) + j, "other", p)) for j, p in enumerate(misses)
    ]
    for t in later:
        t.start()
    for t in threads + later:
        t.join()
    return [x for x in out if x is not None]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from vllm_engines import base_env, connector
    from vllm_models import tiny_llama

    model = Path(args.model) if args.model else tiny_llama()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-async-"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    common = [
        "--max-model-len", "2048", "--block-size", "32", "--seed", "0",
        "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching",
        "--max-num-seqs", str(args.hits + args.misses), "--kv-cache-memory-bytes",
        str(256 << 20), "--enforce-eager",
    ]  # fmt: skip
    env = base_env(runtime)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    )
    servers = {
        mode_name: Server(
            mode_name, model,
            [*common, "--kv-transfer-config", json.dumps(connector(
                _kv(work / mode_name, args.delay_s), kvtier_load_async=mode,
                kvtier_prefetch_on_lookup=False,
            ))],
            env, work / f"{mode_name}.log",
        )
        for mode_name, mode in (("sync", "never"), ("async", "below-top"))
    }  # fmt: skip
    samples: list[dict[str, Any]] = []
    try:
        clients = clients_when_ready(servers)
        rng = np.random.default_rng(args.seed)
        order = list(servers)
        for name in order:  # the first requests pay one-time costs
            _complete(clients[name], str(model), _tokens(rng, 64, vocab), 2)
        for r in range(args.rounds):
            hits = [_tokens(rng, args.hit_tokens, vocab) for _ in range(args.hits)]
            misses = [_tokens(rng, args.miss_tokens, vocab) for _ in range(args.misses)]
            rotated = order[r % 2 :] + order[: r % 2]
            for name in rotated:
                for p in hits:  # stored by kvtier, then out of DRAM (64 KiB: 4 pages)
                    _complete(clients[name], str(model), p, 1)
                time.sleep(args.settle_s)  # the saves land in the slow store
                for kind, ttft, toks in _concurrently(
                    clients[name], str(model), hits, misses, args
                ):
                    samples.append(
                        {"round": r, "server": name, "kind": kind, "ttft_s": ttft, "tokens": toks}
                    )
        counters = {name: s.metrics() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        for name in servers:
            shutil.rmtree(work / name, ignore_errors=True)
    params = vars(args) | {"model": str(model), "logs": str(work)}
    return summarize(samples, counters, params)


def summarize(
    samples: list[dict[str, Any]], counters: dict[str, dict[str, float]], params: dict[str, Any]
) -> dict[str, Any]:
    def ttfts(server: str, kind: str) -> list[float]:
        return [s["ttft_s"] for s in samples if s["server"] == server and s["kind"] == kind]

    out: dict[str, Any] = {"params": params}
    for kind in ("other", "reusing"):
        sync, asyn = ttfts("sync", kind), ttfts("async", kind)
        out[kind] = {
            "requests": len(sync),
            "sync_median_ttft_s": round(statistics.median(sync), 3),
            "async_median_ttft_s": round(statistics.median(asyn), 3),
            "async_over_sync_median_ttft": round(
                statistics.median(asyn) / statistics.median(sync), 3
            ),
            "sync_mean_ttft_s": round(statistics.mean(sync), 3),
            "async_mean_ttft_s": round(statistics.mean(asyn), 3),
            "async_over_sync_mean_ttft": round(statistics.mean(asyn) / statistics.mean(sync), 3),
        }
    tokens: dict[str, list[list[int]]] = {"sync": [], "async": []}
    for s in samples:
        tokens[s["server"]].append(s["tokens"])
    out["same_greedy_tokens"] = sorted(map(tuple, tokens["sync"])) == sorted(
        map(tuple, tokens["async"])
    )
    # idempotent: --summarize passes the saved counters, already filtered and renamed
    out["kvtier_counters"] = {
        name: {
            k.removeprefix("vllm:kvtier_"): v
            for k, v in c.items()
            if any(w in k for w in ("async_loads", "loaded_pages", "load_errors"))
        }
        for name, c in counters.items()
    }  # fmt: skip
    out["samples"] = samples
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a model directory (default: the tiny random Llama)")
    p.add_argument("--delay-s", type=float, default=0.5, help="extra seconds per slow read")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--hits", type=int, default=2, help="reusing requests per round")
    p.add_argument("--hit-tokens", type=int, default=512)
    p.add_argument("--misses", type=int, default=4, help="other requests per round")
    p.add_argument("--miss-tokens", type=int, default=96)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--lag-s", type=float, default=0.05)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--omp-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND (every server)")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--summarize", type=Path, help="only recompute the summary of a saved --out file"
    )
    args = p.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        result = summarize(saved["samples"], saved["kvtier_counters"], saved["params"])
    else:
        result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2, default=str))


if __name__ == "__main__":
    main()
