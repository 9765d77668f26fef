"""A worker's loads of kvtier pages into vLLM's blocks (see :mod:`.worker`).

* **This step's load** (synchronous, ``start_load_kv`` -> ``wait_for_layer_load``): one
  batched ``KVCache.read`` of every page into a host buffer (checksums verified below
  DRAM), then a helper thread scatters the pages into vLLM's blocks layer by layer;
  :meth:`Loads.wait_layer` waits only for one layer, so attention on the first layers
  runs while later layers are still being written.
* **Asynchronous loads** (``kvtier_load_async``): the same read and scatter, started when
  the step's metadata arrives and run on a thread of their own across steps, while the
  requests they are for wait; :meth:`Loads.received` names each such request once its
  pages are in its blocks (on a GPU: once the copies completed), and its failed blocks
  join the load errors of the same step.

A page kvtier cannot give (evicted since the lookup, a failed checksum, a tier down) or a
load past ``kvtier_load_timeout_s`` makes its block a load error (:meth:`Loads.errors`,
``get_block_ids_with_load_errors``): vLLM recomputes it. With several KV cache groups
(:mod:`.groups`; every load is then asynchronous) the request is the unit instead
(:meth:`Loads.failed`, ``failed_recving``): vLLM recomputes its KV. Blocks are never
written after vLLM was told they are loaded or failed.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable

import torch

from kvtier.cache import KVCache
from kvtier.keys import PageKey
from kvtier.log import get_logger

from .groups import NOT_HELD, Block
from .loop_thread import LoopThread
from .metadata import KVTierMetadata, PageRun
from .paged import PagedKV
from .worker_parts import LoadJob

_log = get_logger("kvtier.vllm.worker")

#: Adds ``value`` to the connector counter ``name`` (thread-safe).
Count = Callable[[str, float], None]
#: A job's scatter: (job, its read, the host buffer read into, when the read started).
Scatter = Callable[[LoadJob, concurrent.futures.Future[list[bool]], torch.Tensor, float], None]


class Loads:
    """One worker's loads: this step's job and the asynchronous jobs in flight."""

    def __init__(
        self,
        loop: LoopThread,
        cache: KVCache,
        paged: PagedKV,
        layer_of: dict[str, int],
        run_keys: Callable[[PageRun], list[PageKey] | None],
        load_timeout_s: float,
        count: Count,
        by_request: bool = False,
    ) -> None:
        """``run_keys``: a run's page keys, ``None`` when the worker lacks its token ids;
        ``count``: the connector's counters (``loaded_pages``, ``load_errors``, ...);
        ``by_request``: failures are reported per request (the model has several KV cache
        groups, whatever groups this worker's layers are in)."""
        self.loop = loop
        self.cache = cache
        self.paged = paged
        self.layer_of = layer_of
        self._run_keys = run_keys
        self.load_timeout_s = load_timeout_s
        self._count = count
        self._scatter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._async_scatter = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-async-load"
        )
        self._load: LoadJob | None = None
        self._errors: set[int] = set()
        self.by_request = by_request
        self._failed: set[str] = set()
        #: asynchronous loads in flight: (the requests they are for, the job)
        self._async_jobs: list[tuple[set[str], LoadJob]] = []
        #: requests whose asynchronous load could not start (reported done, all failed)
        self._async_failed: set[str] = set()

    def _record_failed(self, blocks: Iterable[Block], reqs: Iterable[str]) -> None:
        """Loads of ``blocks`` (for ``reqs``) failed: load errors, or failed requests."""
        if self.by_request:
            self._failed.update(reqs)
        else:
            self._errors.update(b for b in blocks if isinstance(b, int) and b != NOT_HELD)

    def plan(self, meta: KVTierMetadata) -> None:
        """Start of a step: plan its load, start its asynchronous loads."""
        self._load = None
        if meta.async_loads:
            self._start_async(meta.async_loads)
        if meta.loads:
            self._load = self._job(meta.loads)

    def _job(self, runs: list[PageRun]) -> LoadJob | None:
        """One job loading ``runs``; runs whose keys the worker lacks are load errors."""
        keys: list[PageKey] = []
        blocks: list[Block] = []
        reqs: list[str] = []
        for run in runs:
            run_keys = self._run_keys(run)
            if run_keys is None:
                self._record_failed(run.block_ids, [run.req_id])
                continue
            keys.extend(run_keys)
            blocks.extend(run.block_ids)
            reqs.extend([run.req_id] * len(run_keys))
        if not keys:
            return None
        deadline = time.monotonic() + self.load_timeout_s
        return LoadJob(keys, blocks, reqs, deadline, self.paged.num_layers)

    def _submit(
        self, job: LoadJob, pool: concurrent.futures.ThreadPoolExecutor, work: Scatter, what: str
    ) -> bool:
        """Start ``job``'s read into a new host buffer and hand both to ``work`` on
        ``pool``; ``False`` (logged) when the read cannot start."""
        started = time.perf_counter()
        try:
            buffer = self.paged.host_buffer(len(job.keys))
            read = self.loop.submit(self.cache.read(job.keys, buffer))
        except Exception as exc:
            _log.warning(f"kvtier {what} could not start; recomputing", error=repr(exc))
            return False
        job.done = pool.submit(work, job, read, buffer, started)
        return True

    # -- this step's load ------------------------------------------------------------------

    def start(self) -> None:
        """Start this step's read and scatter (``start_load_kv``)."""
        job = self._load
        if job is None or job.done is not None:
            return
        if not self._submit(job, self._scatter, self._scatter_job, "load"):
            self._fail(job)

    def _fail(self, job: LoadJob) -> None:
        with job.lock:
            job.cancelled = True
            job.failed = set(job.blocks)
        for ev in job.ready:
            ev.set()

    def _scatter_job(
        self,
        job: LoadJob,
        read: concurrent.futures.Future[list[bool]],
        buffer: torch.Tensor,
        started: float,
    ) -> None:
        paged = self.paged
        try:
            try:
                ok = read.result(max(0.0, job.deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                read.cancel()
                _log.warning("kvtier load timed out; recomputing", pages=len(job.keys))
                ok = [False] * len(job.keys)
            seconds = time.perf_counter() - started
            good = [i for i, g in enumerate(ok) if g]
            bad = {job.blocks[i] for i, g in enumerate(ok) if not g}
            self._count("loaded_pages", len(good))
            self._count("load_bytes", len(good) * paged.page_bytes)
            self._count("load_seconds", seconds)
            self._count("load_errors", len(bad))
            blocks = [job.blocks[i] for i in good]
            partial = len(good) < len(job.keys)
            staged = paged.stage(buffer, len(job.keys), rows=good if partial else None)
            for layer in range(job.layers):
                with job.lock:
                    if job.cancelled:
                        break
                    job.events[layer] = paged.scatter_layer(layer, blocks, staged)
                job.ready[layer].set()
            with job.lock:
                if not job.cancelled:
                    job.failed = bad
        except Exception as exc:
            _log.warning("kvtier load failed; recomputing", error=repr(exc))
            with job.lock:
                job.cancelled = True
                job.failed = set(job.blocks)
        finally:
            for ev in job.ready:
                ev.set()

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's loaded KV of ``layer_name`` is in place."""
        job = self._load
        if job is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        if job.done is None:
            self.start()
        if not job.ready[layer].wait(max(0.0, job.deadline - time.monotonic())):
            _log.warning("kvtier load timed out in the forward; recomputing", layer=layer_name)
            self._fail(job)
            return
        ev = job.events[layer]
        if ev is not None:
            torch.cuda.current_stream(self.paged.device).wait_event(ev)

    def _finish(self) -> None:
        job, self._load = self._load, None
        if job is None:
            return
        if job.done is None:  # never started (no forward): nothing was written
            self._record_failed(job.blocks, job.reqs)
            return
        try:
            job.done.result(max(1.0, job.deadline - time.monotonic()))
        except Exception:
            self._fail(job)
        with job.lock:
            job.cancelled = True  # nothing is written after this point
            self._record_failed(job.failed, job.failed_requests())

    # -- asynchronous loads ----------------------------------------------------------------

    def _start_async(self, runs: list[PageRun]) -> None:
        reqs = {run.req_id for run in runs}
        job = self._job(runs)
        if job is None:  # no run's keys known: all failed, reported done at once
            self._async_failed |= reqs  # (their failures: recorded by _job)
            return
        if not self._submit(job, self._async_scatter, self._settled_scatter, "async load"):
            self._record_failed(job.blocks, reqs)
            self._async_failed |= reqs
            return
        self._async_jobs.append((reqs, job))

    def _settled_scatter(
        self,
        job: LoadJob,
        read: concurrent.futures.Future[list[bool]],
        buffer: torch.Tensor,
        started: float,
    ) -> None:
        """:meth:`_scatter_job`, then wait until the copies are complete (on a GPU, its
        side stream's events): vLLM reads the blocks once the load is reported done."""
        self._scatter_job(job, read, buffer, started)
        for ev in job.events:
            if ev is not None:
                ev.synchronize()

    def received(self) -> set[str]:
        """Requests whose asynchronous load is over (each named once); their failed
        blocks join the errors :meth:`errors` returns next."""
        received, self._async_failed = self._async_failed, set()
        running: list[tuple[set[str], LoadJob]] = []
        for reqs, job in self._async_jobs:
            if job.done is None or not job.done.done():
                running.append((reqs, job))
                continue
            with job.lock:
                job.cancelled = True  # nothing is written after this point
                if job.done.exception() is not None:  # its copies may not have completed
                    job.failed = set(job.blocks)
                self._record_failed(job.failed, job.failed_requests())
            received |= reqs
        self._async_jobs = running
        return received

    def errors(self) -> set[int]:
        """Blocks whose load failed since the last call: this step's load (waited for
        now) and the asynchronous loads :meth:`received` reported (one KV cache group)."""
        self._finish()
        out, self._errors = self._errors, set()
        return out

    def failed(self) -> set[str]:
        """Requests whose asynchronous load :meth:`received` reported failed, in part or
        whole, since the last call (several KV cache groups)."""
        out, self._failed = self._failed, set()
        return out

    def shutdown(self) -> None:
        """Stop taking work; threads still running finish on their own."""
        self._scatter.shutdown(wait=False)
        self._async_scatter.shutdown(wait=False)
