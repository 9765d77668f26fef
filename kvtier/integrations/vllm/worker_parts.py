"""Pieces of the connector's worker side (:mod:`.worker`): a step's load job, a step's
pages to save, the directory listener that turns page commits and removals into vLLM KV
events (and the announcement of the pages held at start), and the layer number of a vLLM
layer name."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.index.directory import PageState
from kvtier.keys import ROOT_KEY, PageKey
from kvtier.log import get_logger

from .groups import Block

if TYPE_CHECKING:  # .metadata imports vLLM; these parts run (and are tested) without it
    from kvtier.cache import KVCache

    from .metadata import PageRun

_log = get_logger("kvtier.vllm.worker")


@dataclass
class SaveBatch:
    """One step's pages to save, each once: key, parent, namespace label, vLLM block;
    pages of one label are neighbours (:func:`label_runs`: one store call each)."""

    keys: list[PageKey] = field(default_factory=list)
    parents: list[PageKey | None] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        runs: list[PageRun],
        keys_of: dict[str, list[PageKey]],
        labels_of: dict[str, str],
        default_label: str,
    ) -> SaveBatch:
        """The pages of ``runs`` whose keys are known (``keys_of``: a request's page
        keys; ``labels_of``: its namespace label, else ``default_label``)."""
        out = cls()
        seen: set[PageKey] = set()
        for run in sorted(runs, key=lambda r: labels_of.get(r.req_id, default_label)):
            all_keys = keys_of.get(run.req_id, [])
            end = run.first_page + len(run.block_ids)
            if end > len(all_keys):
                continue
            label = labels_of.get(run.req_id, default_label)
            for p, block in zip(range(run.first_page, end), run.block_ids, strict=True):
                k = all_keys[p]
                if k in seen:  # two requests sharing a prefix block save it once
                    continue
                seen.add(k)
                out.keys.append(k)
                out.parents.append(all_keys[p - 1] if p else ROOT_KEY)
                out.labels.append(label)
                out.blocks.append(block)
        return out


def save_admitted(backlog: int, nbytes: int, limit: int) -> bool:
    """Whether a save of ``nbytes`` may start with ``backlog`` bytes of saves waiting
    (``kvtier_save_backlog_mib`` is ``limit``): when it fits, and always when nothing is
    waiting, so that a limit below one step's saves (or one page) slows saving down to
    one batch at a time instead of dropping every save for good."""
    return backlog == 0 or backlog + nbytes <= limit


def label_runs(labels: list[str]) -> list[tuple[str, int, int]]:
    """``(label, start, end)`` for each run of equal neighbours in ``labels``."""
    out: list[tuple[str, int, int]] = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            out.append((labels[start], start, i))
            start = i
    return out


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
    """One step's loads: a read into ``buffer`` and a layer-by-layer scatter; ``reqs``:
    the request each page is loaded for."""

    keys: list[PageKey]
    blocks: list[Block]
    reqs: list[str]
    deadline: float
    layers: int
    ready: list[threading.Event] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    failed: set[Block] = field(default_factory=set)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: concurrent.futures.Future[None] | None = None

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers

    def failed_requests(self) -> set[str]:
        """The requests of the pages in :attr:`failed`."""
        return {r for b, r in zip(self.blocks, self.reqs, strict=True) if b in self.failed}


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

    def announce_held(self, cache: KVCache) -> int:
        """Announce, as commits, the pages the tiers of a cache just opened already hold
        (recovered from an earlier process's store): they were committed before this
        listener subscribed, and a KV-aware router must learn them too. At most the sink's
        room (its ``maxlen``): past it, the announcement stops with a warning naming how
        many pages were left out. Returns the pages announced."""
        room = self.sink.maxlen
        total = announced = 0
        for tier in cache.directory.tiers:
            for key in cache.directory.keys_in(tier, PageState.COMMITTED):
                total += 1
                if room is None or announced < room:
                    self.on_commit(key, tier)
                    announced += 1
        if announced < total:
            _log.warning(
                "kvtier KV events: too many pages held at start to announce them all",
                announced=announced,
                held=total,
            )
        return announced
