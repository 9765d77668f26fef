"""The facade an inference engine uses: :class:`KVCache`.

Open it from a configuration (a TOML file, ``KVTIER_*`` variables, a dict or a
:class:`~kvtier.config.KVTierConfig`), store pages for token sequences, find the longest
cached prefix, load pages into the top tier (pinned while in use), read them out,
prefetch with a deadline, and close::

    async with KVCache("kvtier.toml") as cache:
        result = await cache.store(tokens, pages)        # pages: [n, page_bytes] uint8
        hit = await cache.lookup(tokens)                 # longest cached prefix + tiers
        loaded = await cache.load(hit.keys)              # into the top tier, pinned
        ...                                              # attention reads the slots
        cache.release(hit.keys)

``async with`` (or :meth:`KVCache.close`) leaves no task behind: prefetch batches not yet
started are cancelled, other work finishes, background write-downs complete, and dirty
pages of memory tiers are written down per the write policy before the backends close.

Bad input raises :class:`~kvtier.errors.KVTierUsageError` naming what was wrong (shape,
dtype, size, key); a tier that fails at run time degrades to misses (``False`` results,
``missing`` keys), never to wrong bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kvtier.backend import Backend, Reservation
from kvtier.cache_hooks import CacheHooks, CacheObserver
from kvtier.cache_input import (
    NamespaceArg,
    PageInput,
    Tokens,
    check_key,
    check_keys,
    check_parents,
    check_store_keys,
    namespace_label,
    namespace_of,
)
from kvtier.cache_open import Owner, check_owner, current_owner, open_backends, report_unwritten
from kvtier.config import KVTierConfig, ResolvedConfig, load_config
from kvtier.errors import KVTierError, KVTierUsageError
from kvtier.index.directory import Directory
from kvtier.index.prefix_tree import PrefixTree
from kvtier.keys import ROOT_KEY, Namespace, PageKey, page_keys
from kvtier.log import configure_logging, get_logger
from kvtier.metrics import CacheMetrics
from kvtier.open_watch import watch_open
from kvtier.policy.admission import make_admission
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import make_hint
from kvtier.policy.leaf_first import LeafFirstPolicy
from kvtier.spec import KVSpec
from kvtier.transfer.pipeline import LoadResult, Pipeline, PrefetchResult
from kvtier.transfer.tier import Tier

__all__ = ["KVCache", "LoadResult", "LookupResult", "PrefetchResult", "StoreResult"]

_log = get_logger("kvtier.cache")


@dataclass
class StoreResult:
    """Result of :meth:`KVCache.store`: the key of each full page and whether it is now
    committed in the top tier."""

    keys: list[PageKey]
    stored: list[bool]


@dataclass
class LookupResult:
    """Result of :meth:`KVCache.lookup`.

    Attributes:
        keys: keys of the longest cached prefix (full pages, in order).
        tiers: the highest tier holding each of those pages.
        cached_tokens: tokens covered by the prefix (``len(keys) * page_tokens``).
    """

    keys: list[PageKey]
    tiers: list[str]
    cached_tokens: int


class KVCache:
    """A tiered KV page cache (see the module docstring).

    Args:
        config: anything :func:`~kvtier.config.load_config` accepts (``None``: the
            embedded default, or ``$KVTIER_CONFIG``).
        env: environment for ``KVTIER_*`` overrides (default ``os.environ``).
        configure_log: apply the config's log format and level to structlog.
        whatif: run what-if sizing (:class:`~kvtier.observers.WhatIfObserver`): each
            tier's hit rate at other capacities, in ``stats()["whatif"]`` and the
            ``kvtier_whatif_hit_rate`` gauge. ``None``: the config's ``observe.whatif``
            (so an engine that opens the cache from a config file can switch it on).
        predictor: run a live prefetch predictor (:class:`~kvtier.prefetcher.
            LivePrefetcher`): ``"prefix"``, ``"lookahead"`` or ``"prefix+lookahead"``;
            ``"none"`` runs none. ``None``: the config's ``observe.predictor``.

    Raises:
        ConfigError: a bad configuration (at construction).
    """

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
        *,
        env: Mapping[str, str] | None = None,
        configure_log: bool = True,
        whatif: bool | None = None,
        predictor: str | None = None,
    ) -> None:
        self.resolved: ResolvedConfig = load_config(config, env)
        self.config: KVTierConfig = self.resolved.config
        self.spec: KVSpec = self.config.spec
        self.namespace: Namespace = self.config.namespace
        self.metrics = CacheMetrics()
        self._input = PageInput(self.spec)
        self.directory = Directory([t.name for t in self.config.tiers])
        #: Radix tree over every tier's committed pages (kept in step with the directory).
        self.prefix_tree = PrefixTree([t.name for t in self.config.tiers])
        self.prefix_tree.attach(self.directory)
        self.tiers: list[Tier] = []
        #: Tiers skipped at open (``on_open_error = "skip"``): name -> why; run without.
        self.skipped_tiers: dict[str, str] = {}
        self._pipeline: Pipeline | None = None
        self._state = "new"  # -> starting -> open -> closing -> closed
        self._owner: Owner | None = None  # every call must come from there (check_owner)
        self._closed = asyncio.Event()
        self._configure_log = configure_log
        #: Engine hints and observers (:mod:`kvtier.cache_hooks`; ``hooks.observers``).
        self.hooks = CacheHooks(self.metrics, lambda: [t.policy for t in self.tiers])
        self.hooks.want(
            self.config.whatif if whatif is None else whatif,
            self.config.predictor if predictor is None else predictor,
        )

    @classmethod
    async def open(
        cls,
        config: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
        **kwargs: Any,
    ) -> KVCache:
        """Construct and start a cache (the non-``async with`` form)."""
        cache = cls(config, **kwargs)
        await cache.start()
        return cache

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    @property
    def pipeline(self) -> Pipeline:
        """The transfer pipeline (raises when the cache is not open)."""
        if self._pipeline is None or self._state != "open":
            raise KVTierUsageError(
                "KVCache is not open: use 'async with KVCache(...)' or 'await KVCache.open(...)'"
                if self._state == "new"
                else f"KVCache is {self._state}"
            )
        check_owner(self._owner)
        return self._pipeline

    def check_usable(self) -> None:
        """Raise :class:`KVTierUsageError` unless the cache is open and this call comes
        from the thread and event loop that opened it (what every call checks first)."""
        self.pipeline  # noqa: B018 -- the property raises

    # -- lifecycle -----------------------------------------------------------------------

    def _make_backend(self, i: int) -> Backend:
        from kvtier.tier_check import create_backend

        return create_backend(self.config, i)

    def _eviction_policy(self, i: int) -> EvictionPolicy:
        """Tier ``i``'s configured policy, offering only prefix-tree leaves when
        ``leaf_first`` is set."""
        tc = self.config.tiers[i]
        policy = make_policy(tc.eviction, **tc.eviction_params)
        if not self.config.leaf_first:
            return policy
        last = i == len(self.config.tiers) - 1
        return LeafFirstPolicy(policy, self.prefix_tree, tc.name, last=last)

    async def start(self) -> None:
        """Create and open the backends, recover persistent tiers into the directory and
        start the pipeline. Raises :class:`KVTierUsageError` when the cache was started
        already (it is open, starting or closed: create a new one).

        A tier whose backend cannot open fails the start (:class:`TierOpenError` naming
        the tier and why) or, with ``on_open_error = "skip"`` (the default below the top
        tier), is logged as an error and left out: the cache runs on the other tiers and
        :attr:`skipped_tiers` says why."""
        if self._state != "new":
            what = {"open": "already open", "starting": "already starting"}
            raise KVTierUsageError(
                f"KVCache is {what.get(self._state, self._state)}; create a new one "
                "(start() runs once)"
            )
        self._owner = current_owner()
        self._state = "starting"
        try:
            await self._start()
        except BaseException:
            if self._state == "starting":
                self._state = "new"
            raise

    async def _start(self) -> None:
        if self._configure_log:
            configure_logging(self.config.log_format, self.config.log_level)
        opened = await open_backends(self.config, self._make_backend, self.skipped_tiers)
        if self.skipped_tiers:  # the cache runs on the tiers that opened
            self.config = dataclasses.replace(
                self.config, tiers=[self.config.tiers[i] for i, _ in opened]
            )
            names = [t.name for t in self.config.tiers]
            self.directory = Directory(names)
            self.prefix_tree = PrefixTree(names)
            self.prefix_tree.attach(self.directory)
        backends = [b for _, b in opened]
        self.tiers = [
            Tier(i, tc, b, self._eviction_policy(i))
            for i, (tc, b) in enumerate(zip(self.config.tiers, backends, strict=True))
        ]
        self._pipeline = Pipeline(
            self.tiers,
            self.directory,
            self.metrics,
            write_policy=self.config.write_policy,
            admission=make_admission(self.config.admission, **self.config.admission_params),
            batch_pages=self.config.batch_pages,
            max_inflight_per_link=self.config.max_inflight_per_link,
            background_eviction=self.config.background_eviction,
        )
        self._state = "open"
        self._watch = watch_open(self, [(t.name, t.config.backend) for t in self.tiers])
        for tier in self.tiers:
            self.metrics.used.set(0, tier.name)
            self.metrics.capacity.set(tier.capacity_pages, tier.name)
        try:
            recovered = await self._pipeline.recover()
        except BaseException:
            await self.close()  # cancelled while indexing: do not leave backends open
            raise
        self.hooks.start(self)  # what-if sizing, the live predictor (when asked for)
        _log.info(
            "kvtier cache open",
            model=self.spec.name,
            namespace=self.namespace.label,
            page_bytes=self.spec.page_bytes,
            tiers=[t.describe() for t in self.tiers],
            recovered_pages=recovered,
            skipped_tiers=self.skipped_tiers or None,
        )

    async def close(self) -> None:
        """Finish or cancel pipeline work, write dirty pages down per the write policy,
        close every backend. Calls made once close has begun raise
        :class:`KVTierUsageError`; calls already running finish. Idempotent: a second
        call returns when the first one is done."""
        if self._state in ("open", "closing"):
            check_owner(self._owner)
        if self._state == "closing":
            await self._closed.wait()
            return
        if self._state == "starting":
            raise KVTierUsageError("KVCache is starting: await start() before closing it")
        if self._state != "open":
            self._state = "closed"
            return
        assert self._pipeline is not None
        self._state = "closing"
        why = "close was interrupted before its flush: dirty pages are lost"
        try:
            await self.hooks.aclose()  # inside the try: the backends close whatever happens
            await self._pipeline.close()
            why = "close could not write dirty pages down (the tier below failed): they are lost"
        except BaseException:
            # close itself was cancelled (or failed): stop what is left before the
            # backends go, so nothing runs against a closed backend
            await self._pipeline.cancel_all()
            raise
        finally:
            report_unwritten(self._pipeline.planner, self.tiers, self.directory, self.metrics, why)
            for tier in reversed(self.tiers):
                try:
                    await tier.backend.close()
                except Exception as exc:
                    _log.warning("backend close failed", tier=tier.name, error=repr(exc))
            self._state = "closed"
            self._closed.set()
            self._watch.closed()
            _log.info("kvtier cache closed", metrics=self.metrics.snapshot()["tiers"])

    # -- the API -------------------------------------------------------------------------

    def page_keys(
        self, tokens: Tokens, parent: PageKey = ROOT_KEY, namespace: NamespaceArg = None
    ) -> list[PageKey]:
        """Keys of every full page of ``tokens`` in ``namespace`` (a :class:`Namespace` or
        its label; default: this cache's)."""
        ns = namespace_of(namespace, self.namespace)
        return page_keys(tokens, ns, check_key(parent, "parent"))

    async def store(
        self, tokens: Tokens, pages: Any, parent: PageKey = ROOT_KEY, namespace: NamespaceArg = None
    ) -> StoreResult:
        """Store one page per full page of ``tokens`` (a trailing partial page is ignored),
        keyed in ``namespace`` (default: this cache's).

        ``pages``: uint8 ``[n, page_bytes]``, or ``[n, *spec.page_shape]`` of the spec
        dtype (numpy or CPU torch), or a list of ``n`` page buffers. Raises
        :class:`KVTierUsageError` for a wrong shape, dtype or count.
        """
        ns = namespace_of(namespace, self.namespace)
        keys = self.page_keys(tokens, parent, ns)
        rows = self._input.rows(pages, len(keys), "pages")
        parents: list[PageKey | None] = [parent, *keys[:-1]] if keys else []
        return StoreResult(keys, await self._calling().store(keys, rows, parents, ns.label))

    async def store_pages(
        self,
        keys: Sequence[PageKey],
        pages: Any,
        parents: Sequence[PageKey | None] | None = None,
        namespace: Namespace | str | None = None,
    ) -> list[bool]:
        """Store pages under explicit keys (``True`` where committed in the top tier); a key
        given twice raises :class:`KVTierUsageError`."""
        ks, label = check_store_keys(keys), namespace_label(namespace, self.namespace)
        rows, pars = self._input.rows(pages, len(ks), "pages"), check_parents(parents, len(ks))
        return await self._calling().store(ks, rows, pars, label)

    async def lookup(
        self, tokens: Tokens, parent: PageKey = ROOT_KEY, namespace: NamespaceArg = None
    ) -> LookupResult:
        """The longest cached prefix of ``tokens`` (pages readable in some tier) and the
        highest tier of each page, keyed in ``namespace`` (default: this cache's). No page
        bytes move; past the pages this process knows, tiers on shared backends (a remote
        pool) are asked whether other processes stored the rest, and what they hold is
        indexed so that :meth:`load` finds it."""
        pipe = self.pipeline  # raises when not open
        ns = namespace_of(namespace, self.namespace)
        label = ns.label
        keys = self.page_keys(tokens, parent, ns)
        found: list[PageKey] = []
        tiers: list[str] = []
        for attempt in range(2):
            for k in keys[len(found) :]:
                # an evicting page is still readable: a load pins it and it stays put
                tier = self.directory.locate(k)
                if tier is None:
                    break
                found.append(k)
                tiers.append(tier)
            rest = keys[len(found) :]
            prev = found[-1] if found else parent
            if attempt or not rest or not await pipe.index_shared(rest, prev, label):
                break
        self.hooks.on_lookup(keys, tiers)
        return LookupResult(found, tiers, len(found) * self.spec.page_tokens)

    # -- hints and observers (kvtier/cache_hooks.py) ------------------------------------

    def _calling(self) -> Pipeline:
        """The pipeline (raises when not open), the clock ticked for what a call evicts."""
        pipe = self.pipeline
        self.hooks.on_call()
        return pipe

    def attach(self, observer: CacheObserver) -> Callable[[], None]:
        """Tell ``observer`` about every lookup, load, hint and clock tick from now on;
        its ``stats()`` appear in :meth:`stats` under its ``name`` (see
        :meth:`kvtier.cache_hooks.CacheHooks.attach`). Returns a function that detaches it."""
        return self.hooks.attach(observer)

    def hint(self, kind: str, keys: Sequence[PageKey], value: float | None = None) -> None:
        """Tell the cache what the engine knows about ``keys`` (see
        :mod:`kvtier.policy.hints`): ``open`` / ``close`` a session, ``next_turn`` in
        ``value`` seconds, a ``ttl`` of ``value`` seconds, a ``priority`` weight,
        ``pin`` / ``unpin`` a system prompt. Hint-aware eviction policies (``hinted``,
        and ``adaptive``, which follows hints only while they prove right) use it; the
        others ignore it. Raises :class:`KVTierUsageError` for an unknown kind, a bad
        value or a key that is not a page key."""
        self.pipeline  # noqa: B018 - raises when not open
        self.hooks.hint(make_hint(kind, check_keys(keys, "hint keys"), value))

    async def reserve_private(
        self, keys: Sequence[PageKey], namespace: Namespace | str = ""
    ) -> list[Reservation]:
        """Reserve one top-tier slot per key, never to be committed: an engine's private
        working pages (e.g. unverified speculative KV), invisible to lookups and never
        written down. Other pages are evicted per policy to make room; the slots stay
        taken (and count against the tier) until :meth:`release_private`. Raises
        :class:`KVTierUsageError` when the top tier is not an arena, a key is already known
        or ``namespace`` is not a label or Namespace (as :meth:`store_pages` checks), and
        :class:`~kvtier.errors.CapacityError` when what fills the tier is pinned/reserved,
        :class:`~kvtier.errors.TierIOError` when the tier's backend fails the reserve."""
        label = namespace_label(namespace, self.namespace)
        return await self.pipeline.reserve_private(check_store_keys(keys), label)

    async def release_private(self, reservations: Sequence[Reservation]) -> None:
        """Give back slots taken by :meth:`reserve_private` (their bytes are dropped)."""
        await self.pipeline.release_private(reservations)

    async def demote(self, tier: str, keys: Sequence[PageKey]) -> list[PageKey]:
        """Move ``keys`` out of the tier named ``tier`` now, as eviction would: each page is
        written to the tier below unless a lower tier holds it already or the write policy
        drops it (the last tier drops pages). Pages the tier does not hold are ignored.
        Returns the pages that stay in ``tier`` (their write-down failed, or the backend
        failed to delete them). Raises :class:`KVTierUsageError` for an unknown tier name
        or a pinned key (before moving anything)."""
        pipe = self._calling()
        if not isinstance(tier, str):
            raise KVTierUsageError(f"tier must be a tier name, got {type(tier).__name__}")
        return await pipe.demote(pipe.tier(tier), check_keys(keys))

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> LoadResult:
        """Bring ``keys`` to the top tier in one batched pass. With ``pin`` every key (found
        or not) is pinned until :meth:`release`; the slots stay valid meanwhile. Raises
        :class:`~kvtier.errors.CapacityError` when the top tier is pinned full."""
        result = await self._calling().load(ks := check_keys(keys), pin)
        self.hooks.on_load(ks)
        return result

    def release(self, keys: Sequence[PageKey]) -> Any:
        """Unpin keys pinned by :meth:`load` (one pin per occurrence).

        Takes effect immediately; the returned object may be awaited (``await
        cache.release(keys)`` is the same; typed ``Any`` so that both sync and async call
        sites type-check). Raises :class:`KVTierUsageError` for a key not pinned.
        """
        self.pipeline.release(check_keys(keys))
        return _Done()

    async def read(self, keys: Sequence[PageKey], out: Any) -> list[bool]:
        """Copy each page's bytes into ``out`` (a writable ``[n, page_bytes]`` uint8 or
        ``[n, *page_shape]`` array/tensor, or a list of buffers). ``False`` is a miss;
        pages read back from stores are checksum-verified."""
        ks = check_keys(keys)
        rows = self._input.rows(out, len(ks), "out", writable=True)
        return await self._calling().read(ks, rows)

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Move ``keys`` toward the top tier; returns what arrived within ``deadline_s``."""
        return await self._calling().prefetch(check_keys(keys), deadline_s)

    async def delete(self, keys: Sequence[PageKey]) -> int:
        """Remove ``keys`` from every tier (pinned keys raise); returns copies removed."""
        return await self.pipeline.delete(check_keys(keys))

    async def flush(self) -> int:
        """Finish the work in progress, write dirty memory-tier pages down; pages written."""
        return await self.pipeline.flush()

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and backend counters, plus the metrics snapshot."""
        tiers = []
        for t in self.tiers:
            info = t.describe()
            info["used_pages"] = self.directory.used(t.name)
            info["pinned_pages"] = self.directory.pinned(t.name)
            try:
                info["backend_stats"] = t.backend.stats()
            except KVTierError as exc:
                info["backend_stats"] = {"error": str(exc)}
            tiers.append(info)
        return {
            "tiers": tiers,
            "skipped_tiers": dict(self.skipped_tiers),
            **self.hooks.stats(),
            "metrics": self.metrics.snapshot(),
        }


class _Done:
    """An already-completed awaitable (for calls that act at once but may be awaited)."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # pragma: no cover - makes this a generator
