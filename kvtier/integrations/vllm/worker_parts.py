"""Pieces of the connector's worker side (:mod:`.worker`): a step's load job, the
directory listener that turns page commits and removals into vLLM KV events, and the
layer number of a vLLM layer name."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import PageKey


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12)."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        digits = [int(p) for p in name.split(".") if p.isdigit()]
        return digits[0] if digits else 0


@dataclass
class LoadJob:
    """One step's loads: a read into ``buffer`` and a layer-by-layer scatter."""

    keys: list[PageKey]
    blocks: list[int]
    deadline: float
    layers: int
    ready: list[threading.Event] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: concurrent.futures.Future[None] | None = None

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers


class DirectoryEvents:
    """Directory listener turning page commits/removals into vLLM KV events."""

    def __init__(self, block_size: int, sink: collections.deque[Any]) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self._stored = BlockStored
        self._removed = BlockRemoved
        self.block_size = block_size
        self.sink = sink

    def on_commit(self, key: PageKey, tier: str) -> None:
        self.sink.append(
            self._stored(
                block_hashes=[bytes(key)],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.block_size,
                lora_id=None,
                medium=tier,
                lora_name=None,
            )
        )

    def on_remove(self, key: PageKey, tier: str) -> None:
        self.sink.append(self._removed(block_hashes=[bytes(key)], medium=tier))
