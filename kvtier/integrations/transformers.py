"""Hugging Face transformers on kvtier: a ``Cache`` whose KV lives in kvtier pages.

:class:`KVTierCache` is a ``transformers.Cache`` for one sequence (batch size 1) of a
decoder-only model (Llama-shaped: full attention in every layer). Its KV is kept in
kvtier pages, page-first (:attr:`KVSpec.page_shape`):

* Full pages are **published** in the :class:`~kvtier.cache.KVCache` under content keys
  (hash of the parent page, the page's token ids and the namespace), so they are visible
  to later requests and free to move down the hierarchy under watermark pressure.
* The newest, partial page lives in one **working slot** of the top-tier arena, reserved
  under a private key (invisible to lookups, never evicted).
* At the start of each forward pass every published page of the sequence is loaded into
  the top tier and pinned (one batched ``load``: pages that were moved down are faulted
  back); the pins are released when the last layer has run, so between forward passes
  the pages may move down again.
* Attention reads each layer's K and V with one gather over the arena (the pages plus the
  working slot). While layer *L* computes, the gather of layer *L + 1* runs on a helper
  thread (layer prefetch); set ``layer_prefetch=False`` to gather on demand.

**Prefix reuse.** :meth:`KVTierCache.load_prefix` finds the longest cached prefix of a
prompt (in any tier) and makes the cache start there, so ``model.generate(input_ids,
cache=c)`` only prefills the rest.

**Threads.** A ``KVCache`` belongs to the event loop that opened it; the model runs in
another thread (an executor in a server, the main thread in a script). A
:class:`KVTierBridge` carries every cache call to that loop and waits for it, so calling
into a bridge *from the loop thread* raises instead of deadlocking. For scripts and tests
:meth:`KVTierBridge.start` opens a cache on a private loop thread.

**Token ids.** Page keys hash token ids, which a ``Cache`` never sees: :func:`attach`
registers a forward pre-hook on the model that hands each forward's ``input_ids`` to the
``KVTierCache`` passed as ``cache=``. A forward with ``inputs_embeds`` only, with images
or other data inputs beyond the token ids (:func:`~kvtier.integrations.hf_attach.
other_inputs`), a batch larger than 1, or a model whose geometry does not match the
cache's :class:`KVSpec` raises :class:`~kvtier.errors.KVTierUsageError`.

Example::

    with KVTierBridge.start(config) as bridge:
        attach(model)
        with bridge.new_cache() as c:
            c.load_prefix(input_ids)           # reuse what kvtier has
            out = model.generate(input_ids, cache=c, max_new_tokens=32, do_sample=False)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import json
import threading
import weakref
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import xxhash

from kvtier.backend import ArenaBackend
from kvtier.cache import KVCache
from kvtier.config import KVTierConfig, ResolvedConfig
from kvtier.errors import KVTierUsageError
from kvtier.integrations.hf_attach import attach
from kvtier.integrations.hf_cache import KVTierCache
from kvtier.integrations.hf_parts import (
    PREFIX_PREFETCH_DEADLINE_S,
    WORKING_KEYS,
    WORKING_NAMESPACE,
    KVTierCacheStats,
    PrefixLostError,
    arena_pages,
    spec_for_model,
)
from kvtier.keys import Namespace
from kvtier.log import get_logger
from kvtier.spec import KVSpec

__all__ = [
    "PREFIX_PREFETCH_DEADLINE_S",
    "WORKING_KEYS",
    "WORKING_NAMESPACE",
    "KVTierBridge",
    "KVTierCache",
    "KVTierCacheStats",
    "PrefixLostError",
    "attach",
    "spec_for_model",
]

T = TypeVar("T")
_log = get_logger("kvtier.transformers")


def warn_unnamed_checkpoint(cache: KVCache, source: str) -> bool:
    """Warn (and return True) when the model comes from checkpoint ``source`` (its
    config's ``_name_or_path``) and the cache's namespace model id does not name it: the
    model id is only the shape's name (``namespace.model_id`` unset), so another checkpoint
    of the same shape and dtype would read this one's KV, or it names another checkpoint
    (neither the same string nor the same last path part: ``org/Llama-3.1-8B`` names
    ``/models/Llama-3.1-8B``), whose pages this model would then read and write."""
    model_id = cache.namespace.model_id
    if not source or Path(model_id).name in (source, Path(source).name) or model_id == source:
        return False
    unset = model_id == cache.spec.name
    _log.warning(
        "hf.namespace_not_the_checkpoint",
        model_id=model_id,
        checkpoint=source,
        advice="set namespace.model_id (and namespace.revision) to this checkpoint: "
        + (
            "another checkpoint of the same shape would share its pages"
            if unset
            else "pages are keyed by the namespace, so if this is not the model it names, "
            "the two read each other's KV"
        ),
    )
    return True


def namespace_for_config(namespace: Namespace, digest: str) -> Namespace:
    """``namespace`` with a model config's digest (:func:`config_digest`) in its revision:
    KV computed under one config (another ``rope_theta``, a rope scaling override) is never
    served to a model of another, across restarts too (a bridge's own check sees one
    process only)."""
    return dataclasses.replace(namespace, revision=f"{namespace.revision}+hf-config.{digest}")


#: Config fields that do not change a token's KV (run options, bookkeeping).
_KV_NEUTRAL_CONFIG = frozenset({
    "_name_or_path", "transformers_version", "architectures", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states", "torch_dtype", "dtype",
})  # fmt: skip


def config_digest(model_config: Any) -> str | None:
    """A digest of the fields of a transformers config that can change a token's KV (all
    but :data:`_KV_NEUTRAL_CONFIG`; the dtype is the spec's), ``None`` without a config."""
    to_dict = getattr(model_config, "to_dict", None)
    if not callable(to_dict):
        return None
    fields = {k: v for k, v in to_dict().items() if k not in _KV_NEUTRAL_CONFIG}
    return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True, default=str).encode())


