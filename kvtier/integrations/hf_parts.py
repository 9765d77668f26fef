"""Pieces of the transformers integration (:mod:`kvtier.integrations.transformers`):
constants, errors, counters, the model-to-spec helper, token-id checking, and what a
:class:`~kvtier.integrations.hf_cache.KVTierCache` needs of its bridge."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import weakref
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from kvtier.attention import torch_dtype
from kvtier.backend import ArenaBackend, Reservation
from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError, TierIOError
from kvtier.keys import Namespace, PageKey, PrivateKeys
from kvtier.spec import KVSpec, canonical_dtype

T = TypeVar("T")

#: Namespace label of working-slot reservations (visible in the directory, never looked up).
WORKING_NAMESPACE = "kvtier-transformers-working"
#: Private keys of the working pages (see :class:`~kvtier.keys.PrivateKeys`).
WORKING_KEYS = PrivateKeys(b"\xfekvtier-hf")
#: Deadline of the prefetch that :meth:`KVTierCache.load_prefix` starts (seconds).
PREFIX_PREFETCH_DEADLINE_S = 30.0


class PrefixLostError(TierIOError):
    """Published pages of a running sequence could not be brought back from any tier
    (every tier holding them failed or they failed verification). The sequence must be
    recomputed; :attr:`pages` names the logical page numbers lost."""

    def __init__(self, pages: list[int]) -> None:
        self.pages = pages
        super().__init__(f"kvtier could not bring back pages {pages} of this sequence")


#: Background prefetches started by caches (a reference until each is done); touched on
#: cache loops only.
BACKGROUND: set[asyncio.Task[None]] = set()


class BridgeLike(Protocol):
    """What a cache needs of its bridge (:class:`~kvtier.integrations.transformers.
    KVTierBridge`): the open cache, its loop and the top-tier arena as one tensor."""

    cache: KVCache
    spec: KVSpec
    top_tier: str

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the cache's loop and wait for its result."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the cache's loop without waiting."""

    @property
    def pages(self) -> torch.Tensor:
        """The whole top-tier arena as ``[capacity, *page_shape]``."""

    @property
    def namespace(self) -> Namespace:
        """The namespace the caches key their pages in."""

    def check_model_config(self, model_config: Any) -> None:
        """Raise :class:`KVTierUsageError` when ``model_config`` is not the model the
        bridge's pages were computed by (another checkpoint or KV-changing config)."""


