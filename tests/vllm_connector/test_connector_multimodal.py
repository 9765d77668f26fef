"""Requests with an image, in a real engine (the tiny random Idefics3 of
:func:`vllm_models.tiny_idefics3`): an image's placeholder positions hold the same token ids
whatever the image, so kvtier keys every page overlapping them by the image too (vLLM's
identifier of the item and its offset in the page, as vLLM's own prefix cache does; see
``kvtier/integrations/vllm/scope.py``). A prompt with another image must load only the
pages before the image; the same image loads them all; a text-only prompt shares the
pages before the image; with other text after the image, the hit ends inside the image
(vLLM takes the rest of the image's rows from its encoder cache, or, in a fresh engine
loading from the NVMe tier, runs the encoder for them). Keyed by
token ids alone, a prompt with image B would load the KV of image A and answer as if it
saw A. Greedy tokens must equal vLLM alone (no connector, no prefix cache: every hit
comes from kvtier) for every request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_engines import Engine, base_env, connector, dram_over_nvme, llm_kwargs
from vllm_models import IDEFICS3_IMAGE_TOKEN, IDEFICS3_IMAGE_TOKENS

BLOCK = 32
#: text tokens before the image: 2 whole pages, then the image starts in page 2
HEAD = 80
TEXT = [(j * 613 + (j * j) % 97) % 500 + 3 for j in range(300)]
A, B = {"image": 1}, {"image": 2}  # two images (driver.image seeds): same placeholder ids


def _with_image(tail: list[int]) -> list[int]:
    """``HEAD`` text tokens, the image, then ``tail``: vLLM expands the image token to
    ``IDEFICS3_IMAGE_TOKENS`` placeholders at positions ``HEAD`` on."""
    return [*TEXT[:HEAD], IDEFICS3_IMAGE_TOKEN, *tail]


def _whole_pages(tokens: int) -> int:
    """The tokens of the whole pages among the first ``tokens``: what kvtier can load."""
    return tokens // BLOCK * BLOCK


def test_pages_with_an_image_are_keyed_by_the_image(
    tiny_image_model: Path, runtime_dir: Path, tmp_path: Path
) -> None:
    p = _with_image(TEXT[HEAD:180])  # 80 + 67 + 100 = 247 tokens in vLLM
    p_other_tail = _with_image(TEXT[200:300])  # the same up to the image's end, then not
    text_head = TEXT[:HEAD] + TEXT[200:300]  # text only: P's text before the image
    p_new_tail = _with_image(TEXT[120:220])  # run by a fresh engine only (and alone)
    assert TEXT[120] not in (TEXT[HEAD], TEXT[200])  # its hit ends inside the image
    steps: list[tuple[str, list[int], dict[str, Any] | None]] = [
        ("P A", p, A),  # saved
        ("P A again", p, A),
        ("P B", p, B),  # must not load image A's pages
        ("P B again", p, B),
        ("text head", text_head, None),
        ("P' A", p_other_tail, A),  # a hit that ends inside the image
        ("P A after B", p, A),  # A's pages are still A's
    ]
    common = {"enable_prefix_caching": False}  # every hit comes from kvtier
    kv = dram_over_nvme(tmp_path / "nvme", dram="8MiB", capacity="16MiB")
    results: dict[str, list[dict[str, Any]]] = {}
    for label, extra in (("alone", {}), ("kvtier", {"kv_transfer_config": connector(kv)})):
        llm = llm_kwargs(**common, **extra)
        log = tmp_path / f"{label}.log"
        with Engine(tiny_image_model, llm, base_env(runtime_dir), log) as eng:
            results[label] = [eng.generate([q], 8, extras=[e]) for _, q, e in steps]
            if label == "kvtier":
                metrics = eng.settled_metrics()
            else:
                new_tail_alone = eng.generate([p_new_tail], 8, extras=[A])["tokens"][0]
    # a fresh engine (no encoder cache) whose first hit, from the NVMe tier, ends inside
    # the image: vLLM must run the encoder for the rest of the image's rows
    llm = llm_kwargs(**common, kv_transfer_config=connector(kv))
    with Engine(tiny_image_model, llm, base_env(runtime_dir), tmp_path / "fresh.log") as eng:
        fresh = eng.generate([p_new_tail], 8, extras=[A])
    names = [name for name, _, _ in steps]
    lens = {n: r["prompt_lens"][0] for n, r in zip(names, results["kvtier"], strict=True)}
    expanded = IDEFICS3_IMAGE_TOKENS - 1  # the image token becomes the placeholders
    assert lens == {n: len(q) + (expanded if e else 0) for n, q, e in steps}
    tokens = {k: dict(zip(names, (r["tokens"][0] for r in v), strict=True))
              for k, v in results.items()}  # fmt: skip
    # the test is sensitive: the image changes vLLM's answer (so loading A's KV for B shows)
    assert tokens["alone"]["P A"] != tokens["alone"]["P B"]
    wrong = [n for n in names if tokens["kvtier"][n] != tokens["alone"][n]]
    # vLLM loads at most all but the prompt's last token (it computes that one itself);
    # kvtier loads whole pages only
    full = _whole_pages(lens["P A"] - 1)  # 7 pages: 224 tokens
    before_image = _whole_pages(HEAD)  # 2 pages: 64 tokens
    inside_image = _whole_pages(HEAD + IDEFICS3_IMAGE_TOKENS)  # 4 pages: 128 tokens
    assert HEAD < inside_image < HEAD + IDEFICS3_IMAGE_TOKENS  # it ends in the image
    hits = {"P A": 0, "P A again": full, "P B": before_image, "P B again": full,
            "text head": before_image, "P' A": inside_image, "P A after B": full}  # fmt: skip
    cached = dict(zip(names, (r["cached"][0] for r in results["kvtier"]), strict=True))
    assert (wrong, cached) == ([], hits)  # wrong tokens and wrong hits, shown together
    assert (fresh["tokens"][0], fresh["cached"][0]) == (new_tail_alone, inside_image)
    assert metrics.get("hit_tokens", 0) == sum(hits.values())  # all of them from kvtier
    assert metrics.get("unkeyed_requests", 0) == 0 and metrics.get("load_errors", 0) == 0
