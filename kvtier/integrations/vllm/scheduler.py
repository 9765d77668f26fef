"""The scheduler side of the kvtier connector (engine-core process).

Per request it decides what the workers load and save, in whole vLLM blocks (one block =
one kvtier page):

* :meth:`SchedulerSide.match` (``get_num_new_matched_tokens``): asks the workers' lookup
  service (:mod:`.lookup`) how many leading pages of the prompt kvtier holds in any tier
  — this process, an earlier process (NVMe), other servers (the remote tier) — and answers
  the part beyond vLLM's own prefix cache. At least one prompt token is always left to
  compute. Answers are kept for :data:`ANSWER_TTL_S` so a request that waits for blocks is
  not looked up every step.
* :meth:`SchedulerSide.after_alloc` turns an accepted hit into a load of those pages into
  the blocks vLLM allocated for them: within the step that computes the rest of the
  prompt, or across steps (``kvtier_load_async``: the request waits while other requests
  run; the workers report the load done through ``get_finished``, and its failed blocks
  with it).
* :meth:`SchedulerSide.build_meta` adds, per scheduled request, saves of the pages that
  are full and verified after this step: prompt tokens as soon as their KV is written;
  generated tokens only once accepted (speculative tokens never reach kvtier). Pages
  kvtier already holds are not saved again.
* :meth:`SchedulerSide.finished` saves the last full pages of a finished request and
  holds its blocks (returns ``True``) until the workers copied them out; the workers
  report that through ``get_finished``. The hints in the request's
  ``kv_transfer_params["kvtier"]`` (:mod:`.hints`) go to the workers with those saves.

Requests whose KV is not a function of their token ids alone (a LoRA adapter, a cache
salt: their own namespace; prompt embeddings: their own namespace, keyed by the
embeddings; multimodal inputs: left alone) follow :mod:`.scope`.

With several KV cache groups (vLLM's hybrid KV cache manager, :mod:`.groups`) a page's
block is one per group: a page is saved only while every group holds it, and every load
runs asynchronously (a failed one is reported per request: vLLM cannot map a block id back
to a request when ids repeat across groups).

Roles: ``kv_both`` loads and saves, ``kv_producer`` only saves, ``kv_consumer`` only
loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierUsageError
from kvtier.log import get_logger

from .groups import NOT_HELD, Block, KVGroups, page_blocks, saveable_runs
from .hints import HintRun, RequestHints, parse_request_hints
from .identity import ParallelPlace, engine_id
from .lookup import FLAG_PREFETCH, LookupAnswer, LookupClient, socket_path
from .metadata import KVTierMetadata, PageRun, TokenDelta
from .scope import RequestScope, key_ids, request_scope
from .settings import ConnectorSettings
from .stats import KVTierConnectorStats

_log = get_logger("kvtier.vllm.scheduler")

#: seconds a lookup answer is reused for the same request and prompt length
ANSWER_TTL_S = 0.5


@dataclass
class _Request:
    request: Any
    answer: LookupAnswer | None = None
    answered_at: float = 0.0
    answered_pages: int = -1  # the page limit the answer was for
    local_tokens: int = 0  # vLLM's own (block-aligned) hit at the last match
    saved_pages: int = 0  # pages [0, saved_pages) are in kvtier or being saved
    sent_pages: int = 0  # pages whose token ids the workers have
    loads: list[PageRun] = field(default_factory=list)
    load_async: bool = False  # the last match asked vLLM to load across steps
    #: the first page whose load failed: never offered again (vLLM matches a request again
    #: after its asynchronous load failed, or after a preemption), and neither it nor a
    #: page after it is saved from this request (see ``loads_reported``)
    failed_page: int | None = None
    hints: RequestHints | None = None
    scope: RequestScope = field(default_factory=RequestScope)


def _before_failure(st: _Request, pages: int) -> int:
    """``pages`` cut at the request's first failed page: neither offered nor saved from
    there (see ``SchedulerSide.loads_reported``)."""
    return pages if st.failed_page is None else min(pages, st.failed_page)


class SchedulerSide:
    """Scheduler-side state of one engine (see the module docstring)."""

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
        self.groups = groups or KVGroups()
        self.block_size = self.groups.block_size or int(vllm_config.cache_config.block_size)
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.settings = settings
        eid = engine_id(vllm_config)
        paths = [socket_path(runtime, eid, place.dp_rank, r) for r in range(place.world)]
        self.client = LookupClient(paths, settings.lookup_timeout_s)
        self.kv_cache_manager: Any = None
        self._reqs: dict[str, _Request] = {}
        self._pending_loads: list[PageRun] = []
        self._pending_async: list[PageRun] = []
        self._final_saves: list[PageRun] = []
        self._final_tokens: list[TokenDelta] = []
        self._holds: list[str] = []
        self._final_hints: list[HintRun] = []
        self._stats = KVTierConnectorStats()
        self._events: list[Any] = []
        self._hit_tiers: dict[str, dict[str, int]] = {}
        #: loads sent to the workers, by request, until their step's output came back
        self._inflight_loads: dict[str, list[PageRun]] = {}
        #: asynchronous loads sent to the workers, until the workers report them done
        self._async_loads: dict[str, list[PageRun]] = {}

    # -- lookup ------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Request(request, scope=request_scope(request))
            if st.scope.skip is not None:  # kvtier cannot name its KV: left alone
                self._stats.add("unkeyed_requests", 1)
                return st
            try:
                st.hints = parse_request_hints(getattr(request, "kv_transfer_params", None))
            except Exception as exc:  # advice only: a bad hint never fails the request
                self._stats.add("hint_errors", 1)
                detail = str(exc) if isinstance(exc, KVTierUsageError) else repr(exc)
                _log.warning(
                    "ignoring a request's kvtier hints", request=request.request_id, error=detail
                )
        return st

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvtier can give beyond ``num_computed_tokens`` (block-aligned), and
        whether they load asynchronously (``kvtier_load_async``)."""
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        limit = (int(request.num_tokens) - 1) // self.block_size  # keep >= 1 token to compute
        if limit <= 0 or st.scope.skip is not None:
            return 0, False
        now = time.monotonic()
        if st.answered_pages != limit or now - st.answered_at > ANSWER_TTL_S:
            tokens = key_ids(st.scope, request.all_token_ids, 0, limit, self.block_size)
            flags = FLAG_PREFETCH if self.loads_enabled and self.settings.prefetch_on_lookup else 0
            self._stats.add("lookups", 1)
            ans = self.client.lookup(tokens, flags, st.scope.suffix)
            if ans is None:
                self._stats.add("lookup_errors", 1)
            st.answer, st.answered_at, st.answered_pages = ans, now, limit
        answered = min(st.answer.pages, limit) if st.answer is not None else 0
        matched = _before_failure(st, answered)
        st.saved_pages = max(st.saved_pages, matched)
        if not self.loads_enabled:
            return 0, False
        offered = max(0, matched * self.block_size - num_computed_tokens)
        mode = self.settings.load_async
        first = num_computed_tokens // self.block_size
        st.load_async = offered > 0 and (
            mode == "always"
            or self.groups.hybrid
            or (
                mode == "below-top"
                and st.answer is not None
                and st.answer.below_top(first, matched - first) > 0
            )
        )
        return offered, st.load_async

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of an accepted hit into the request's new blocks."""
        st = self._state(request)
        if num_external_tokens <= 0 or not self.loads_enabled:
            return
        first = st.local_tokens // self.block_size
        count = num_external_tokens // self.block_size
        if count * self.block_size != num_external_tokens or st.local_tokens % self.block_size:
            _log.warning(
                "vLLM accepted a kvtier hit that is not block-aligned; loading whole blocks only",
                request=request.request_id,
                local_tokens=st.local_tokens,
                external_tokens=num_external_tokens,
            )
        block_ids = page_blocks(blocks.get_block_ids(), first, first + count, self._null_id())
        if len(block_ids) != count:
            _log.warning("fewer blocks than pages to load", request=request.request_id)
            count = len(block_ids)
        if count <= 0:
            return
        run = PageRun(request.request_id, first, block_ids)
        if st.load_async:
            self._pending_async.append(run)
            self._stats.add("async_loads", 1)
        else:
            self._pending_loads.append(run)
        st.saved_pages = max(st.saved_pages, first + count)
        if st.answer is not None:
            tiers = st.answer.tier_pages(first, count)
            self._stats.add_hits({t: n * self.block_size for t, n in tiers.items()})
            self._hit_tiers[request.request_id] = tiers

    def hit_sources(self, request: Any) -> dict[tuple[str, str], int]:
        """Tokens of the planned load of ``request`` by (tier name, backend kind)."""
        st = self._reqs.get(request.request_id)
        kinds = st.answer.kinds if st is not None and st.answer is not None else {}
        return {
            (tier, kinds.get(tier, "")): pages * self.block_size
            for tier, pages in self._hit_tiers.get(request.request_id, {}).items()
        }

    # -- per step ----------------------------------------------------------------------

    def _tokens_upto(self, st: _Request, end_page: int, meta: KVTierMetadata) -> None:
        """Send the token ids of pages ``[st.sent_pages, end_page)`` to the workers."""
        if end_page <= st.sent_pages:
            return
        ids = key_ids(st.scope, st.request.all_token_ids, st.sent_pages, end_page, self.block_size)
        meta.tokens.append(TokenDelta(st.request.request_id, st.sent_pages, ids, st.scope.suffix))
        st.sent_pages = end_page

    def build_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = KVTierMetadata()
        for run in self._pending_loads:
            st = self._reqs.get(run.req_id)
            if st is None:
                continue
            self._tokens_upto(st, run.first_page + len(run.block_ids), meta)
            meta.loads.append(run)
            self._inflight_loads.setdefault(run.req_id, []).append(run)
        self._pending_loads = []
        for run in self._pending_async:
            # sent even for a request gone meanwhile: vLLM frees its blocks only once the
            # workers report its load over (one without token ids fails at once)
            st = self._reqs.get(run.req_id)
            if st is not None:
                self._tokens_upto(st, run.first_page + len(run.block_ids), meta)
            meta.async_loads.append(run)
            self._async_loads.setdefault(run.req_id, []).append(run)
        self._pending_async = []
        if self.saves_enabled:
            spec = scheduler_output.scheduled_spec_decode_tokens or {}
            for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(req_id)
                if st is None or st.scope.skip is not None:
                    continue
                req = st.request
                verified = int(req.num_computed_tokens) + int(n_sched) - len(spec.get(req_id, ()))
                full = _before_failure(st, min(verified, len(req.all_token_ids)) // self.block_size)
                if full <= st.saved_pages:
                    continue
                block_ids = self._blocks(req_id, st.saved_pages, full)
                if len(block_ids) != full - st.saved_pages:
                    continue
                self._tokens_upto(st, full, meta)
                for first, held in saveable_runs(st.saved_pages, block_ids):
                    meta.saves.append(PageRun(req_id, first, held))
                st.saved_pages = full
        meta.tokens.extend(self._final_tokens)
        meta.saves.extend(self._final_saves)
        meta.holds = self._holds
        meta.hints = self._final_hints
        self._final_tokens, self._final_saves, self._holds = [], [], []
        self._final_hints = []
        return meta

    def loads_reported(
        self,
        invalid_block_ids: set[int] | None,
        finished_recving: set[str] | None = None,
        failed_recving: set[str] | None = None,
    ) -> None:
        """A step's output came back: a page whose load failed will be recomputed by vLLM.
        Neither it nor any page after it is saved from this request: in a docs-only probe
        (a damaged NVMe store under heavy preemption) the pages saved after such a
        recompute served wrong tokens on every later run, restarts included (whether
        vLLM 0.32 recomputed them wrong or the save read stale blocks was not
        established). The next request of that prompt misses there, computes the pages
        the ordinary way and saves them. Asynchronous
        loads are looked at until the workers report them done (``finished_recving``):
        their failed blocks come at the latest with that report. A request in
        ``failed_recving`` (several KV cache groups) recomputes its whole asynchronous
        load."""
        for req_id in failed_recving or ():
            st = self._reqs.get(req_id)
            runs = self._async_loads.get(req_id, [])
            if st is None or not runs:
                continue
            page = min(run.first_page for run in runs)
            st.failed_page = page if st.failed_page is None else min(st.failed_page, page)
        loads, self._inflight_loads = self._inflight_loads, {}
        if invalid_block_ids:
            for req_id, runs in self._async_loads.items():
                loads.setdefault(req_id, []).extend(runs)
        for req_id in finished_recving or ():
            self._async_loads.pop(req_id, None)
        if not invalid_block_ids:
            return
        for req_id, runs in loads.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for run in runs:
                bad = [i for i, b in enumerate(run.block_ids) if b in invalid_block_ids]
                if bad:
                    page = run.first_page + bad[0]
                    st.failed_page = page if st.failed_page is None else min(st.failed_page, page)

    def _null_id(self) -> int:
        """vLLM's null block (a sliding-window group's stand-in outside its window)."""
        try:
            return int(self.kv_cache_manager.block_pool.null_block.block_id)
        except AttributeError:  # no block pool (a stand-in manager): no null block
            return NOT_HELD

    def _blocks(self, req_id: str, first: int, end: int) -> list[Block]:
        if self.kv_cache_manager is None:
            return []
        ids = self.kv_cache_manager.get_block_ids(req_id)
        return page_blocks(ids, first, end, self._null_id())

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> bool:
        """A request finished (``block_ids``: its blocks in each KV cache group): save its
        last full pages and pass on its hints; ``True`` holds its blocks until the workers
        copied them out."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._hit_tiers.pop(rid, None)
        if st is None or st.scope.skip is not None:
            return False
        kv_tokens = min(int(request.num_computed_tokens), int(request.num_tokens) - 1)
        full = _before_failure(
            st, min([kv_tokens // self.block_size, *(len(ids) for ids in block_ids)])
        )
        blocks = page_blocks(block_ids, st.saved_pages, full, self._null_id())
        saves = saveable_runs(st.saved_pages, blocks) if self.saves_enabled else []
        hints = st.hints.runs(rid, full, self.block_size) if st.hints is not None else []
        hold = bool(saves)
        if not (hold or hints):
            return False
        scratch = KVTierMetadata()
        self._tokens_upto(st, full, scratch)  # the workers name saved and hinted pages
        self._final_tokens.extend(scratch.tokens)
        self._final_hints.extend(hints)
        if hold:
            self._final_saves.extend(PageRun(rid, first, held) for first, held in saves)
            self._holds.append(rid)
        return hold

    # -- observability -----------------------------------------------------------------

    def take_stats(self) -> KVTierConnectorStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVTierConnectorStats()
        return out

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def take_events(self) -> list[Any]:
        out, self._events = self._events, []
        return out

    def shutdown(self) -> None:
        self.client.close()