def spec_for_model(
    config: Any, page_tokens: int = 16, dtype: str | torch.dtype | None = None, name: str = ""
) -> KVSpec:
    """The :class:`KVSpec` of a transformers decoder config (``LlamaConfig`` and alike).

    ``dtype`` defaults to the config's ``torch_dtype``/``dtype`` (float32 when unset).
    Raises :class:`KVTierUsageError` when the config lacks a field kvtier needs.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    check_supported(text)
    try:
        # layers that reuse an earlier layer's KV (Gemma 3n) never call cache.update
        layers = int(text.num_hidden_layers) - int(getattr(text, "num_kv_shared_layers", 0) or 0)
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        if getattr(text, "model_type", "") == "falcon" and not text.new_decoder_architecture:
            kv_heads = 1 if text.multi_query else heads  # FalconConfig.num_kv_heads is unused
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    except AttributeError as exc:
        raise KVTierUsageError(f"model config lacks a field kvtier needs: {exc}") from None
    except Exception as exc:  # e.g. transformers' per-layer attribute errors (Gemma 4)
        raise KVTierUsageError(
            f"kvtier cannot read one KV geometry from this {type(text).__name__}: {exc}"
        ) from None
    if dtype is None:
        # transformers 5 names it dtype (reading the old torch_dtype only warns)
        dtype = getattr(text, "dtype", None) or "float32"
    return KVSpec(
        layers,
        kv_heads,
        head_dim,
        canonical_dtype(str(dtype)),
        page_tokens,
        name=name or str(getattr(text, "model_type", "model")),
    )


#: rope types whose frequencies depend on the forward's sequence length: a token's KV then
#: depends on more than the tokens before it, which page keys cannot carry
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_supported(text: Any) -> None:
    """Raise :class:`KVTierUsageError` naming why KVTierCache cannot serve this decoder
    config: it caches one K and one V of equal shape per attention layer, keyed by tokens."""
    name = type(text).__name__
    if getattr(text, "kv_lora_rank", None):
        raise KVTierUsageError(
            f"{name} uses multi-head latent attention (kv_lora_rank): its cache holds a latent "
            "and a rope key of different widths, which KVTierCache does not store"
        )
    kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        raise KVTierUsageError(
            f"{name} has {sorted(kinds)} layers: KVTierCache caches attention KV only"
        )
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    # one dict, or one per layer type (Gemma 3: {"full_attention": {...}, ...})
    per_type = list(rope.values()) if isinstance(rope, dict) else []
    ropes = [r for r in (rope, *per_type) if isinstance(r, dict)]
    kinds_r = [r.get("rope_type", r.get("type")) for r in ropes]
    kind = next((k for k in kinds_r if k in LENGTH_DEPENDENT_ROPE), None)
    if kind is not None:
        raise KVTierUsageError(
            f"{name} uses {kind!r} rope scaling: a token's KV depends on the sequence length "
            "at the time it was computed, so cached pages could not be reused exactly"
        )


def arena_pages(arena: ArenaBackend, spec: KVSpec) -> torch.Tensor:
    """One typed tensor over every slot of ``arena`` (slots must be contiguous and equally
    spaced, which a memory arena guarantees); raises :class:`KVTierUsageError` otherwise."""
    cap = arena.capacity_pages
    first = arena.view(0)
    base = first.ctypes.data
    if cap > 1 and arena.view(cap - 1).ctypes.data != base + (cap - 1) * spec.page_bytes:
        raise KVTierUsageError("the top-tier arena's slots are not one contiguous buffer")
    whole = np.lib.stride_tricks.as_strided(first, shape=(cap * spec.page_bytes,), strides=(1,))
    t = torch.from_numpy(whole)
    return t.view(torch_dtype(spec)).view(cap, *spec.page_shape)


@dataclass
class KVTierCacheStats:
    """Counters of one :class:`KVTierCache` (plain data).

    Attributes:
        prefix_tokens: tokens found in kvtier by :meth:`KVTierCache.load_prefix`.
        computed_tokens: tokens whose KV this cache received from the model.
        pages_published: full pages stored in kvtier.
        forwards: forward passes run.
        faulted_pages: pages that were not in the top tier when a forward needed them.
    """

    prefix_tokens: int = 0
    computed_tokens: int = 0
    pages_published: int = 0
    forwards: int = 0
    faulted_pages: int = 0


async def quietly(coro: Coroutine[Any, Any, Any]) -> None:
    """Await a background prefetch; its failure only means the first load faults."""
    with contextlib.suppress(Exception):
        await coro


def token_list(input_ids: Any) -> list[int]:
    """Token ids from a ``[1, n]`` / ``[n]`` tensor, array or sequence of ints."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise KVTierUsageError(
                    f"KVTierCache holds one sequence; got a batch of {input_ids.shape[0]}"
                )
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.dtype.is_floating_point:
            raise KVTierUsageError(
                f"input_ids must be integer [1, n] or [n], got {input_ids.dtype} "
                f"{list(input_ids.shape)}"
            )
        return [int(t) for t in input_ids.tolist()]
    if isinstance(input_ids, np.ndarray):
        return token_list(torch.from_numpy(np.asarray(input_ids)))
    if isinstance(input_ids, Sequence) and not isinstance(input_ids, str | bytes):
        out = []
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise KVTierUsageError(f"input_ids[{i}] must be an int, got {t!r}")
            out.append(int(t))
        return out
    raise KVTierUsageError(f"input_ids must be a tensor or a list of ints, got {type(input_ids)}")


@dataclass
class Holdings:
    """What one :class:`~kvtier.integrations.hf_cache.KVTierCache` holds in the
    ``KVCache``: the pins of its running forward and its working slot's reservation."""

    pinned: list[PageKey] = field(default_factory=list)
    reservation: Reservation | None = None


async def give_back(bridge: BridgeLike, held: Holdings) -> None:
    """Drop ``held``'s pins and working slot (on the cache's loop); empties ``held``.
    Nothing to do once the ``KVCache`` is closed: closing it freed them."""
    cache = bridge.cache
    pinned, held.pinned = held.pinned, []
    reservation, held.reservation = held.reservation, None
    if pinned and cache.is_open:
        cache.release(pinned)
    if reservation is not None and cache.is_open:
        await cache.release_private([reservation])


def give_back_when_dropped(owner: object, bridge: BridgeLike, held: Holdings) -> None:
    """Give ``held`` back when ``owner`` is garbage-collected without being closed.

    A cache dropped unclosed (no ``with``, no ``close()``) would otherwise keep its working
    slot reserved and its pins for as long as the ``KVCache`` runs: after as many dropped
    caches as the top tier has pages, every forward raises ``CapacityError``. The
    finalizer runs on whichever thread collects ``owner`` (the loop's own included), so it
    only schedules :func:`give_back` on the loop and never waits; it holds ``held`` and
    the bridge, never ``owner``. It does not run at interpreter exit.
    """
    fin = weakref.finalize(owner, _give_back_later, bridge, held)
    fin.atexit = False


def _give_back_later(bridge: BridgeLike, held: Holdings) -> None:
    if held.pinned or held.reservation is not None:
        coro = give_back(bridge, held)
        try:
            bridge.submit(coro)
        except RuntimeError:  # the loop is closed: nothing is held any more
            coro.close()  # never started: close it, or Python warns it was never awaited
