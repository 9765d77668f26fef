"""``vllm serve`` with the kvtier connector, through the OpenAI-compatible HTTP API and the
official ``openai`` client: the documented ``--kv-transfer-config`` flag turns kvtier on,
answers equal vLLM alone, a repeated prompt is served from kvtier (vLLM's prefix cache is
off), and vLLM's ``/metrics`` shows kvtier's counters. The second round sends hints in the
request body (``kv_transfer_params``): they reach kvtier, and a malformed one is counted
without failing its request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_engines import START_TIMEOUT_S, base_env, connector
from vllm_prompts import extra_prompts

from kvtier.testing.servers import free_port_for_later


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except OSError:
        return 0, ""


def test_vllm_serve_with_kvtier_over_http(
    tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path: Path
):  # type: ignore[no-untyped-def]
    openai = pytest.importorskip("openai")
    port = free_port_for_later()
    config_file = tmp_path / "kvtier.toml"
    config_file.write_text(
        '[log]\nlevel = "warning"\n\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "1MiB"\n\n'
        '[[tiers]]\nname = "nvme"\nbackend = "nvme"\ncapacity = "8MiB"\n'
        f'options = {{ path = "{tmp_path / "nvme"}", preallocate = false }}\n'
    )
    vllm_bin = Path(sys.executable).with_name("vllm")
    cmd = [
        str(vllm_bin), "serve", str(tiny_model),
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--block-size", "32", "--seed", "0",
        "--enforce-eager", "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", str(128 << 20),
        "--kv-transfer-config", json.dumps(connector(str(config_file))),
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        cmd, env=base_env(runtime_dir), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _get(f"http://127.0.0.1:{port}/health")[0] != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not start"
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompts = tiny_prompts[1:] + extra_prompts()
        want = tiny_reference["tokens"][1 : len(tiny_prompts) + len(extra_prompts())]
        for round_ in range(2):
            got = []
            for i, p in enumerate(prompts):
                body: dict[str, object] = {"ignore_eos": True, "return_token_ids": True}
                if round_ == 1:
                    hint = {"ttl_s": -1} if i == 0 else {"next_turn_s": 30}
                    body["kv_transfer_params"] = {"kvtier": hint}
                r = client.completions.create(
                    model=str(tiny_model), prompt=p, max_tokens=8, temperature=0.0,
                    extra_body=body,
                )  # fmt: skip
                got.append(list(r.choices[0].token_ids))
            assert got == want

        def total(text: str, name: str) -> float:
            return sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith(f"vllm:kvtier_{name}_total")
            )

        # a finished request's hints travel with the engine's next step: read until counted
        hinted = sum((len(p) + 7) // 32 for p in prompts[1:])
        deadline = time.monotonic() + 30
        while True:
            status, text = _get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            if total(text, "hinted_pages") >= hinted or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert total(text, "hinted_pages") >= hinted
        # the error counters have a sample from the start, 0 on a healthy server
        samples = {line.split("{")[0] for line in text.splitlines() if line.startswith("vllm:")}
        for name in ("load_errors", "save_failures", "saves_dropped", "lookup_errors"):
            assert f"vllm:kvtier_{name}_total" in samples, name
            assert total(text, name) == 0, name
        assert total(text, "hint_errors") == 1
        assert total(text, "loaded_pages") >= sum((len(p) - 1) // 32 for p in prompts)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
