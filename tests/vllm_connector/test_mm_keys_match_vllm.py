"""kvtier keys multimodal pages as vLLM's own prefix cache hashes multimodal blocks: for
random prompts with images (placeholder ids equal whatever the image), two requests get
equal kvtier keys for a page exactly when vLLM's block hasher (``get_request_block_hasher``,
vLLM's code, run here) gives their blocks equal hashes. Runs in the vLLM environment."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

BLOCK = 4
PAGES = 6
PLACEHOLDER = 7


def _request(rng: random.Random) -> SimpleNamespace:
    """A prompt of ``PAGES`` whole blocks over a tiny alphabet (so prefixes collide often)
    with 0 to 3 images of identifiers "a"/"b" at random, non-overlapping places."""
    from vllm.multimodal.inputs import PlaceholderRange

    n = PAGES * BLOCK
    tokens = [rng.choice((1, 2)) for _ in range(n)]
    features: list[Any] = []
    at = rng.randrange(0, 6)
    for _ in range(rng.randrange(0, 4)):
        length = rng.randrange(1, 7)
        if at + length > n:
            break
        tokens[at : at + length] = [PLACEHOLDER] * length
        pos = PlaceholderRange(offset=at, length=length)
        ident = rng.choice("ab")
        features.append(SimpleNamespace(identifier=ident, mm_position=pos, modality="image"))
        at += length + rng.randrange(0, 6)
    return SimpleNamespace(
        request_id="r", all_token_ids=tokens, num_tokens=n, block_hashes=[],
        mm_features=features, lora_request=None, cache_salt=None, prompt_embeds=None,
    )  # fmt: skip


def _adjacent_images_split_differently() -> list[SimpleNamespace]:
    """Two prompts with equal token ids and images "a" then "b" back to back, split at
    another position: only the offsets tell their pages apart."""
    from vllm.multimodal.inputs import PlaceholderRange

    out = []
    for split in (2, 3):
        tokens = [1] * 4 + [PLACEHOLDER] * 4 + [2] * (PAGES * BLOCK - 8)
        features = [
            SimpleNamespace(identifier="a", mm_position=PlaceholderRange(offset=4, length=split)),
            SimpleNamespace(identifier="b", mm_position=PlaceholderRange(offset=4 + split,
                                                                         length=4 - split)),
        ]  # fmt: skip
        out.append(SimpleNamespace(
            request_id="r", all_token_ids=tokens, num_tokens=len(tokens), block_hashes=[],
            mm_features=features, lora_request=None, cache_salt=None, prompt_embeds=None,
        ))  # fmt: skip
    return out


def _vllm_hashes(request: SimpleNamespace) -> list[Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)  # what the engine does at start
    return list(get_request_block_hasher(BLOCK, sha256)(request))


def _kvtier_keys(request: SimpleNamespace) -> list[bytes]:
    from kvtier.integrations.vllm.scope import key_ids, request_scope
    from kvtier.keys import Namespace, page_keys

    scope = request_scope(request)
    assert scope.skip is None, scope.skip
    ids = key_ids(scope, request.all_token_ids, 0, PAGES, BLOCK)
    return list(page_keys(ids, Namespace("mm-test", page_tokens=BLOCK)))


def test_page_keys_are_equal_exactly_when_vllms_block_hashes_are() -> None:
    rng = random.Random(20261204)
    requests = [_request(rng) for _ in range(300)] + _adjacent_images_split_differently()
    vllm = [_vllm_hashes(r) for r in requests]
    kv = [_kvtier_keys(r) for r in requests]
    assert all(len(v) == len(k) == PAGES for v, k in zip(vllm, kv, strict=True))
    equal = differ = with_images = 0
    for i in range(len(requests)):
        for j in range(i + 1, len(requests)):
            for p in range(PAGES):
                same_vllm = vllm[i][p] == vllm[j][p]
                same_kv = kv[i][p] == kv[j][p]
                assert same_vllm == same_kv, (
                    f"page {p}: vLLM says {'equal' if same_vllm else 'different'}, kvtier "
                    f"{'equal' if same_kv else 'different'}\n{requests[i]}\n{requests[j]}"
                )
                equal += same_vllm
                differ += not same_vllm
                if (
                    same_vllm
                    and requests[i].mm_features
                    and p * BLOCK >= min(f.mm_position.offset for f in requests[i].mm_features)
                ):
                    with_images += 1
    # the comparison has both answers, and equal pages at or past an image
    assert equal > 100 and differ > 100 and with_images > 10, (equal, differ, with_images)