class KVTierBridge:
    """A :class:`KVCache` plus the event loop that owns it, callable from other threads.

    Args:
        cache: an open cache whose top tier is a memory arena on the host.
        loop: the running loop the cache was opened on.

    Raises:
        KVTierUsageError: the cache is not open, or its top tier is not a host arena.
    """

    def __init__(self, cache: KVCache, loop: asyncio.AbstractEventLoop) -> None:
        if not cache.is_open:
            raise KVTierUsageError("KVTierBridge needs an open KVCache")
        top = cache.tiers[0].backend
        if not isinstance(top, ArenaBackend):
            raise KVTierUsageError(
                f"the top tier {cache.tiers[0].name!r} must be a memory arena: attention "
                "reads KV pages there"
            )
        if not top.host_addressable:
            raise KVTierUsageError(
                f"the top tier {cache.tiers[0].name!r} is device memory; KVTierCache gathers "
                "pages on the host (a DRAM top tier): the device path is not implemented"
            )
        self.cache = cache
        self.loop = loop
        self.arena: ArenaBackend = top
        self.top_tier: str = cache.tiers[0].name
        self.spec: KVSpec = cache.spec
        self._pages = arena_pages(top, cache.spec)
        self._thread: threading.Thread | None = None
        self._checkpoint: str | None = None  # the first checkpoint seen: pages are its KV
        self._config: str | None = None  # and the digest of its config (config_digest)
        self._namespace: Namespace = cache.namespace  # with that digest once known

    @property
    def namespace(self) -> Namespace:
        """The namespace this bridge's caches key their pages in: the cache's, with the
        digest of the first model config given to :meth:`new_cache` in its revision
        (:func:`namespace_for_config`; before that, the cache's own)."""
        return self._namespace

    def namespace_for(self, model_config: Any) -> Namespace:
        """The namespace caches of ``model_config`` key their pages in, e.g. to look a
        prompt up before any cache exists (``bridge.cache.lookup(tokens,
        namespace=bridge.namespace_for(model.config))``)."""
        digest = config_digest(model_config)
        ns = self.cache.namespace
        return ns if digest is None else namespace_for_config(ns, digest)

    # -- running coroutines on the cache's loop -----------------------------------------

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the cache's loop and wait for its result (re-raising its error).

        Raises :class:`KVTierUsageError` when called from that loop's own thread (waiting
        there would deadlock: run the model in an executor instead).
        """
        if self._on_loop_thread():
            coro.close()
            raise KVTierUsageError(
                "KVTierCache was used on the event loop that owns the KVCache; run the model "
                "in an executor thread (loop.run_in_executor) so the loop stays free"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _on_loop_thread(self) -> bool:
        """Whether the caller runs on the cache's own loop (where waiting deadlocks)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the cache's loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def new_cache(self, model_config: Any = None, layer_prefetch: bool = True) -> KVTierCache:
        """A fresh :class:`KVTierCache` for one sequence (checked against ``model_config``
        when given; a checkpoint the namespace does not name is warned about once).

        Raises :class:`KVTierUsageError` when called on the loop that owns the
        :class:`KVCache` (every use of the cache would wait on that loop: deadlock)."""
        if self._on_loop_thread():
            raise KVTierUsageError(
                "new_cache() was called on the event loop that owns the KVCache; create and "
                "use KVTierCache in an executor thread (loop.run_in_executor) so the loop "
                "stays free"
            )
        if not self.cache.is_open or self.loop.is_closed():
            raise KVTierUsageError("new_cache() on a closed bridge: its KVCache is closed")
        cache = KVTierCache(self, model_config, layer_prefetch=layer_prefetch)  # geometry
        source = str(getattr(model_config, "_name_or_path", "") or "")
        digest = config_digest(model_config)
        if source and self._checkpoint is None:
            self._checkpoint = source
            warn_unnamed_checkpoint(self.cache, source)
        if digest is not None and self._config is None:
            self._config = digest
            self._namespace = namespace_for_config(self.cache.namespace, digest)
        try:
            self._refuse_another({source} - {""}, {digest} if digest is not None else set())
        except KVTierUsageError:
            cache.close()
            raise
        cache.namespace = self._namespace
        return cache

    def check_model_config(self, model_config: Any) -> None:
        """Raise :class:`KVTierUsageError` when a forward's model (``model_config``) is
        not the one this bridge's pages are for (see :meth:`_refuse_another`). A cache
        made for one model and passed to another would publish that model's KV as the
        first one's. A multimodal model runs the caches made from its text config
        (``get_text_config()``): either config's name and digest count."""
        text = getattr(model_config, "get_text_config", None)
        configs = [model_config, *([text()] if callable(text) else [])]
        sources = {str(getattr(c, "_name_or_path", "") or "") for c in configs} - {""}
        digests = {d for c in configs if (d := config_digest(c)) is not None}
        self._refuse_another(sources, digests)

    def _refuse_another(self, sources: set[str], digests: set[str]) -> None:
        """Raise :class:`KVTierUsageError` unless the checkpoint names ``sources`` and
        config digests ``digests`` (either may be empty: unknown) include the bridge's
        first ones. One bridge has one namespace: a second checkpoint of the same shape,
        or the same one with a config that computes other KV for the same token ids (a
        rope scaling override, another rope theta), would read and write its pages."""
        model_id = self.cache.namespace.model_id
        if sources and self._checkpoint is not None and self._checkpoint not in sources:
            raise KVTierUsageError(
                f"this bridge serves checkpoint {self._checkpoint!r} (namespace model id "
                f"{model_id!r}); {min(sources)!r} needs its own bridge with its own "
                "namespace.model_id (a KVTierCache serves the model it was made for)"
            )
        if digests and self._config is not None and self._config not in digests:
            raise KVTierUsageError(
                f"this bridge serves another model config (namespace model id {model_id!r}): "
                "this model's config differs from it (an override such as rope scaling "
                "changes the KV of the same tokens; a KVTierCache serves the model it was "
                "made for): open another bridge with its own namespace.model_id or revision"
            )

    @property
    def pages(self) -> torch.Tensor:
        """The whole top-tier arena as ``[capacity, *page_shape]`` of the KV dtype (a view)."""
        return self._pages

    # -- a private loop for scripts and tests -------------------------------------------

    @classmethod
    @contextmanager
    def start(
        cls,
        config: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
        **kwargs: Any,
    ) -> Iterator[KVTierBridge]:
        """Open a :class:`KVCache` on a new loop thread; close it (and stop the thread) on
        exit. ``kwargs`` go to :class:`KVCache` (e.g. ``env={}``).

        A ``with`` never left (the script ends inside it) is closed as the interpreter
        exits, with a warning, while its threads can still run: it hung the exit for good
        and lost the last pages ("cannot schedule new futures after interpreter
        shutdown")."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kvtier-loop", daemon=True)
        thread.start()
        stop = _LoopStopper(loop, thread)
        try:
            cache = asyncio.run_coroutine_threadsafe(KVCache.open(config, **kwargs), loop).result()
            stop.cache = cache
            _close_at_exit(stop)
            bridge = cls(cache, loop)
            bridge._thread = thread
            yield bridge
        finally:
            stop()


class _LoopStopper:
    """Closes a :meth:`KVTierBridge.start` cache and stops its loop thread, once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self.loop, self.thread = loop, thread
        self.cache: KVCache | None = None
        self._done = threading.Lock()

    def __call__(self, at_exit: bool = False) -> None:
        if not self._done.acquire(blocking=False):
            return  # closed already (or closing in another thread)
        if at_exit and self.cache is not None:
            _log.warning(
                "KVTierBridge.start() was never left (the with block did not end): closing "
                "its cache as the interpreter exits; leave the with block to close it"
            )
        try:
            if self.cache is not None:
                asyncio.run_coroutine_threadsafe(self.cache.close(), self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


def _close_at_exit(stop: _LoopStopper) -> None:
    """Run ``stop(at_exit=True)`` at interpreter exit if it has not run by then: before
    the executors refuse new work and before non-daemon threads are joined (the hooks of
    :mod:`threading`, as :mod:`concurrent.futures` uses them), else through
    :mod:`atexit`. Only a weak reference is kept: a bridge left normally is forgotten."""
    ref = weakref.ref(stop)

    def hook() -> None:
        live = ref()
        if live is not None:
            live(at_exit=True)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(hook)
    except RuntimeError:  # shutting down already, or another Python
        atexit.register(hook)
