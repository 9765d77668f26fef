"""Deterministic prompts of the vLLM tests (token ids of the tiny model's vocabulary)."""

from __future__ import annotations


def prompts_for(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Deterministic prompts of the given lengths (token ids in [0, vocab))."""
    out = []
    for i, n in enumerate(lengths):
        out.append([(seed * 7919 + i * 104729 + j * 613) % vocab for j in range(n)])
    return out


#: prompt lengths, with and without a whole number of 32-token blocks
LENGTHS = [1, 31, 32, 33, 64, 100, 257]


def extra_prompts() -> list[list[int]]:
    """Prompts used after the first round (remote-tier phases, the HTTP test)."""
    return prompts_for(512, [96, 130, 200, 75], seed=2)


def shared_prefix_prompts() -> list[list[int]]:
    """Two prompts sharing their first 96 tokens (three whole blocks), then different."""
    head = prompts_for(512, [96], seed=3)[0]
    tails = prompts_for(512, [40, 70], seed=4)
    return [head + tails[0], head + tails[1]]
