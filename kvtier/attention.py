"""Reference paged attention (torch, CPU): the end-to-end correctness check.

:func:`paged_attention` gathers each sequence's K and V through a packed block table
(int32 ``[num_seqs, max_pages]``, padded with -1, as kernels consume it) and runs the same
attention arithmetic as :func:`attention` over contiguous tensors. Gathering copies bytes
exactly, so when the pages hold the original KV the two results are equal bit for bit:
that is what the tests check after pages went down the hierarchy and back, after forks
and after rollbacks. It is a reference, not a fast kernel.

Page layout is the page-first blob of :class:`~kvtier.spec.KVSpec`:
``[layers, kv, page_tokens, kv_heads, head_dim]`` (``kv`` is 2 for K and V, 1 for an MLA
latent, which then serves as both K and V).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from kvtier.errors import KVTierUsageError
from kvtier.spec import KVSpec

#: A page source: a tensor ``[num_slots, *page_shape]`` or ``slot -> page tensor``.
PageSource = torch.Tensor | Callable[[int], torch.Tensor]


def torch_dtype(spec: KVSpec) -> torch.dtype:
    """The torch dtype of a spec's KV."""
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise KVTierUsageError(f"torch has no dtype {spec.dtype!r}")
    return dtype


def page_tensor(raw: torch.Tensor | np.ndarray, spec: KVSpec) -> torch.Tensor:
    """A ``page_shape`` tensor of the spec dtype over one page's bytes (no copy)."""
    t = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    if t.dtype != torch.uint8 or t.numel() != spec.page_bytes:
        raise KVTierUsageError(
            f"a page is {spec.page_bytes} uint8 bytes, got {t.dtype} with {t.numel()} elements"
        )
    return t.view(torch_dtype(spec)).view(spec.page_shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Scaled dot-product attention of one sequence, in float32.

    Args:
        q: ``[q_len, q_heads, head_dim]``: the queries of the last ``q_len`` positions.
        k, v: ``[seq_len, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
        causal: query ``i`` sees keys up to position ``seq_len - q_len + i``.

    Returns ``[q_len, q_heads, head_dim]`` float32.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise KVTierUsageError(
            f"attention wants q [q_len, heads, dim] and k, v [len, kv_heads, dim] of one "
            f"shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    q_len, hq, d = q.shape
    n, hkv, dk = k.shape
    if dk != d or hq % hkv:
        raise KVTierUsageError(
            f"head dims must match and q heads ({hq}) be a multiple of kv heads ({hkv})"
        )
    if q_len > n:
        raise KVTierUsageError(f"{q_len} queries but only {n} keys")
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [hq, q_len, d]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [hq, n, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = scale if scale is not None else 1.0 / math.sqrt(d)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * s  # [hq, q_len, n]
    if causal and n > 0:
        pos = torch.arange(n - q_len, n).unsqueeze(1)
        mask = torch.arange(n).unsqueeze(0) > pos
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [hq, q_len, d]
    return out.transpose(0, 1).contiguous()


def gather_kv(
    pages: PageSource, row: np.ndarray | torch.Tensor, seq_len: int, layer: int, spec: KVSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, kv_heads, head_dim]`` of one layer, read through one table row.

    Raises :class:`KVTierUsageError` when the row is too short for ``seq_len``, points
    at a padding slot where a page is needed or past the pages of a tensor source, or a
    page does not have the spec's page shape.
    """
    if not 0 <= layer < spec.num_layers:
        raise KVTierUsageError(f"layer {layer} out of range [0, {spec.num_layers})")
    slots = [int(s) for s in (row.tolist() if hasattr(row, "tolist") else row)]
    need = spec.pages_for(seq_len)
    if need > len(slots) or any(s < 0 for s in slots[:need]):
        raise KVTierUsageError(
            f"block table row {slots[:need]} lacks a page for one of {seq_len} tokens"
        )
    chunks_k: list[torch.Tensor] = []
    chunks_v: list[torch.Tensor] = []
    pt = spec.page_tokens
    for i in range(need):
        if isinstance(pages, torch.Tensor):
            if slots[i] >= pages.shape[0]:
                raise KVTierUsageError(
                    f"block table row points at slot {slots[i]}, past the {pages.shape[0]} "
                    "pages given"
                )
            page = pages[slots[i]]
        else:
            page = pages(slots[i])
        if tuple(page.shape) != spec.page_shape:
            raise KVTierUsageError(
                f"the page at slot {slots[i]} has shape {list(page.shape)}; the spec's page "
                f"shape is {list(spec.page_shape)}"
            )
        count = min(pt, seq_len - i * pt)
        chunks_k.append(page[layer, 0, :count])
        chunks_v.append(page[layer, spec.kv_factor - 1, :count])
    if not chunks_k:
        empty = torch.empty((0, spec.num_kv_heads, spec.head_dim), dtype=torch_dtype(spec))
        return empty, empty
    return torch.cat(chunks_k), torch.cat(chunks_v)


def paged_attention(
    q: torch.Tensor,
    pages: PageSource,
    block_table: np.ndarray | torch.Tensor,
    seq_lens: list[int] | np.ndarray,
    layer: int,
    spec: KVSpec,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a batch through a packed block table.

    Args:
        q: ``[num_seqs, q_len, q_heads, head_dim]``.
        pages: the top tier's pages (a tensor ``[slots, *page_shape]`` or a slot getter).
        block_table: int32 ``[num_seqs, max_pages]``.
        seq_lens: tokens of each sequence.
        layer: the layer whose K/V to use.

    Returns ``[num_seqs, q_len, q_heads, head_dim]`` float32, each row equal bit for bit
    to :func:`attention` over that sequence's original K/V.
    """
    table = np.asarray(block_table)
    if table.dtype != np.int32 or table.ndim != 2:
        raise KVTierUsageError(
            f"block table must be int32 [num_seqs, max_pages], got {table.dtype} {table.shape}"
        )
    if q.dim() != 4 or q.shape[0] != table.shape[0] or len(seq_lens) != table.shape[0]:
        raise KVTierUsageError(
            f"q {tuple(q.shape)}, block table {table.shape} and {len(seq_lens)} seq_lens "
            "must agree on the number of sequences"
        )
    if table.shape[0] == 0:
        return torch.empty(tuple(q.shape), dtype=torch.float32)
    outs = []
    for i in range(table.shape[0]):
        k, v = gather_kv(pages, table[i], int(seq_lens[i]), layer, spec)
        outs.append(attention(q[i], k, v, scale))
    return torch.stack(outs)
