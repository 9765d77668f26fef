"""Engines under test: :class:`Engine` runs ``driver.py`` (one vLLM ``LLM``) in a fresh
process and talks to it; every engine is stopped at the end of its ``with`` block, or when
its start fails or is interrupted (killed if it does not stop), and its stderr is kept in a
log file shown when a test fails."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).with_name("driver.py")
#: A ``sitecustomize`` that keeps the engines off vLLM's AMX attention kernel.
NO_AMX = Path(__file__).with_name("no_amx")
#: seconds an engine may take to start (a cold start compiles nothing: enforce_eager)
START_TIMEOUT_S = float(os.environ.get("KVTIER_VLLM_START_TIMEOUT", "420"))
CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


#: the connector's counters that a save finishing after a round's last step moves
SAVE_COUNTERS = ("saved_pages", "save_failures", "saves_dropped", "save_bytes")
#: how long a reading waits for saves in flight (a save of a few pages takes milliseconds)
SETTLE_PAUSE_S = 0.5


def base_env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engines size their pool: kv_cache_memory_bytes
    env.update(
        {
            # one OpenMP thread per engine, a core left to the engine loop's polling (see
            # docs/integrations.md): engines start and run faster on small machines
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("KVTIER_TEST_OMP_BIND", "0"),
            "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "KVTIER_RUNTIME_DIR": str(runtime_dir),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if env.get("KVTIER_TEST_VLLM_AMX") != "1":  # see no_amx/sitecustomize.py
        paths = [str(NO_AMX), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def llm_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "max_model_len": 2048,
        "block_size": 32,
        "seed": 0,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": 128 << 20,
        "disable_log_stats": False,
        "enable_prefix_caching": True,
    }
    kw.update(overrides)
    return kw


def connector(
    kvtier_config: dict[str, Any] | str, role: str = "kv_both", **extra: Any
) -> dict[str, Any]:
    cfg = dict(CONNECTOR, kv_role=role)
    cfg["kv_connector_extra_config"] = {"kvtier_config": kvtier_config, **extra}
    return cfg


def dram_over_nvme(
    nvme: Path, dram: str = "64KiB", capacity: str = "4MiB", **nvme_opts: Any
) -> dict[str, Any]:
    """A kvtier config: a DRAM tier of ``dram`` over an NVMe tier of ``capacity`` in
    ``nvme`` (``nvme_opts``: more NVMe options), logging warnings."""
    return {
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": dram},
            {
                "name": "nvme",
                "backend": "nvme",
                "capacity": capacity,
                "options": {"path": str(nvme), "preallocate": False, **nvme_opts},
            },
        ],
        "log": {"level": "warning"},
    }


class EngineError(RuntimeError):
    pass


class Engine:
    """A vLLM engine in a child process (see ``driver.py`` for the commands)."""

    def __init__(self, model: Path, llm: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        spec = json.dumps({"model": str(model), "llm": llm})
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            #: the engine's first answer (``driver.py``): what vLLM chose at start-up
            self.ready = self._wait(START_TIMEOUT_S)
        except BaseException:  # a start that failed, timed out or was interrupted
            self.close(timeout=5.0)
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("@@"):
                self._lines.put(line[2:])
        self._lines.put(None)

    def _wait(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"engine gave no answer in {timeout} s\n{self.tail()}") from None
        if line is None:
            self.proc.wait(10)
            raise EngineError(f"engine exited ({self.proc.returncode})\n{self.tail()}")
        return dict(json.loads(line))

    def tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def call(self, timeout: float = 300.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._wait(timeout)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        logprobs: int | None = None,
        kv_params: list[dict[str, Any] | None] | None = None,
        extras: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        return self.call(
            op="generate",
            prompts=prompts,
            max_tokens=max_tokens,
            logprobs=logprobs,
            kv_params=kv_params,
            extras=extras,
        )

    def metrics(self) -> dict[str, float]:
        return dict(self.call(op="metrics")["metrics"])

    def settled_metrics(self, counters: tuple[str, ...] = SAVE_COUNTERS) -> dict[str, float]:
        """The metrics once ``counters`` stopped moving. vLLM collects a connector's stats
        with each engine step, and a save still committing when a round's last step ran
        is counted with the next step: one-token requests (no whole page: nothing to save
        or load) step the engine until two readings, each after a pause that a save in
        flight has to end in, agree."""
        before = self.metrics()
        for _ in range(8):
            time.sleep(SETTLE_PAUSE_S)
            self.generate([[1]], 1)
            after = self.metrics()
            if all(after.get(c, 0) == before.get(c, 0) for c in counters):
                return after
            before = after
        raise AssertionError(f"connector counters {counters} did not settle: {after}")

    def close(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self._log.close()
        return int(self.proc.returncode or 0)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_by_one(eng: Engine, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, list[Any]]:
    """Greedy ``tokens``, ``cached`` and ``logprobs`` per prompt, one prompt per call: the
    same batches in every engine (which prompts share a step otherwise depends on timing,
    and the kernels' numerics on the batch)."""
    outs = [eng.generate([p], max_tokens, logprobs=1) for p in prompts]
    return {k: [o[k][0] for o in outs] for k in ("tokens", "cached", "logprobs")}


def flip_every_slot(store: Path) -> int:
    """Flip one payload byte in every 4 KiB-aligned slot of every slab; returns slabs."""
    slabs = sorted((store / "slabs").glob("*"))
    for slab in slabs:
        data = bytearray(slab.read_bytes())
        for off in range(100, len(data), 4096):
            data[off] ^= 0xFF
        slab.write_bytes(bytes(data))
    return len(slabs)
