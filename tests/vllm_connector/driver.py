"""An engine under test: a vLLM ``LLM`` in its own process, driven over stdin/stdout.

Run as ``python driver.py '<json spec>'``. The spec names the model and the ``LLM`` keyword
arguments (``kv_transfer_config`` as a dict). The driver answers one JSON line per command,
each prefixed with ``@@`` (vLLM prints to stdout too); the first, once the engine is up,
is ``{"ready": true, "hybrid_kv_cache_manager": bool}`` (whether vLLM kept its hybrid KV
cache manager on):

* ``{"op": "generate", "prompts": [[ids], ...], "max_tokens": n, "logprobs": k,
  "kv_params": [{...} | null, ...]}`` (``kv_params``, optional: each prompt's
  ``kv_transfer_params``, as a client passes them) ->
  ``{"tokens": [[...]], "cached": [...], "prompt_lens": [...], "logprobs": [[...]]}``
  (greedy; ``cached`` is vLLM's ``num_cached_tokens``: local prefix-cache hits plus tokens
  loaded by a connector; ``prompt_lens``: the prompts' lengths as vLLM ran them);
  ``"extras"`` (optional, one per prompt, or null): ``{"lora": [name, id, path]}`` (a LoRA
  adapter), ``{"cache_salt": str}``, ``{"embeds": true}`` (the prompt sent as prompt
  embeddings: the model's embedding rows of its ids; needs ``enable_prompt_embeds``),
  ``{"image": seed}`` (for an image model: ``multi_modal_data`` of one random 32 x 32
  RGB image made from ``seed`` by :func:`image`; vLLM expands the model's image token in
  the ids to the image's placeholder tokens; ``prompt_lens`` then tells the length);
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


def image(seed: int, side: int = 32) -> Any:
    """A ``side`` x ``side`` RGB image (PIL), the same for the same ``seed``: one random
    color with some noise. (A random model averages its attention over the image's
    rows: images of noise alone look alike to it, a color per image steers its tokens.)"""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, 3) + rng.integers(-24, 24, (side, side, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def _prompt(model: str, ids: list[int], extra: dict[str, Any] | None) -> dict[str, Any]:
    """One prompt as vLLM takes it: token ids, or their embeddings; with a cache salt or
    an image."""
    extra = extra or {}
    if extra.get("embeds"):
        import torch
        from safetensors.torch import load_file

        table = load_file(f"{model}/model.safetensors")["model.embed_tokens.weight"]
        out: dict[str, Any] = {"prompt_embeds": table[torch.tensor(ids)]}
    else:
        out = {"prompt_token_ids": ids}
    if extra.get("cache_salt"):
        out["cache_salt"] = extra["cache_salt"]
    if extra.get("image") is not None:
        out["multi_modal_data"] = {"image": image(extra["image"])}
    return out


def _lora(extra: dict[str, Any] | None) -> Any:
    if not extra or not extra.get("lora"):
        return None
    from vllm.lora.request import LoRARequest

    name, number, path = extra["lora"]
    return LoRARequest(name, number, path)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(spec.get("llm", {}))
    if kwargs.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    llm = LLM(model=spec["model"], **kwargs)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    hybrid = not scheduler_config.disable_hybrid_kv_cache_manager
    _say({"ready": True, "hybrid_kv_cache_manager": hybrid})
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
            extras = cmd.get("extras") or [None] * len(cmd["prompts"])
            pairs = zip(cmd["prompts"], extras, strict=True)
            inputs = [_prompt(spec["model"], p, x) for p, x in pairs]
            loras = [_lora(x) for x in extras]
            outs = llm.generate(
                inputs, params, use_tqdm=False, lora_request=loras if any(loras) else None
            )
            result: dict[str, Any] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "prompt_lens": [len(o.prompt_token_ids or ()) for o in outs],
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
