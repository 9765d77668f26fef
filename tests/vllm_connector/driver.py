"""An engine under test: a vLLM ``LLM`` in its own process, driven over stdin/stdout.

Run as ``python driver.py '<json spec>'``. The spec names the model and the ``LLM`` keyword
arguments (``kv_transfer_config`` as a dict). The driver answers one JSON line per command,
each prefixed with ``@@`` (vLLM prints to stdout too):

* ``{"op": "generate", "prompts": [[ids], ...], "max_tokens": n, "logprobs": k,
  "kv_params": [{...} | null, ...]}`` (``kv_params``, optional: each prompt's
  ``kv_transfer_params``, as a client passes them) ->
  ``{"tokens": [[...]], "cached": [...], "logprobs": [[...]]}`` (greedy; ``cached`` is
  vLLM's ``num_cached_tokens``: local prefix-cache hits plus tokens loaded by a connector);
* ``{"op": "metrics"}`` -> ``{"metrics": {name: value}}``: vLLM's Prometheus counters whose
  name contains ``kvtier`` (summed over labels; ``hit_tokens`` also per tier);
* ``{"op": "exit"}``: shut the engine down (the connector closes its cache) and exit 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _logprobs(completion: Any) -> list[float]:
    """The logprob of each generated token."""
    steps = completion.logprobs or []
    return [step[t].logprob for step, t in zip(steps, completion.token_ids, strict=False)]


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(spec.get("llm", {}))
    if kwargs.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    llm = LLM(model=spec["model"], **kwargs)
    _say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "generate":
            kv_params = cmd.get("kv_params") or [None] * len(cmd["prompts"])
            params = [
                SamplingParams(
                    max_tokens=cmd.get("max_tokens", 8),
                    temperature=0.0,
                    ignore_eos=True,
                    logprobs=cmd.get("logprobs"),
                    extra_args={"kv_transfer_params": kv} if kv is not None else None,
                )
                for kv in kv_params
            ]
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in cmd["prompts"]], params, use_tqdm=False
            )
            result: dict[str, Any] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
            }
            if cmd.get("logprobs"):
                result["logprobs"] = [_logprobs(o.outputs[0]) for o in outs]
            _say(result)
        elif op == "metrics":
            values: dict[str, float] = {}
            for m in llm.get_metrics():
                if "kvtier" not in m.name:
                    continue
                name = m.name.removeprefix("vllm:kvtier_")
                value = float(getattr(m, "value", 0) or 0)
                values[name] = values.get(name, 0.0) + value
                tier = (getattr(m, "labels", None) or {}).get("tier")
                if tier:
                    values[f"{name}.{tier}"] = values.get(f"{name}.{tier}", 0.0) + value
            _say({"metrics": values})
        else:
            _say({"error": f"unknown op {op!r}"})
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    _say({"bye": True})


if __name__ == "__main__":
    main()
