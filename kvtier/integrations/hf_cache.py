"""The transformers ``Cache`` over kvtier pages: :class:`KVTierCache` (see
:mod:`kvtier.integrations.transformers`; :func:`~kvtier.integrations.hf_attach.attach` lets
it see token ids)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.attention import torch_dtype
from kvtier.errors import KVTierUsageError, TierIOError
from kvtier.integrations.hf_parts import (
    BACKGROUND,
    PREFIX_PREFETCH_DEADLINE_S,
    WORKING_KEYS,
    WORKING_NAMESPACE,
    BridgeLike,
    Holdings,
    KVTierCacheStats,
    PrefixLostError,
    give_back,
    give_back_when_dropped,
    quietly,
    spec_for_model,
    token_list,
)
from kvtier.keys import ROOT_KEY, PageKey


class _LayerView(CacheLayerMixin):  # type: ignore[misc,no-untyped-call]
    """What transformers sees per layer; every question goes to the owning cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: KVTierCache, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVTierUsageError("KVTierCache cannot be reset; create a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVTierUsageError("KVTierCache holds one sequence: beam search is not supported")


class KVTierCache(Cache):  # type: ignore[misc]
    """A transformers ``Cache`` over kvtier pages for one sequence. See the module docs.

    Create with :meth:`KVTierBridge.new_cache`; close with :meth:`close` (or ``with``),
    which gives the working slot back and drops any pins (published pages stay cached). A
    cache dropped unclosed gives them back when it is garbage-collected.

    Raises (from ``update`` / ``observe_tokens``):
        KVTierUsageError: batch size > 1, wrong head count or head dim, wrong dtype, no
            token ids (the model was not :func:`attach`-ed), a closed cache.
        CapacityError: the top tier cannot hold this sequence's pages pinned.
        PrefixLostError: published pages could not be brought back from any tier.
    """

    def __init__(
        self, bridge: BridgeLike, model_config: Any = None, layer_prefetch: bool = True
    ) -> None:
        spec = bridge.spec
        if model_config is not None:
            want = spec_for_model(model_config, spec.page_tokens, spec.dtype)
            got = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
            if (want.num_layers, want.num_kv_heads, want.head_dim) != got:
                raise KVTierUsageError(
                    f"model geometry (layers, kv heads, head dim) = "
                    f"{(want.num_layers, want.num_kv_heads, want.head_dim)} does not match the "
                    f"kvtier cache's spec {got}"
                )
        super().__init__(layers=[_LayerView(self, i) for i in range(spec.num_layers)])
        self.bridge = bridge
        #: the namespace its pages are keyed in (the bridge's: with the config's digest)
        self.namespace = bridge.namespace
        self.model_checked: Any = None  # the last model config the attach hook passed
        self.spec = spec
        self.stats = KVTierCacheStats()
        self._dtype = torch_dtype(spec)
        self._pt = spec.page_tokens
        self._tokens: list[int] = []  # every token whose KV is (or is being) cached
        self._keys: list[PageKey] = []  # published full pages, in order
        self._tail = 0  # tokens in the working slot
        self._slot: int | None = None
        self._held = Holdings()  # pins and the working slot: given back if dropped unclosed
        give_back_when_dropped(self, bridge, self._held)
        self._closed = False
        # per-forward state
        self._pending: list[int] | None = None  # token ids of the next forward
        self._n_new = 0
        self._fast = False
        self._index: torch.Tensor | None = None
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ahead: dict[int, concurrent.futures.Future[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # per layer: [2, pages, row] gathers
        self._layer_prefetch = layer_prefetch
        # gathers always run on this helper thread: torch's CPU indexing kernel measured
        # 0.2 ms there and 3-7 ms on the model's thread (its intra-op parallel path)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-layer")

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> KVTierCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release pins and the working slot. Idempotent; the cache is unusable after."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if not self.bridge.cache.is_open:
            return  # closing the KVCache freed the working slot and every pin
        self.bridge.call(self._close_async())

    async def _close_async(self) -> None:
        await give_back(self.bridge, self._held)
        self._slot = None

    def check_open(self) -> None:  # raises KVTierUsageError once closed
        if self._closed:
            raise KVTierUsageError("this KVTierCache is closed")

    # -- what transformers asks ------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before the running forward (all layers alike)."""
        return len(self._keys) * self._pt + self._tail

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def tokens(self) -> list[int]:
        """Token ids whose KV this cache holds (a copy)."""
        return list(self._tokens[: self.get_seq_length()])

    @property
    def page_keys(self) -> list[PageKey]:
        """Keys of the published pages, in order (a copy)."""
        return list(self._keys)

    # -- prefix reuse --------------------------------------------------------------------

    def load_prefix(self, input_ids: Any, max_tokens: int | None = None) -> int:
        """Start this (empty) cache at the longest cached prefix of ``input_ids``.

        At most ``len(input_ids) - 1`` tokens are taken (the model must compute at least
        one to give logits), and at most ``max_tokens`` when given; whole pages only. The
        pages are moved toward the top tier now (a prefetch, not awaited); the first
        forward pins them. Returns the number of tokens reused.
        """
        self.check_open()
        if self._tokens:
            raise KVTierUsageError("load_prefix needs an empty cache (call it before generate)")
        ids = token_list(input_ids)
        limit = len(ids) - 1 if max_tokens is None else min(max_tokens, len(ids) - 1)
        usable = max(0, limit) // self._pt * self._pt
        if usable == 0:
            return 0
        cache = self.bridge.cache

        async def find() -> list[PageKey]:
            hit = await cache.lookup(ids[:usable], namespace=self.namespace)
            if hit.keys:
                # move them up in the background; the first forward's load waits for them
                task = asyncio.get_running_loop().create_task(
                    quietly(cache.prefetch(hit.keys, PREFIX_PREFETCH_DEADLINE_S))
                )
                BACKGROUND.add(task)  # keep a reference until it is done
                task.add_done_callback(BACKGROUND.discard)
            return hit.keys

        keys = self.bridge.call(find())
        self._keys = list(keys)
        self._tokens = ids[: len(keys) * self._pt]
        self.stats.prefix_tokens = len(self._tokens)
        return len(self._tokens)

    # -- token ids ----------------------------------------------------------------------

    def observe_tokens(self, input_ids: Any) -> None:
        """The token ids of the next forward pass (called by the :func:`attach` hook)."""
        self.check_open()
        self._pending = token_list(input_ids)

    # -- the forward pass ---------------------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this forward's K and V of ``layer_idx``; return the layer's whole K and V
        (``[1, kv_heads, tokens, head_dim]``)."""
        self.check_open()
        self._check_states(key_states, value_states, layer_idx)
        # no autograd history: with it, the shared arena would need grad (gathers then fail)
        key_states, value_states = key_states.detach(), value_states.detach()
        n = key_states.shape[2]
        if layer_idx == 0:
            self._begin_forward(n)
        elif n != self._n_new:
            raise KVTierUsageError(
                f"layer {layer_idx} got {n} new tokens, layer 0 of this forward got {self._n_new}"
            )
        try:
            keys, values = self._layer_kv(layer_idx, key_states, value_states)
            if self._layer_prefetch and layer_idx + 1 < self.spec.num_layers:
                self._ahead[layer_idx + 1] = self._pool.submit(self._gather, layer_idx + 1)
            if layer_idx == self.spec.num_layers - 1:
                self._end_forward()
        except (AssertionError, RuntimeError):  # its slot and helper thread gone
            self.check_open()  # closed from another thread while this forward ran
            raise
        return keys, values

    def _check_states(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> None:
        s = self.spec
        if not 0 <= layer_idx < s.num_layers:
            raise KVTierUsageError(f"layer_idx {layer_idx} out of range [0, {s.num_layers})")
        for name, t in (("key_states", k), ("value_states", v)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != s.num_kv_heads:
                raise KVTierUsageError(
                    f"{name} must be [1, {s.num_kv_heads}, tokens, {s.head_dim}] (one sequence), "
                    f"got {list(t.shape)}"
                )
            if t.shape[3] != s.head_dim:
                raise KVTierUsageError(f"{name} head dim {t.shape[3]} != spec {s.head_dim}")
            if t.dtype != self._dtype:
                raise KVTierUsageError(f"{name} dtype {t.dtype} != kvtier KV dtype {self._dtype}")
            if t.device.type != "cpu":
                raise KVTierUsageError(f"{name} is on {t.device}; the top tier is host memory")
        if k.shape != v.shape:
            raise KVTierUsageError(f"key/value shapes differ: {list(k.shape)} vs {list(v.shape)}")

    def _begin_forward(self, n: int) -> None:
        if self._pending is None:
            raise KVTierUsageError(
                "KVTierCache got KV without token ids: call kvtier.integrations.transformers."
                "attach(model) once, and pass input_ids (not inputs_embeds)"
            )
        if len(self._pending) != n:
            raise KVTierUsageError(f"{len(self._pending)} token ids for {n} new KV entries")
        self._tokens = self._tokens[: self.get_seq_length()] + self._pending
        self._pending = None
        self._n_new = n
        self._fast = self._tail + n <= self._pt
        self._staged = []
        self._ahead.clear()
        slots = self.bridge.call(self._pin_pages())
        self._index = torch.tensor(slots, dtype=torch.long)
        self.stats.forwards += 1
        self.stats.computed_tokens += n

    async def _pin_pages(self) -> list[int]:
        """Reserve the working slot (once) and pin every published page in the top tier."""
        cache = self.bridge.cache
        held = self._held
        if held.pinned:
            # the previous forward raised before its last layer (Ctrl-C, a hook, OOM):
            # drop its pins, or they outlive this cache and block the top tier for good
            cache.release(held.pinned)
            held.pinned = []
        if held.reservation is None:
            key = WORKING_KEYS.next()
            # makes room per policy; CapacityError when the top tier is pinned full
            (res,) = await cache.reserve_private([key], WORKING_NAMESPACE)
            held.reservation = res
            self._slot = int(res.handle)
        slots: list[int] = []
        if self._keys:
            top = self.bridge.top_tier
            self.stats.faulted_pages += sum(
                1 for k in self._keys if not cache.directory.is_committed(k, top)
            )
            result = await cache.load(self._keys, pin=True)
            held.pinned = list(self._keys)
            if result.missing:
                cache.release(held.pinned)
                held.pinned = []
                lost = set(result.missing)
                raise PrefixLostError([i for i, k in enumerate(self._keys) if k in lost])
            slots = [int(s) for s in result.slots if s is not None]
        assert self._slot is not None
        return [*slots, self._slot]

    def _gather_here(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_gather` now, on the helper thread (see ``__init__``)."""
        return self._pool.submit(self._gather, layer).result()

    def _gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for every page of the forward (published + working) as
        ``[kv_heads, pages * page_tokens, head_dim]`` views (one copy each).

        The copies land in per-layer buffers kept across forward passes: a fresh
        multi-MiB tensor per layer and step costs more in page faults than the copy
        itself (7 ms vs 0.06 ms for 4 MiB measured here). A layer's buffer is rewritten
        only by the next forward's gather of the same layer, after its attention ran.
        """
        assert self._index is not None
        pages = self.bridge.pages  # [cap, layers, 2, pt, heads, dim]
        n = int(self._index.shape[0])
        s = self.spec
        row = s.page_tokens * s.num_kv_heads * s.head_dim
        buf = self._buffers.get(layer)
        if buf is None or buf.shape[1] < n:
            # grow with headroom so that decode reallocates once per many pages
            buf = torch.empty((2, max(n + 16, n * 5 // 4), row), dtype=self._dtype)
            self._buffers[layer] = buf
        out = []
        for kv in (0, 1):
            src = pages[:, layer, kv].reshape(pages.shape[0], row)  # a view: one row a page
            got = torch.index_select(src, 0, self._index, out=buf[kv, :n])
            got4 = got.view(n, s.page_tokens, s.num_kv_heads, s.head_dim)
            out.append(got4.permute(2, 0, 1, 3).reshape(s.num_kv_heads, -1, s.head_dim))
        return out[0], out[1]

    def _layer_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._slot is not None
        past = self.get_seq_length()
        n = self._n_new
        work = self.bridge.pages[self._slot, layer]  # [2, pt, heads, dim]
        if self._fast:
            # the new tokens fit in the working page: write them there, gather once
            ahead = self._ahead.pop(layer, None)
            early = ahead.result() if ahead is not None else None
            work[0, self._tail : self._tail + n] = k[0].transpose(0, 1)
            work[1, self._tail : self._tail + n] = v[0].transpose(0, 1)
            if early is not None:
                # gathered before this layer's tokens were written: patch them in
                gk, gv = early
                base = gk.shape[1] - self._pt + self._tail
                gk[:, base : base + n] = k[0]
                gv[:, base : base + n] = v[0]
            else:
                gk, gv = self._gather_here(layer)
            total = past + n
            return gk[:, :total].unsqueeze(0), gv[:, :total].unsqueeze(0)
        ahead = self._ahead.pop(layer, None)
        gk, gv = ahead.result() if ahead is not None else self._gather_here(layer)
        self._staged.append((k[0], v[0]))
        keys = torch.cat([gk[:, :past], k[0]], dim=1).unsqueeze(0)
        values = torch.cat([gv[:, :past], v[0]], dim=1).unsqueeze(0)
        return keys, values

    def _end_forward(self) -> None:
        """After the last layer: cut full pages, publish them, unpin."""
        self._ahead.clear()
        assert self._slot is not None
        pt = self._pt
        n = self._n_new
        work = self.bridge.pages[self._slot]  # [layers, 2, pt, heads, dim]
        new_pages: torch.Tensor | None = None
        if self._fast:
            self._tail += n
            if self._tail == pt:
                new_pages = work.unsqueeze(0)  # published by copy below
                self._tail = 0
        else:
            s = self.spec
            total = self._tail + n
            x = torch.empty((s.num_layers, 2, total, s.num_kv_heads, s.head_dim), dtype=self._dtype)
            x[:, :, : self._tail] = work[:, :, : self._tail]
            for layer, (k, v) in enumerate(self._staged):
                x[layer, 0, self._tail :] = k.transpose(0, 1)
                x[layer, 1, self._tail :] = v.transpose(0, 1)
            full = total // pt
            rest = total - full * pt
            if full:
                new_pages = (
                    x[:, :, : full * pt]
                    .reshape(s.num_layers, 2, full, pt, s.num_kv_heads, s.head_dim)
                    .permute(2, 0, 1, 3, 4, 5)
                    .contiguous()
                )
            work[:, :, :rest] = x[:, :, full * pt :]
            self._tail = rest
            self._staged = []
        first = len(self._keys)
        count = 0 if new_pages is None else new_pages.shape[0]
        keys: list[PageKey] = []
        if count:
            parent = self._keys[-1] if self._keys else ROOT_KEY
            keys = self.bridge.cache.page_keys(
                self._tokens[first * pt : (first + count) * pt], parent, self.namespace
            )
        self._index = None
        stored = self.bridge.call(self._publish(keys, new_pages))
        self._keys.extend(keys[:stored])
        self.stats.pages_published += stored
        if stored < count:
            # the KV of the unstored pages is gone: never let generation run on without it.
            # The working slot holds the tokens after them: drop it too, so that the cache
            # ends at its last stored page and a retry recomputes the rest (not KV of later
            # tokens counted at the lost pages' positions)
            self._tail = 0
            raise TierIOError(
                f"kvtier could not store pages {list(range(first + stored, first + count))} "
                "of this sequence (top tier full or failing); recompute the sequence"
            )

    async def _publish(self, keys: list[PageKey], pages: torch.Tensor | None) -> int:
        """Unpin this forward's pages, then store the new full pages (in order; stops at
        the first that does not commit). Returns how many were stored."""
        cache = self.bridge.cache
        if self._held.pinned:
            cache.release(self._held.pinned)
            self._held.pinned = []
        if not keys or pages is None:
            return 0
        parents: list[PageKey | None] = [
            self._keys[-1] if self._keys else ROOT_KEY,
            *keys[:-1],
        ]
        ok = await cache.store_pages(
            keys, pages.contiguous(), parents=parents, namespace=self.namespace
        )
        stored = 0
        for good in ok:
            if not good:
                break
            stored += 1
        return stored

    def check_forward_done(self) -> None:
        """After the model's forward (the :func:`attach` hook): a forward that began must
        have ended at layer ``num_layers - 1``. Otherwise some layers do not write KV (they
        reuse another layer's, as Gemma 3n's ``num_kv_shared_layers`` do) and the cache
        never counts, publishes or unpins this forward's tokens: raise instead of letting
        the next step attend to nothing."""
        if self._index is None:
            return
        self._index = None
        self._ahead.clear()
        pinned, self._held.pinned = self._held.pinned, []
        if pinned:
            self.bridge.call(_release(self.bridge, pinned))
        raise KVTierUsageError(
            f"the model's forward ended before layer {self.spec.num_layers - 1} wrote its KV: "
            "the kvtier spec must count exactly the layers that call cache.update (build it "
            "with spec_for_model, which leaves out layers that reuse another layer's KV)"
        )

    # -- unsupported transformers features -------------------------------------------------

    def crop(self, tokens_to_remove: int) -> None:
        raise KVTierUsageError("KVTierCache does not support crop (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise KVTierUsageError(
                "KVTierCache holds one sequence; num_return_sequences > 1 "
                "and beam search are not supported"
            )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KVTierUsageError("KVTierCache holds one sequence; batch selection is not supported")


async def _release(bridge: BridgeLike, keys: list[PageKey]) -> None:
    if bridge.cache.is_open:
        bridge.cache.release(keys)
