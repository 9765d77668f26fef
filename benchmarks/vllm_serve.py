"""vLLM with kvtier against vLLM alone, through ``vllm serve`` (the OpenAI-compatible API).

Three servers run side by side on 127.0.0.1, identical but for ``--kv-transfer-config``:
``vllm`` (no connector), ``null`` (a connector that does nothing,
``benchmarks/vllm_null_connector.py``: what vLLM's own connector code path costs) and
``kvtier`` (a DRAM tier over an NVMe tier in a temporary directory). Requests go one at a
time, each to every server in turn (rotating which goes first), so all see the same machine
at the same moment: every figure is a ratio of measurements of one run. vLLM's block pool
is small (``--num-gpu-blocks-override``) so that earlier turns of a conversation are
evicted from it by the other conversations; vLLM's own prefix cache is on everywhere.
Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/vllm_serve.py --out bench-out/vllm_serve.json

Workloads:

* ``conversations``: multi-round QA over a shared system prompt. ``--conversations``
  conversations of ``--turns`` turns, visited round-robin (turn 1 of each, then turn 2 of
  each, ...). A turn's prompt is the system prompt, the whole history (earlier questions
  and vLLM's answers) and a new question; the same prompt goes to every server.
* ``no-reuse``: prompts that share nothing, so kvtier can only cost time.

Reported per workload and server: TTFT (time to the first streamed token), tokens/s
(prompt + generated tokens over the request times) and the cached fraction
(``usage.prompt_tokens_details``); kvtier's ratios to vLLM alone and to the null
connector, overall and for the requests kvtier served at least 85 % cached; greedy
answers that differ from vLLM alone's (with the first differing token). The servers' logs
stay in the run's temporary directory (its path is in the result, ``logs``); the NVMe
tier's files are removed when the servers stop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two answers differ (the shorter one's length when
    one is a prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def clients_when_ready(servers: dict[str, Server]) -> dict[str, Any]:
    """Wait until every server answers, then an OpenAI client for each, by name."""
    import openai

    for s in servers.values():
        s.wait()
    return {
        name: openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused")
        for name, s in servers.items()
    }


def _complete(
    client: Any,
    model: str,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
) -> tuple[float, float, list[int], int]:
    """Stream one greedy completion: (TTFT, total seconds, tokens, cached prompt tokens).
    ``kv_transfer_params`` goes in the request body (kvtier's hints)."""
    start = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    cached = 0
    body: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=body,
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
        "--kv-cache-memory-bytes", str(256 << 20),
    ]  # fmt: skip
    if args.enforce_eager:
        common.append("--enforce-eager")
    env = base_env(runtime)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    null = {
        "kv_connector": "NullConnector",
        "kv_connector_module_path": "vllm_null_connector",
        "kv_role": "kv_both",
    }
    null_env = dict(
        env,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
        ),
    )
    servers = {
        "vllm": Server("vllm", model, common, env, work / "vllm.log"),
        "null": Server(
            "null", model, [*common, "--kv-transfer-config", json.dumps(null)], null_env,
            work / "null.log",
        ),
        "kvtier": Server(
            "kvtier", model, [*common, "--kv-transfer-config", json.dumps(connector(kv))], env,
            work / "kvtier.log",
        ),
    }  # fmt: skip
    samples: list[Sample] = []
    mismatches: list[dict[str, Any]] = []
    try:
        clients = clients_when_ready(servers)
        order = list(servers)
        turn = 0

        def both(workload: str, prompt: list[int], max_tokens: int) -> list[int]:
            nonlocal turn
            turn += 1
            answers: dict[str, list[int]] = {}
            rotated = order[turn % len(order) :] + order[: turn % len(order)]
            for name in rotated:
                ttft, total, toks, cached = _complete(clients[name], str(model), prompt, max_tokens)
                answers[name] = toks
                samples.append(Sample(workload, name, len(prompt), cached, len(toks), ttft, total))
            for name, ref in (("null", "vllm"), ("kvtier", "vllm"), ("kvtier", "null")):
                a, b = answers[name], answers[ref]
                if a != b:
                    mismatches.append(
                        {"pair": f"{name}/{ref}", "workload": workload, "turn": turn,
                         "first_divergent_token": first_difference(a, b)}
                    )  # fmt: skip
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
        shutil.rmtree(work / "nvme", ignore_errors=True)  # the tier's slabs: GBs, no use now
    params = vars(args) | {"model": str(model), "logs": str(work)}
    return summarize(samples, mismatches, kv_metrics, params)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def summarize(
    samples: list[Sample],
    mismatches: list[dict[str, Any]],
    kv_metrics: dict[str, float],
    params: dict[str, Any],
) -> dict[str, Any]:
    """Per workload: each server's figures and kvtier's ratios to vLLM alone and to the
    null connector (requests are matched one to one: the same prompt on every server)."""

    def of(workload: str, server: str) -> list[Sample]:
        return [x for x in samples if x.workload == workload and x.server == server]

    def tps(xs: list[Sample]) -> float:
        return sum(x.prompt_tokens + x.output_tokens for x in xs) / sum(x.total_s for x in xs)

    def figures(xs: list[Sample]) -> dict[str, float]:
        return {
            "requests": len(xs),
            "mean_ttft_s": round(statistics.mean(x.ttft_s for x in xs), 3),
            "median_ttft_s": round(statistics.median(x.ttft_s for x in xs), 3),
            "tokens_per_s": round(tps(xs), 1),
            "cached_fraction": round(
                sum(x.cached_tokens for x in xs) / sum(x.prompt_tokens for x in xs), 3
            ),
        }

    pairs_count = {
        p: sum(m["pair"] == p for m in mismatches)
        for p in ("null/vllm", "kvtier/vllm", "kvtier/null")
    }
    out: dict[str, Any] = {
        "params": params,
        "divergent_answers": pairs_count,
        "answer_mismatches": mismatches,
    }
    for workload in ("conversations", "no-reuse"):
        arms = {name: of(workload, name) for name in ("vllm", "null", "kvtier")}
        if not arms["kvtier"]:
            continue
        section: dict[str, Any] = {name: figures(xs) for name, xs in arms.items()}
        for base in ("vllm", "null"):
            pairs = list(zip(arms[base], arms["kvtier"], strict=True))
            section[f"kvtier_vs_{base}"] = {
                "ttft_ratio_of_means": _ratio(
                    sum(k.ttft_s for _, k in pairs), sum(b.ttft_s for b, _ in pairs)
                ),
                "ttft_ratio_median": round(
                    statistics.median(k.ttft_s / b.ttft_s for b, k in pairs), 3
                ),
                "tokens_per_s_ratio": _ratio(tps(arms["kvtier"]), tps(arms[base])),
            }
            hot = [(b, k) for b, k in pairs if k.cached_tokens >= 0.85 * k.prompt_tokens]
            if workload == "conversations":
                section[f"kvtier_vs_{base}"]["hot_requests"] = len(hot)
                if hot:
                    ratios = [k.ttft_s / b.ttft_s for b, k in hot]
                    section[f"kvtier_vs_{base}"]["hot_ttft_ratio_median"] = round(
                        statistics.median(ratios), 3
                    )
                    section[f"kvtier_vs_{base}"]["hot_ttft_ratio_of_means"] = _ratio(
                        sum(k.ttft_s for _, k in hot), sum(b.ttft_s for b, _ in hot)
                    )
                    section[f"kvtier_vs_{base}"]["hot_ttft_ratio_max"] = round(max(ratios), 3)
                # of those, the ones the other server recomputed (it held < half the prompt)
                lost = [(b, k) for b, k in hot if b.cached_tokens < 0.5 * b.prompt_tokens]
                section[f"kvtier_vs_{base}"]["hot_recomputed_requests"] = len(lost)
                if lost:
                    ratios = [k.ttft_s / b.ttft_s for b, k in lost]
                    section[f"kvtier_vs_{base}"]["hot_recomputed_ttft_ratio_median"] = round(
                        statistics.median(ratios), 3
                    )
                    section[f"kvtier_vs_{base}"]["hot_recomputed_ttft_ratio_of_means"] = _ratio(
                        sum(k.ttft_s for _, k in lost), sum(b.ttft_s for b, _ in lost)
                    )
        section["null_vs_vllm_tokens_per_s_ratio"] = _ratio(tps(arms["null"]), tps(arms["vllm"]))
        out[workload] = section
    out["kvtier_metrics"] = kv_metrics
    out["samples"] = [asdict(s) | {"tokens": None} for s in samples]
    return out


def resummarize(path: Path) -> dict[str, Any]:
    """Recompute the summary of a saved result file (``--summarize FILE``)."""
    saved = json.loads(path.read_text())
    samples = [Sample(**x) for x in saved["samples"]]
    return summarize(samples, saved["answer_mismatches"], saved["kvtier_metrics"], saved["params"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", help="a model directory (default: SmolLM2-135M-Instruct, converted once)"
    )
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--unique", type=int, default=8, help="no-reuse requests")
    p.add_argument("--unique-tokens", type=int, default=768)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-blocks", type=int, default=96, help="vLLM's block pool (every server)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dram", default="256MiB")
    p.add_argument("--nvme", default="2GiB")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND for every server (auto: vLLM's default, every core; "
        "0: one core, leaving the other to the engine loop's polling)",
    )
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--summarize", type=Path, help="only recompute the summary of a saved --out file"
    )
    args = p.parse_args()
    result = resummarize(args.summarize) if args.summarize else run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    summary = {k: v for k, v in result.items() if k not in ("samples",)}
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
