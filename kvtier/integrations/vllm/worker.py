"""The worker side of the kvtier connector (one per worker process / rank).

The worker owns the :class:`~kvtier.cache.KVCache`, opened on a private event loop
(:class:`~.loop_thread.LoopThread`) when vLLM registers its KV tensors, and serves the
scheduler's lookups (:mod:`.lookup`). Per step:

* **loads** (:mod:`.loads`): this step's pages, read in one batch and scattered layer by
  layer while the forward runs (``start_load_kv`` -> ``wait_for_layer_load``), and
  asynchronous loads (``kvtier_load_async``) that run across steps while their requests
  wait, reported done through ``get_finished``. A page kvtier cannot give, or a load past
  ``kvtier_load_timeout_s``, is a load error: vLLM recomputes it.
* **saves** (``wait_for_save``): after the forward, the blocks to save are copied into a
  host buffer (on a GPU: a side-stream copy that the next step's compute waits for) and
  handed to ``KVCache.store_pages`` on the loop; the forward does not wait for kvtier.
  Past ``kvtier_save_backlog_mib`` of saves in flight, new saves are dropped (counted; one
  batch always goes when none is in flight: :func:`.worker_parts.save_admitted`): a
  cache may forget, the engine must not slow down.
* **holds**: a finished request whose last pages are saved this step is reported in
  ``get_finished`` once its blocks were copied out.
* **hints** from finished requests (:mod:`.hints`) become ``KVCache.hint`` calls on this
  rank's page keys, made after the step's saves landed (a page stored after a ``close``
  hint would count as used again).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.cache import KVCache
from kvtier.errors import ConfigError
from kvtier.keys import ROOT_KEY, PageKey, page_keys
from kvtier.log import get_logger

from . import identity
from .groups import KVGroups
from .hints import HintCall, apply_hints_after, hint_calls
from .identity import ParallelPlace
from .loads import Loads
from .lookup import FLAG_PREFETCH, LookupAnswer, LookupServer, lookup_answer_runs, socket_path
from .loop_thread import LoopThread, close_at_exit
from .metadata import KVTierMetadata, PageRun
from .metrics_http import MetricsServer
from .paged import PagedKV
from .scope import scoped
from .settings import ConnectorSettings
from .stats import KVTierConnectorStats, KVTierKVEvents
from .worker_parts import DirectoryEvents, SaveBatch, label_runs, layer_index, save_admitted

_log = get_logger("kvtier.vllm.worker")

#: deadline of the prefetch a lookup starts for pages below the top tier (seconds)
LOOKUP_PREFETCH_DEADLINE_S = 10.0
#: the most KV events kept between two reports (older ones are dropped)
MAX_EVENTS = 100_000
#: seconds ``shutdown`` waits for the cache to close
CLOSE_TIMEOUT_S = 120.0


class WorkerSide:
    """Worker-side state of one rank (see the module docstring)."""

    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        place: ParallelPlace,
        runtime: Path,
        loads: bool,
        saves: bool,
        groups: KVGroups | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.groups = groups or KVGroups()
        self.settings = settings
        self.place = place
        self.runtime = runtime
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.block_size = int(vllm_config.cache_config.block_size)
        self.loop: LoopThread | None = None
        self.cache: KVCache | None = None
        self.paged: PagedKV | None = None
        self.layer_of: dict[str, int] = {}
        self.metrics_port: int | None = None
        self._lookup: LookupServer | None = None
        self._metrics: MetricsServer | None = None
        self.loads: Loads | None = None
        self._keys: dict[str, list[PageKey]] = {}
        self._labels: dict[str, str] = {}  # request -> its namespace label (.scope)
        self._acks: list[tuple[str, Any]] = []
        self._pending_gathers: list[Any] = []
        self._backlog = 0
        self._stats = KVTierConnectorStats()
        self._stats_lock = threading.Lock()
        self._events: collections.deque[Any] = collections.deque(maxlen=MAX_EVENTS)
        self._stores: set[concurrent.futures.Future[None]] = set()
        self._prefetches: set[asyncio.Task[Any]] = set()
        self._hints: list[HintCall] = []

    # -- start-up ----------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Open the cache for the registered tensors and start the lookup service."""
        names = sorted(kv_caches, key=lambda n: (layer_index(n), n))
        self.layer_of = {n: i for i, n in enumerate(names)}
        self.paged = PagedKV([kv_caches[n] for n in names], self.groups.layer_groups(names))
        if self.groups.block_size and self.groups.block_size != self.paged.block_tokens:
            raise ConfigError(
                f"KVTierConnector: vLLM's KV cache manager uses blocks of "
                f"{self.groups.block_size} tokens, but the KV tensors hold blocks of "
                f"{self.paged.block_tokens} (kernel blocks smaller than the manager's are "
                f"not supported)"
            )
        self.block_size = self.paged.block_tokens  # a page: one block of the tensors
        backend = identity.backend_name(self.vllm_config, names[0])
        resolved = identity.resolve(
            self.settings, self.vllm_config, self.paged, backend, self.place
        )
        self.loop = LoopThread(f"kvtier-vllm-r{self.place.rank}")
        self.cache = self.loop.run(self._open(resolved), timeout=CLOSE_TIMEOUT_S)
        self.loads = Loads(
            self.loop,
            self.cache,
            self.paged,
            self.layer_of,
            self._run_keys,
            self.settings.load_timeout_s,
            self._count,
            by_request=self.groups.hybrid,
        )
        close_at_exit(self)  # an engine that is never shut down still closes kvtier
        _log.info(
            "kvtier connector worker ready",
            rank=self.place.rank,
            namespace=self.cache.namespace.label,
            page_bytes=self.cache.spec.page_bytes,
            layers=self.paged.num_layers,
            lookup_socket=str(self._lookup.path) if self._lookup else None,
            metrics_port=self.metrics_port,
        )

    async def _open(self, resolved: Any) -> KVCache:
        cache = KVCache(resolved)
        with identity.config_errors_named(identity.config_origin(self.settings, os.environ)):
            await cache.start()  # a tier's own options are checked only as it opens
        try:
            listener = DirectoryEvents(self.block_size, self._events)
            cache.directory.subscribe(listener)
            listener.announce_held(cache)
            path = socket_path(
                self.runtime,
                identity.engine_id(self.vllm_config),
                self.place.dp_rank,
                self.place.rank,
            )
            self._lookup = LookupServer(path, self._answer)
            await self._lookup.start()
            if self.settings.metrics_port is not None:
                port = self.settings.metrics_port
                self._metrics = MetricsServer(
                    cache.metrics.to_prometheus,
                    self.settings.metrics_host,
                    port + self.place.rank if port else 0,
                )
                try:
                    self.metrics_port = await self._metrics.start()
                except OSError as exc:  # a bad host, a port in use: name the setting
                    raise ConfigError(
                        f"kv_connector_extra_config.kvtier_metrics_host/kvtier_metrics_port: "
                        f"cannot serve kvtier metrics on {self.settings.metrics_host!r} port "
                        f"{port + self.place.rank if port else 0} (rank {self.place.rank}): {exc}"
                    ) from None
        except BaseException:
            if self._lookup is not None:
                await self._lookup.close()
            await cache.close()
            raise
        return cache

    def _prefetch_done(self, task: asyncio.Task[Any]) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.warning("kvtier lookup prefetch failed", error=repr(task.exception()))

    async def _answer(self, tokens: np.ndarray, flags: int, scope: str) -> LookupAnswer:
        """The lookup service: leading pages of ``tokens`` kvtier holds, by tier, in the
        namespace ``scope`` extends (:mod:`.scope`)."""
        cache = self.cache
        assert cache is not None
        hit = await cache.lookup(tokens, namespace=scoped(cache.namespace, scope))
        kinds = {t.name: t.backend.kind.value for t in cache.tiers}
        if flags & FLAG_PREFETCH and hit.keys:
            top = cache.tiers[0].name
            below = [k for k, t in zip(hit.keys, hit.tiers, strict=True) if t != top]
            if below:
                task = asyncio.ensure_future(cache.prefetch(below, LOOKUP_PREFETCH_DEADLINE_S))
                self._prefetches.add(task)
                task.add_done_callback(self._prefetch_done)
        return LookupAnswer(len(hit.keys), lookup_answer_runs(hit.tiers), kinds)

    # -- keys --------------------------------------------------------------------------

    def _apply_tokens(self, meta: KVTierMetadata) -> None:
        assert self.cache is not None
        base = self.cache.namespace
        for d in meta.tokens:
            ns = scoped(base, d.scope)
            self._labels[d.req_id] = ns.label
            keys = self._keys.setdefault(d.req_id, [])
            if d.first_page != len(keys):
                _log.error(
                    "token ids out of step with the scheduler; this request's pages are skipped",
                    request=d.req_id,
                    have_pages=len(keys),
                    got_from=d.first_page,
                )
                self._keys[d.req_id] = keys = []
                continue
            keys.extend(page_keys(d.tokens, ns, keys[-1] if keys else ROOT_KEY))

    def _count(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    def _run_keys(self, run: PageRun) -> list[PageKey] | None:
        keys = self._keys.get(run.req_id, [])
        end = run.first_page + len(run.block_ids)
        if end > len(keys):
            return None
        return keys[run.first_page : end]

    # -- a step ------------------------------------------------------------------------

    def fence_saves(self) -> None:
        """Order every later write to vLLM's blocks after the copies out of them still in
        flight (GPU: the compute stream waits on their events; CPU: copies are already
        done). Called before a step can overwrite blocks: preempted requests' blocks are
        reused at once."""
        if self.paged is None or not self.paged.cuda or not self._pending_gathers:
            return
        stream = torch.cuda.current_stream(self.paged.device)
        for ev in self._pending_gathers:
            stream.wait_event(ev)
        self._pending_gathers = [ev for ev in self._pending_gathers if not ev.query()]

    def bind(self, meta: KVTierMetadata) -> None:
        """Start of a step: learn token ids; plan this step's loads."""
        if self.cache is None or self.paged is None:
            return
        self.fence_saves()
        self._apply_tokens(meta)
        self._hints.extend(hint_calls(meta.hints, lambda rid: self._keys.get(rid, [])))
        if self.loads is not None and self.loads_enabled:
            self.loads.plan(meta)

    def save(self, meta: KVTierMetadata) -> None:
        """End of a step's forward: copy out blocks to save and hand them to kvtier."""
        if self.cache is None or self.paged is None or self.loop is None:
            return
        runs = meta.saves if self.saves_enabled else []
        hints, self._hints = self._hints, []
        if hints:
            with self._stats_lock:
                self._stats.add("hinted_pages", sum(len(k) for _, k, _ in hints))
        batch = SaveBatch.of(runs, self._keys, self._labels, self.cache.namespace.label)
        keys, parents, labels, blocks = batch.keys, batch.parents, batch.labels, batch.blocks
        gather_event = None
        if keys:
            nbytes = len(keys) * self.paged.page_bytes
            with self._stats_lock:
                full = not save_admitted(self._backlog, nbytes, self.settings.save_backlog_bytes)
                if full:
                    self._stats.add("saves_dropped", len(keys))
                else:
                    self._backlog += nbytes
            if not full:
                try:
                    buffer = self.paged.host_buffer(len(keys))
                    gather_event = self.paged.gather(blocks, buffer)
                    store = self._store(keys, parents, labels, buffer, nbytes, gather_event)
                    fut = self.loop.submit(store)
                except Exception as exc:  # a save that cannot start is a future miss
                    _log.warning("kvtier save could not start", pages=len(keys), error=repr(exc))
                    with self._stats_lock:
                        self._backlog -= nbytes
                        self._stats.add("save_failures", len(keys))
                else:
                    if gather_event is not None:
                        self._pending_gathers.append(gather_event)
                    self._stores.add(fut)
                    fut.add_done_callback(self._stores.discard)
        if hints:  # once every save in flight (this step's too) has landed
            self.loop.submit(apply_hints_after(self.cache, list(self._stores), hints))
        for req_id in meta.holds:
            self._acks.append((req_id, gather_event))

    async def _store(
        self,
        keys: list[PageKey],
        parents: list[PageKey | None],
        labels: list[str],
        buffer: torch.Tensor,
        nbytes: int,
        gather_event: Any,
    ) -> None:
        cache = self.cache
        assert cache is not None
        started = time.perf_counter()
        stored = 0
        try:
            if gather_event is not None:
                await asyncio.get_running_loop().run_in_executor(None, gather_event.synchronize)
            for label, a, b in label_runs(labels):
                result = await cache.store_pages(keys[a:b], buffer[a:b], parents[a:b], label)
                stored += sum(result)
        except Exception as exc:
            _log.warning("kvtier save failed", pages=len(keys), error=repr(exc))
        finally:
            with self._stats_lock:
                self._backlog -= nbytes
                self._stats.add("saved_pages", stored)
                self._stats.add("save_bytes", stored * (nbytes // max(1, len(keys))))
                self._stats.add("save_seconds", time.perf_counter() - started)
                self._stats.add("save_failures", len(keys) - stored)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(held requests whose blocks were copied out, requests whose asynchronous load
        is done: their failed blocks join this step's load errors, requests whose
        asynchronous load failed: several KV cache groups); forget finished requests'
        keys."""
        received = self.loads.received() if self.loads is not None else set()
        failed = self.loads.failed() if self.loads is not None else set()
        done: set[str] = set()
        keep: list[tuple[str, Any]] = []
        for req_id, ev in self._acks:
            if ev is None or ev.query():
                done.add(req_id)
            else:
                keep.append((req_id, ev))
        self._acks = keep
        for req_id in finished_req_ids:
            self._keys.pop(req_id, None)
            self._labels.pop(req_id, None)
        return done, received, failed

    def load_errors(self) -> set[int]:
        return self.loads.errors() if self.loads is not None else set()

    def start_load(self) -> None:
        if self.loads is not None:
            self.loads.start()

    def wait_layer(self, layer_name: str) -> None:
        if self.loads is not None:
            self.loads.wait_layer(layer_name)

    def take_stats(self) -> KVTierConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVTierConnectorStats()
        return out

    def take_events(self) -> KVTierKVEvents | None:
        if not self._events:
            return None
        events = []
        while self._events:
            events.append(self._events.popleft())
        return KVTierKVEvents(events)

    # -- shutdown ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Let saves in flight land, close the lookup service and the cache (dirty pages
        are written down per the write policy), stop the loop."""
        if self.loop is None:
            return
        loop, self.loop = self.loop, None
        try:
            concurrent.futures.wait(list(self._stores), timeout=CLOSE_TIMEOUT_S)
            loop.run(self._close(), timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:
            _log.warning("kvtier connector shutdown incomplete", error=repr(exc))
        finally:
            loop.stop()
            if self.loads is not None:
                self.loads.shutdown()

    async def _close(self) -> None:
        for task in list(self._prefetches):
            task.cancel()
        if self._lookup is not None:
            await self._lookup.close()
        if self._metrics is not None:
            await self._metrics.close()
        if self.cache is not None:
            await self.cache.close()
