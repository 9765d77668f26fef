"""Which requests kvtier can key, in which namespace, and by which ids.

kvtier names a page by the token ids up to it and the engine's namespace (model,
revision, KV dtype, block size, attention backend, parallel layout, rank). vLLM's own
prefix cache also keys a block by the request's LoRA adapter, its ``cache_salt``, its
multimodal inputs and its prompt embeddings: with any of them, the same token ids hold
other KV. So, per request:

* a **LoRA adapter** (its name and path, as vLLM keys it) or a **cache salt** puts the
  request's pages in a namespace of their own: the engine's, with the model id extended
  (``+lora=NAME@<hash of the path>``, ``+salt=<hash>``: the salt itself is never stored).
  Such requests share pages only with requests of the same adapter and salt;
* **prompt embeddings** (vLLM gives their positions placeholder token ids, all 0): the
  request is keyed in a namespace of its own (``+embeds=<dtype>``) and every whole page
  that holds prompt embeddings is keyed, instead of by its token ids, by a 128-bit digest
  of the page's embedding rows (their bytes) and token ids, repeated over the page's
  positions (:func:`key_ids`). Pages past the embeddings (generated tokens) keep their
  token ids, and the keys chain as always, so two such prompts share exactly the pages
  whose embeddings, up to them, are byte for byte equal, as vLLM's per-block hash of the
  embeddings does;
* **multimodal inputs** (an image's positions hold the same placeholder ids whatever the
  image): every whole page that overlaps an item's placeholder range is keyed by a 128-bit
  digest of the page's token ids and, for each item it overlaps, vLLM's identifier of the
  item (a hash of its processed data) and the item's offset relative to the page: the
  extra keys vLLM's own prefix cache hashes a block with (``("mm", identifier, offset -
  start)``), so two requests share exactly the pages vLLM itself would share. Pages before
  the first item are plain text and are shared with text-only prompts, as in vLLM; pages
  after it differ through the key chain. The namespace is the engine's;
* a request with multimodal inputs *and* prompt embeddings, or with an item kvtier cannot
  read (no identifier or position), is not keyed: kvtier neither loads nor saves it, and
  counts it in ``unkeyed_requests``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.keys import Namespace

#: The most bytes of a scope the lookup service takes (a long LoRA name is still far less).
MAX_SCOPE_BYTES = 4096


class PromptEmbeds:
    """A request's prompt embeddings as kvtier keys them: one 128-bit digest per whole page
    that holds embedding rows (see :func:`key_ids`), computed once per page."""

    def __init__(self, embeds: Any) -> None:
        t = embeds.detach().to("cpu").contiguous()
        self.rows: int = int(t.shape[0])
        #: each row's bytes (the tensor viewed as uint8; its dtype is in the scope)
        self.raw: np.ndarray = t.view(torch.uint8).reshape(self.rows, -1).numpy()
        self.dtype = str(t.dtype).removeprefix("torch.")
        self._pages: dict[int, np.ndarray] = {}

    def page_ids(self, page: int, block: int, token_ids: np.ndarray) -> np.ndarray:
        """The ``block`` key ids of whole page ``page`` (its ``token_ids`` given): the words
        of a 128-bit digest of its embedding rows and token ids, repeated. Pages of the
        prompt alone are digested once; the page where the rows end also holds generated
        tokens, and is digested with them each time."""
        ids = self._pages.get(page)
        if ids is None:
            h = xxhash.xxh3_128()
            h.update(np.ascontiguousarray(self.raw[page * block : (page + 1) * block]).data)
            h.update(np.ascontiguousarray(token_ids, dtype="<u4").data)
            ids = np.resize(np.frombuffer(h.digest(), dtype="<u4"), block)
            if (page + 1) * block <= self.rows:
                self._pages[page] = ids
        return ids


class MultimodalItems:
    """A request's multimodal items as kvtier keys them: ``(offset, length, identifier)``
    of each item's placeholder range, by offset (see :meth:`page_ids`).

    Raises :class:`ValueError` naming what it cannot read (an item without an identifier
    or a placeholder range)."""

    def __init__(self, features: Sequence[Any]) -> None:
        items: list[tuple[int, int, bytes]] = []
        for i, f in enumerate(features):
            ident = getattr(f, "identifier", None)
            pos = getattr(f, "mm_position", None)
            offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
            if not isinstance(ident, str) or not ident:
                raise ValueError(f"multimodal item {i} has no identifier")
            if not isinstance(offset, int) or not isinstance(length, int):
                raise ValueError(f"multimodal item {i} has no placeholder range")
            if offset < 0 or length <= 0:
                raise ValueError(f"multimodal item {i} has range ({offset}, {length})")
            items.append((offset, length, ident.encode("utf-8", "surrogatepass")))
        self.items = sorted(items)
        #: one past the last position any item covers
        self.end = max((o + n for o, n, _ in self.items), default=0)
        self._pages: dict[int, np.ndarray] = {}

    def page_ids(self, page: int, block: int, token_ids: np.ndarray) -> np.ndarray | None:
        """The ``block`` key ids of whole page ``page`` (its ``token_ids`` given) when it
        overlaps an item: the words of a 128-bit digest of its token ids and, for each
        item it overlaps, the item's identifier and offset relative to the page start,
        repeated; ``None`` for a page no item overlaps (its token ids key it)."""
        start, end = page * block, (page + 1) * block
        if (ids := self._pages.get(page)) is not None:
            return ids
        inside = [(o - start, ident) for o, n, ident in self.items if o < end and o + n > start]
        if not inside:
            return None
        h = xxhash.xxh3_128()
        h.update(np.ascontiguousarray(token_ids, dtype="<u4").data)
        for rel, ident in inside:
            h.update(b"mm" + len(ident).to_bytes(4, "little") + ident)
            h.update(rel.to_bytes(8, "little", signed=True))
        ids = np.resize(np.frombuffer(h.digest(), dtype="<u4"), block)
        if end <= self.end:  # all placeholders: the page past the last item is not kept
            self._pages[page] = ids
        return ids


@dataclass(frozen=True)
class RequestScope:
    """``suffix``: what extends the model id of the request's namespace (``""``: the
    engine's namespace); ``skip``: why kvtier leaves the request alone, or ``None``;
    ``embeds``: the prompt embeddings its first pages are keyed by, ``mm``: the
    multimodal items pages are keyed by (:func:`key_ids`)."""

    suffix: str = ""
    skip: str | None = None
    embeds: PromptEmbeds | None = field(default=None, compare=False, repr=False)
    mm: MultimodalItems | None = field(default=None, compare=False, repr=False)


def _digest(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def request_scope(request: Any) -> RequestScope:
    """The scope of a vLLM ``Request`` (see the module docstring)."""
    features = getattr(request, "mm_features", None)
    mm: MultimodalItems | None = None
    if features:
        if getattr(request, "prompt_embeds", None) is not None:
            return RequestScope(skip="multimodal inputs with prompt embeddings")
        try:
            mm = MultimodalItems(features)
        except ValueError as exc:
            return RequestScope(skip=f"multimodal inputs kvtier cannot read: {exc}")
    suffix = ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = str(getattr(lora, "lora_name", "") or "")
        path = str(getattr(lora, "lora_path", "") or "")
        suffix += f"+lora={name}@{_digest(path)}"
    salt = getattr(request, "cache_salt", None)
    if salt:
        suffix += f"+salt={_digest(str(salt))}"
    raw = getattr(request, "prompt_embeds", None)
    if raw is None:
        return RequestScope(suffix, mm=mm)
    if not isinstance(raw, torch.Tensor) or raw.dim() < 1:
        return RequestScope(skip=f"prompt embeddings kvtier cannot read ({type(raw).__name__})")
    embeds = PromptEmbeds(raw)
    return RequestScope(suffix + f"+embeds={embeds.dtype}", embeds=embeds)


def key_ids(
    scope: RequestScope, token_ids: Sequence[int], first_page: int, end_page: int, block: int
) -> np.ndarray:
    """The uint32 ids kvtier keys pages ``[first_page, end_page)`` of a request by,
    ``token_ids`` being all of its token ids: those ids, except that a page holding prompt
    embeddings is keyed by their digest (:class:`PromptEmbeds`). Only whole pages are
    keyed: a page ``token_ids`` does not fill is left out. Pages overlapping multimodal
    items are keyed by :meth:`MultimodalItems.page_ids`."""
    end_page = min(end_page, len(token_ids) // block)
    if end_page <= first_page:
        return np.zeros(0, dtype=np.uint32)
    out = np.asarray(token_ids[first_page * block : end_page * block]).astype(np.uint32)
    embeds, mm = scope.embeds, scope.mm
    if embeds is not None:
        last = min(end_page, -(-embeds.rows // block))  # pages holding embedding rows
        for page in range(first_page, last):
            at = (page - first_page) * block
            out[at : at + block] = embeds.page_ids(page, block, out[at : at + block])
    if mm is not None:
        last = min(end_page, -(-mm.end // block))  # pages an item may overlap
        for page in range(first_page, last):
            at = (page - first_page) * block
            ids = mm.page_ids(page, block, out[at : at + block])
            if ids is not None:
                out[at : at + block] = ids
    return out


def scoped(namespace: Namespace, suffix: str) -> Namespace:
    """``namespace`` with ``suffix`` appended to its model id (itself for ``""``)."""
    if not suffix:
        return namespace
    return dataclasses.replace(namespace, model_id=namespace.model_id + suffix)
