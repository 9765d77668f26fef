""":func:`attach`: the hooks that let :class:`~kvtier.integrations.hf_cache.KVTierCache`
see each forward of a transformers model: its token ids and attention mask before, and
whether the forward ended at the last layer after."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import KVTierUsageError
from kvtier.integrations.hf_cache import KVTierCache

_HOOKED = "_kvtier_token_hook"


def attach(model: torch.nn.Module) -> None:
    """Let :class:`KVTierCache` see token ids: a forward pre-hook on ``model`` hands each
    forward's ``input_ids`` to the ``KVTierCache`` passed as ``cache=`` (or the deprecated
    ``past_key_values=``). Idempotent; other caches are left alone."""
    if getattr(model, _HOOKED, False):
        return

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, KVTierCache):
            return
        cache.check_open()  # before the checks below, which a closed cache would fail
        ids = kwargs.get("input_ids", args[0] if args else None)
        other = other_inputs(kwargs)
        if other:
            # an image (audio, video) behind placeholder ids: the same ids hold other KV
            raise KVTierUsageError(
                f"KVTierCache keys pages by token ids only: this forward also gets "
                f"{', '.join(repr(n) for n in other)}, inputs that change the KV of the same "
                "token ids (images, audio, video behind placeholder ids); not supported, use "
                "DynamicCache for such requests"
            )
        if ids is None:
            raise KVTierUsageError(
                "KVTierCache needs input_ids (token ids key its pages); inputs_embeds alone "
                "is not supported"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(mask.all())):
            # KV depends on the mask (masked tokens, the positions after them) and page keys
            # hash token ids only: pages made under one mask would be served under another.
            # This holds for the mask generate infers from a pad token in the prompt too:
            # the same ids without it compute other KV.
            raise KVTierUsageError(
                "KVTierCache needs an attention_mask of all ones: got a "
                f"{mask.dim()}-D mask with zeros; page keys carry token ids only, not the "
                "mask. A prompt that holds the pad token gets such a mask from generate: "
                "pass attention_mask=torch.ones_like(input_ids) to attend to every token"
            )
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1:
            raise KVTierUsageError(
                f"KVTierCache holds one sequence; this forward has a batch of {ids.shape[0]} "
                "(a batch, beam search, num_return_sequences > 1 and assisted decoding are "
                "not supported: use DynamicCache for those)"
            )
        config = getattr(module, "config", None)
        if config is not None and cache.model_checked is not config:
            cache.bridge.check_model_config(config)  # a cache made for another model
            cache.model_checked = config
        check_positions(kwargs.get("position_ids"), len(cache.tokens), ids)
        cache.observe_tokens(ids)

    def done(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVTierCache):
            cache.check_forward_done()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model.register_forward_hook(done, with_kwargs=True)
    setattr(model, _HOOKED, True)


#: Forward inputs that do not change the KV of the token ids (the ids themselves, the mask
#: checked below, the positions generate derives from it, the cache, and output options).
KV_NEUTRAL_INPUTS = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position",
    "past_key_values", "cache", "use_cache", "labels", "logits_to_keep",
    "num_logits_to_keep", "return_dict", "output_attentions", "output_hidden_states",
})  # fmt: skip


def other_inputs(kwargs: dict[str, Any]) -> list[str]:
    """Names of the data inputs of a forward outside :data:`KV_NEUTRAL_INPUTS`: anything
    but ``None`` and plain options (bool, number, string), e.g. ``pixel_values``,
    ``input_features`` or transformers 5's ``mm_encoder_outputs`` (the image features
    ``generate`` computes before the first forward). Each may change the KV of the same
    token ids."""
    return sorted(
        name
        for name, value in kwargs.items()
        if name not in KV_NEUTRAL_INPUTS and _carries_data(value)
    )


def _carries_data(value: Any) -> bool:
    """Whether a forward input holds data: not ``None``, a plain option or an empty (or
    all-``None``) container, as ``generate`` passes ``mm_encoder_outputs={}`` for a
    prompt without images."""
    if value is None or isinstance(value, bool | int | float | str):
        return False
    if isinstance(value, dict):
        return any(_carries_data(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_carries_data(v) for v in value)
    return True


def check_positions(positions: Any, past: int, ids: Any) -> None:
    """Refuse ``position_ids`` other than the ones that continue the cached tokens
    (``past, past + 1, ...``): a token's KV depends on its position (rope), and page keys
    on the token ids before it only, so KV at other positions would be served as this."""
    if not isinstance(positions, torch.Tensor):
        return
    n = ids.shape[-1] if isinstance(ids, torch.Tensor) else len(ids)
    flat = positions.reshape(-1)
    if (
        positions.dim() > 2
        or flat.numel() != n
        or not torch.equal(flat.to(torch.long).cpu(), torch.arange(past, past + n))
    ):
        raise KVTierUsageError(
            f"KVTierCache needs position_ids that continue the cached tokens ({past} to "
            f"{past + n - 1}); got {tuple(positions.shape)} positions "
            f"{flat[:4].tolist()}{'...' if flat.numel() > 4 else ''}: a page's KV depends "
            "on its positions, its key on the token ids only"
        )
