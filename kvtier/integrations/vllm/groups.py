"""vLLM's KV cache groups seen by the connector (vLLM's hybrid KV cache manager, HMA).

A model whose layers keep different kinds of KV (sliding-window layers beside full-attention
ones, as in Gemma 2/3 or Cohere 2) gets one *KV cache group* per kind when vLLM's hybrid KV
cache manager is on (the connector declares ``SupportsHMA``). Each group has its own block
table: block ``i`` of a request is a different vLLM block in each group, and a
sliding-window group holds only the blocks of its window (vLLM's null block stands for the
others). One kvtier page is still one block position across every layer, so a page's vLLM
*block* is a :data:`Block`: one block id when the model has one group, else a tuple with one
id per group, :data:`NOT_HELD` where that group does not hold the page.

* A page is saved only when every group holds it (a sliding-window block outside the window
  is gone): :func:`saveable_runs`.
* A page is loaded into the groups that hold it; a layer whose group does not (outside its
  window) is not written: :class:`~.paged.PagedKV`.

Groups of attention kinds are served (full, sliding-window, chunked-local, MLA); a model with
Mamba (state-space) or other non-attention groups, or with groups of different block sizes,
is refused at start-up, naming the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvtier.errors import ConfigError

#: a page's vLLM block: one id (one KV cache group), or one per group
Block: TypeAlias = int | tuple[int, ...]
#: a group does not hold this page (vLLM's null block: outside a sliding window)
NOT_HELD = -1

#: vLLM KV cache spec kinds whose blocks hold attention K/V (or MLA latents) per token
_ATTENTION_SPECS = (
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec",
)


@dataclass(frozen=True)
class KVGroups:
    """The model's KV cache groups: how many, and which layer belongs to which."""

    count: int = 1
    #: layer name -> group index (empty: every layer in group 0)
    group_of: dict[str, int] | None = None
    #: tokens per block of vLLM's KV cache manager (``None``: not known). It can differ
    #: from ``cache_config.block_size`` as a worker sees it: vLLM may raise the block size
    #: after the workers' config was copied (it did, 16 -> 32, for a sliding-window model
    #: on the CPU).
    block_size: int | None = None

    @classmethod
    def of(cls, kv_cache_config: Any) -> KVGroups:
        """The groups of vLLM's ``KVCacheConfig`` (none given: one group).

        Raises:
            ConfigError: a group that is not attention (Mamba, cross-attention, ...), or
                groups whose block sizes differ, naming the group.
        """
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return cls()
        if len(groups) == 1:
            size = getattr(groups[0].kv_cache_spec, "block_size", None)
            return cls(block_size=int(size) if size else None)
        sizes = set()
        group_of: dict[str, int] = {}
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in _ATTENTION_SPECS:
                raise ConfigError(
                    f"KVTierConnector: KV cache group {g} ({', '.join(group.layer_names[:3])}"
                    f"{', ...' if len(group.layer_names) > 3 else ''}) keeps {kind}; the "
                    f"connector serves groups of attention KV only ({', '.join(_ATTENTION_SPECS)})"
                )
            sizes.add(int(spec.block_size))
            for name in group.layer_names:
                group_of[name] = g
        if len(sizes) > 1:
            raise ConfigError(
                f"KVTierConnector: the model's KV cache groups use different block sizes "
                f"({sorted(sizes)}); a kvtier page is one block position across every layer"
            )
        return cls(len(groups), group_of, sizes.pop())

    @property
    def hybrid(self) -> bool:
        return self.count > 1

    def layer_groups(self, layer_names: Sequence[str]) -> list[int]:
        """The group of each of ``layer_names`` (in that order).

        Raises:
            ConfigError: a layer in no group (the tensors vLLM registered do not match its
                KV cache config).
        """
        if not self.hybrid or self.group_of is None:
            return [0] * len(layer_names)
        missing = [n for n in layer_names if n not in self.group_of]
        if missing:
            raise ConfigError(
                f"KVTierConnector: KV tensors registered for layers in no KV cache group: "
                f"{', '.join(missing[:3])}"
            )
        return [self.group_of[n] for n in layer_names]


def page_blocks(
    group_ids: Sequence[Sequence[int]], first: int, end: int, null_id: int
) -> list[Block]:
    """The blocks of pages ``[first, end)`` from vLLM's per-group block ids (``null_id``:
    vLLM's null block, which becomes :data:`NOT_HELD`); one int per page for one group.
    Stops at the first page some group has no entry for."""
    n = min([end, *(len(ids) for ids in group_ids)]) if group_ids else first
    if len(group_ids) == 1:
        return [NOT_HELD if b == null_id else int(b) for b in group_ids[0][first:n]]
    return [
        tuple(NOT_HELD if ids[p] == null_id else int(ids[p]) for ids in group_ids)
        for p in range(first, n)
    ]


def held_by_all(block: Block) -> bool:
    """Every group holds this page (it can be saved)."""
    if isinstance(block, int):
        return block != NOT_HELD
    return NOT_HELD not in block


def saveable_runs(first: int, blocks: Sequence[Block]) -> list[tuple[int, list[Block]]]:
    """``(first_page, blocks)`` for each run of consecutive pages, from page ``first``,
    that every group holds."""
    out: list[tuple[int, list[Block]]] = []
    start = None
    for i, b in enumerate([*blocks, NOT_HELD]):  # the sentinel ends the last run
        if held_by_all(b):
            if start is None:
                start = i
        elif start is not None:
            out.append((first + start, list(blocks[start:i])))
            start = None
    return out


def layer_block(block: Block, group: int) -> int:
    """The block of one group (:data:`NOT_HELD` when it does not hold the page)."""
    return block if isinstance(block, int) else block[group]
