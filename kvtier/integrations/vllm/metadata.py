"""What the scheduler side tells the workers each step (pickled across processes).

Token ids travel once: each request's ids reach the workers in :class:`TokenDelta` pieces
(pages ``[first_page, first_page + len(tokens) // block_size)``), from which every worker
derives its own page keys (its rank is part of its namespace). Loads and saves name pages
by index into those keys and the vLLM block each page lives in; hints (:mod:`.hints`) name
pages by index too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .groups import Block
from .hints import HintRun


@dataclass
class TokenDelta:
    """Token ids of pages ``[first_page, ...)`` of request ``req_id``."""

    req_id: str
    first_page: int
    tokens: np.ndarray  # uint32, a whole number of pages
    #: what extends the namespace's model id for this request (:mod:`.scope`)
    scope: str = ""


@dataclass
class PageRun:
    """Pages ``[first_page, first_page + len(block_ids))`` of ``req_id``, one vLLM block
    each (one per KV cache group with several groups: :data:`~.groups.Block`)."""

    req_id: str
    first_page: int
    block_ids: list[Block]


@dataclass
class KVTierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers."""

    tokens: list[TokenDelta] = field(default_factory=list)
    loads: list[PageRun] = field(default_factory=list)
    #: loads that run across steps (``kvtier_load_async``): their requests wait for them
    async_loads: list[PageRun] = field(default_factory=list)
    saves: list[PageRun] = field(default_factory=list)
    #: finished requests whose blocks vLLM holds until their saves were copied out
    holds: list[str] = field(default_factory=list)
    #: hints from finished requests' ``kv_transfer_params``, applied after this step's saves
    hints: list[HintRun] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.tokens or self.loads or self.async_loads or self.saves or self.holds
            or self.hints
        )  # fmt: skip
