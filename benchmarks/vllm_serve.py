"""vLLM with kvtier against vLLM alone, through ``vllm serve`` (the OpenAI-compatible API).

Two servers run side by side on 127.0.0.1, identical but for ``--kv-transfer-config``
(kvtier: a DRAM tier over an NVMe tier in a temporary directory). Requests go one at a
time, each to both servers in turn (alternating which goes first), so both see the same
machine at the same moment: every figure is a ratio of two measurements of one run.
vLLM's block pool is small (``--num-gpu-blocks-override``) so that earlier turns of a
conversation are evicted from it by the other conversations; vLLM's own prefix cache is on
in both servers. Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/vllm_serve.py --out bench-out/vllm_serve.json

Workloads:

* ``conversations``: multi-round QA. ``--conversations`` conversations of ``--turns``
  turns, visited round-robin (turn 1 of each, then turn 2 of each, ...). A turn's prompt
  is the shared system prompt, the whole history (earlier questions and the answers the
  server gave) and a new question. Answers are greedy, so both servers give the same
  answers (checked: mismatches are reported).
* ``no-reuse``: prompts that share nothing, so kvtier can only cost time (lookups, saves).

Reported: TTFT (time to the first streamed token) per request and server; for the
requests kvtier served at least 85 % cached (``usage.prompt_tokens_details``), the ratio
of kvtier's TTFT to vLLM alone's (which recomputes what its pool lost); for the no-reuse
workload the TTFT ratio and the throughput ratio; for the whole conversation replay the
tokens/s ratio (prompt + generated tokens over the summed request times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm_connector"))


@dataclass
class Sample:
    workload: str
    server: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    total_s: float
    tokens: list[int] = field(default_factory=list)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class Server:
    """``vllm serve`` in a child process (stopped with SIGINT, killed if it hangs)."""

    def __init__(self, name: str, model: Path, args: list[str], env: dict[str, str], log: Path):
        self.name = name
        self.port = _free_port()
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               *args]  # fmt: skip
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while not _healthy(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start in {timeout} s")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:kvtier_") and "_total" in line:
                name = line.split("{")[0].split(" ")[0]
                out[name] = out.get(name, 0.0) + float(line.split()[-1])
        return out


def _complete(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, list[int], int]:
    """Stream one greedy completion: (TTFT, total seconds, tokens, cached prompt tokens)."""
    start = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    cached = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            ids = getattr(chunk.choices[0], "token_ids", None) or []
            if ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens.extend(ids)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    total = time.perf_counter() - start
    return (ttft if ttft is not None else total), total, tokens, cached


def _tokens(rng: Any, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(100, vocab - 100, n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import openai
    from vllm_engines import base_env, connector
    from vllm_models import smollm2, tiny_llama

    model = Path(args.model) if args.model else (smollm2() if args.smollm2 else tiny_llama())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    kv = {
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": args.dram},
            {"name": "nvme", "backend": "nvme", "capacity": args.nvme,
             "options": {"path": str(work / "nvme")}},
        ],
        "log": {"level": "warning"},
    }  # fmt: skip
    common = [
        "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
        "--seed", "0", "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override", str(args.pool_blocks), "--max-num-seqs", "4",
    ]  # fmt: skip
    if args.enforce_eager:
        common.append("--enforce-eager")
    env = base_env(runtime)
    servers = {
        "vllm": Server("vllm", model, common, env, work / "vllm.log"),
        "kvtier": Server(
            "kvtier", model, [*common, "--kv-transfer-config", json.dumps(connector(kv))], env,
            work / "kvtier.log",
        ),
    }  # fmt: skip
    samples: list[Sample] = []
    mismatches = 0
    try:
        for s in servers.values():
            s.wait()
        clients = {
            name: openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused")
            for name, s in servers.items()
        }
        order = list(servers)
        turn = 0

        def both(workload: str, prompt: list[int], max_tokens: int) -> list[int]:
            nonlocal turn, mismatches
            turn += 1
            answers: dict[str, list[int]] = {}
            for name in order if turn % 2 else reversed(order):
                ttft, total, toks, cached = _complete(clients[name], str(model), prompt, max_tokens)
                answers[name] = toks
                samples.append(Sample(workload, name, len(prompt), cached, len(toks), ttft, total))
            if answers["vllm"] != answers["kvtier"]:
                mismatches += 1
            return answers["vllm"]

        rng = np.random.default_rng(args.seed)
        both("warmup", _tokens(rng, 64, vocab), 4)  # first requests pay one-time costs
        system = _tokens(rng, args.system_tokens, vocab)
        history: list[list[int]] = [list(system) for _ in range(args.conversations)]
        for _t in range(args.turns):
            for c in range(args.conversations):
                prompt = history[c] + _tokens(rng, args.question_tokens, vocab)
                answer = both("conversations", prompt, args.answer_tokens)
                history[c] = prompt + answer
        for _u in range(args.unique):
            both("no-reuse", _tokens(rng, args.unique_tokens, vocab), args.answer_tokens)
        kv_metrics = servers["kvtier"].metrics()
    finally:
        for s in servers.values():
            s.stop()
    return summarize(samples, mismatches, kv_metrics, vars(args) | {"model": str(model)})


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def summarize(
    samples: list[Sample], mismatches: int, kv_metrics: dict[str, float], params: dict[str, Any]
) -> dict[str, Any]:
    by = {
        (s.workload, s.server): [
            x for x in samples if (x.workload, x.server) == (s.workload, s.server)
        ]
        for s in samples
    }
    conv_v, conv_k = by[("conversations", "vllm")], by[("conversations", "kvtier")]
    pairs = list(zip(conv_v, conv_k, strict=True))
    hot = [(v, k) for v, k in pairs if k.cached_tokens >= 0.85 * k.prompt_tokens]
    hot_ratios = [k.ttft_s / v.ttft_s for v, k in hot]
    uv, uk = by.get(("no-reuse", "vllm"), []), by.get(("no-reuse", "kvtier"), [])

    def tps(xs: list[Sample]) -> float:
        return sum(x.prompt_tokens + x.output_tokens for x in xs) / sum(x.total_s for x in xs)

    return {
        "params": params,
        "answer_mismatches": mismatches,
        "conversations": {
            "requests": len(pairs),
            "hot_requests": len(hot),
            "hot_ttft_ratio_median": round(statistics.median(hot_ratios), 3)
            if hot_ratios
            else None,
            "hot_ttft_ratio_max": round(max(hot_ratios), 3) if hot_ratios else None,
            "hot_ttft_ratio_of_means": _ratio(
                sum(k.ttft_s for _, k in hot), sum(v.ttft_s for v, _ in hot)
            )
            if hot
            else None,
            "vllm_cached_fraction": round(
                sum(v.cached_tokens for v in conv_v) / sum(v.prompt_tokens for v in conv_v), 3
            ),
            "kvtier_cached_fraction": round(
                sum(k.cached_tokens for k in conv_k) / sum(k.prompt_tokens for k in conv_k), 3
            ),
            "tokens_per_s_ratio": _ratio(tps(conv_k), tps(conv_v)),
            "ttft_ratio_of_means": _ratio(
                sum(k.ttft_s for k in conv_k), sum(v.ttft_s for v in conv_v)
            ),
        },
        "no_reuse": {
            "requests": len(uk),
            "ttft_ratio_median": round(
                statistics.median(k.ttft_s / v.ttft_s for v, k in zip(uv, uk, strict=True)), 3
            )
            if uk
            else None,
            "ttft_ratio_of_means": _ratio(sum(k.ttft_s for k in uk), sum(v.ttft_s for v in uv))
            if uk
            else None,
            "throughput_ratio": _ratio(tps(uk), tps(uv)) if uk else None,
        },
        "kvtier_metrics": kv_metrics,
        "samples": [asdict(s) | {"tokens": None} for s in samples],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", help="a model directory (default: SmolLM2-135M-Instruct, converted once)"
    )
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=320)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--unique", type=int, default=8, help="no-reuse requests")
    p.add_argument("--unique-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-blocks", type=int, default=160, help="vLLM's block pool (both servers)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dram", default="256MiB")
    p.add_argument("--nvme", default="2GiB")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    summary = {k: v for k, v in result.items() if k not in ("samples",)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
