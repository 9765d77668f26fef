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
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from kvtier import registry
from kvtier.backend import ArenaBackend, Backend, Reservation, check_buffer
from kvtier.config import KVTierConfig, ResolvedConfig, load_config
from kvtier.errors import CapacityError, ConfigError, KVTierError, KVTierUsageError
from kvtier.index.directory import Directory
from kvtier.index.prefix_tree import LeafFirstPolicy, PrefixTree
from kvtier.keys import KEY_BYTES, ROOT_KEY, Namespace, PageKey, page_keys
from kvtier.log import configure_logging, get_logger
from kvtier.metrics import CacheMetrics
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import hint_target, make_hint
from kvtier.spec import KVSpec, canonical_dtype
from kvtier.transfer.links import Priority
from kvtier.transfer.pipeline import LoadResult, Pipeline, PrefetchResult
from kvtier.transfer.tier import Tier

if TYPE_CHECKING:
    from kvtier.observers import CacheObserver

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


def _check_key(key: Any, what: str, optional: bool = False) -> PageKey:
    """``key`` as a page key, or :class:`KVTierUsageError` naming ``what``."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise KVTierUsageError(
            f"{what} must be a {KEY_BYTES}-byte page key{' or None' if optional else ''}, "
            f"got {type(key).__name__}"
            f"{' of ' + str(len(key)) + ' bytes' if isinstance(key, bytes) else ''}"
        )
    return PageKey(key)


def _check_keys(keys: Sequence[Any], what: str = "keys") -> list[PageKey]:
    if isinstance(keys, bytes | bytearray | str):
        raise KVTierUsageError(
            f"{what} must be a sequence of page keys, not a single {type(keys).__name__}"
        )
    return [_check_key(k, f"{what}[{i}]") for i, k in enumerate(keys)]


class KVCache:
    """A tiered KV page cache (see the module docstring).

    Args:
        config: anything :func:`~kvtier.config.load_config` accepts (``None``: the
            embedded default, or ``$KVTIER_CONFIG``).
        env: environment for ``KVTIER_*`` overrides (default ``os.environ``).
        configure_log: apply the config's log format and level to structlog.
        whatif: run what-if sizing (:class:`~kvtier.observers.WhatIfObserver`): each
            tier's hit rate at other capacities, in ``stats()["whatif"]`` and the
            ``kvtier_whatif_hit_rate`` gauge.
        predictor: run a live prefetch predictor (:class:`~kvtier.prefetcher.
            LivePrefetcher`): ``"prefix"``, ``"lookahead"`` or ``"prefix+lookahead"``.

    Raises:
        ConfigError: a bad configuration (at construction).
    """

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | KVTierConfig | ResolvedConfig | None = None,
        *,
        env: Mapping[str, str] | None = None,
        configure_log: bool = True,
        whatif: bool = False,
        predictor: str | None = None,
    ) -> None:
        self.resolved: ResolvedConfig = load_config(config, env)
        self.config: KVTierConfig = self.resolved.config
        self.spec: KVSpec = self.config.spec
        self.namespace: Namespace = self.config.namespace
        self.metrics = CacheMetrics()
        self.directory = Directory([t.name for t in self.config.tiers])
        #: Radix tree over the committed pages of every tier, kept in step with the
        #: directory through its listeners.
        self.prefix_tree = PrefixTree([t.name for t in self.config.tiers])
        self.prefix_tree.attach(self.directory)
        self.tiers: list[Tier] = []
        self._pipeline: Pipeline | None = None
        self._state = "new"  # -> open -> closing -> closed
        self._closed = asyncio.Event()
        self._configure_log = configure_log
        # -- observers, hints, the clock (issue 15) --
        self._observers: list[CacheObserver] = []
        self._targets: list[Any] | None = None
        self._hints_total = self.metrics.counter(
            "hints_total", "Engine hints received, by kind", ["kind"]
        )
        self._want_whatif = whatif
        self._want_predictor = predictor
        if predictor is not None:
            from kvtier.prefetcher import check_predictor

            check_predictor(predictor)

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
        return self._pipeline

    # -- lifecycle -----------------------------------------------------------------------

    def _make_backend(self, i: int) -> Backend:
        tc = self.config.tiers[i]
        try:
            return registry.create(
                tc.backend,
                page_bytes=self.spec.page_bytes,
                capacity_pages=tc.capacity_pages(self.spec.page_bytes),
                **tc.options,
            )
        except ConfigError as exc:
            raise ConfigError(f"tiers[{i}].options ({tc.name}): {exc}") from None
        except TypeError as exc:
            raise ConfigError(f"tiers[{i}].options ({tc.name}): {exc}") from None
        except KVTierUsageError as exc:
            raise type(exc)(f"tiers[{i}] ({tc.name}, backend {tc.backend!r}): {exc}") from None

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
        start the pipeline. Idempotent while open; a closed cache cannot restart."""
        if self._state == "open":
            return
        if self._state in ("closing", "closed"):
            raise KVTierUsageError(f"KVCache is {self._state}; create a new one")
        if self._configure_log:
            configure_logging(self.config.log_format, self.config.log_level)
        backends = [self._make_backend(i) for i in range(len(self.config.tiers))]
        opened: list[Backend] = []
        try:
            for b in backends:
                await b.open()
                opened.append(b)
        except BaseException:
            for b in reversed(opened):
                await b.close()
            raise
        self.tiers = [
            Tier(i, tc, b, self._eviction_policy(i))
            for i, (tc, b) in enumerate(zip(self.config.tiers, backends, strict=True))
        ]
        from kvtier.config import make_admission

        self._pipeline = Pipeline(
            self.tiers,
            self.directory,
            self.metrics,
            write_policy=self.config.write_policy,
            admission=make_admission(self.config.admission, **self.config.admission_params),
            batch_pages=self.config.batch_pages,
            max_inflight_per_link=self.config.max_inflight_per_link,
        )
        self._state = "open"
        for tier in self.tiers:
            self.metrics.used.set(0, tier.name)
            self.metrics.capacity.set(tier.capacity_pages, tier.name)
        try:
            recovered = await self._recover()
        except BaseException:
            await self.close()  # cancelled while indexing: do not leave backends open
            raise
        if self._want_whatif:
            from kvtier.observers import WhatIfObserver

            self.attach(WhatIfObserver(self))
        if self._want_predictor is not None:
            from kvtier.prefetcher import LivePrefetcher

            self.attach(LivePrefetcher(self, self._want_predictor))
        _log.info(
            "kvtier cache open",
            model=self.spec.name,
            namespace=self.namespace.label,
            page_bytes=self.spec.page_bytes,
            tiers=[t.describe() for t in self.tiers],
            recovered_pages=recovered,
        )

    async def _recover(self) -> int:
        """Index pages persistent stores already hold (e.g. after a restart)."""
        total = 0
        for tier in self.tiers:
            if tier.is_arena:
                continue
            try:
                keys = await tier.backend.keys()
            except Exception as exc:
                tier.record_failure("recover", 0, exc)
                continue
            for k in keys:
                if self.directory.state(k, tier.name) is None:
                    self.directory.reserve(k, tier.name)
                    self.directory.commit(k, tier.name)
                    tier.policy.on_insert(k)
                    total += 1
            self.metrics.used.set(self.directory.used(tier.name), tier.name)
        return total

    async def close(self) -> None:
        """Finish or cancel pipeline work, write dirty pages down per the write policy,
        close every backend. Calls made once close has begun raise
        :class:`KVTierUsageError`; calls already running finish. Idempotent: a second
        call returns when the first one is done."""
        if self._state == "closing":
            await self._closed.wait()
            return
        if self._state != "open":
            self._state = "closed"
            return
        assert self._pipeline is not None
        self._state = "closing"
        for obs in list(self._observers):
            aclose = getattr(obs, "aclose", None)
            if aclose is not None:
                await aclose()
        try:
            await self._pipeline.close()
        except BaseException:
            # close itself was cancelled (or failed): stop what is left before the
            # backends go, so nothing runs against a closed backend
            await self._pipeline.cancel_all()
            raise
        finally:
            for tier in reversed(self.tiers):
                try:
                    await tier.backend.close()
                except Exception as exc:
                    _log.warning("backend close failed", tier=tier.name, error=repr(exc))
            self._state = "closed"
            self._closed.set()
            _log.info("kvtier cache closed", metrics=self.metrics.snapshot()["tiers"])

    # -- input checking ------------------------------------------------------------------

    def _rows(self, pages: Any, n: int, what: str, writable: bool = False) -> list[np.ndarray]:
        """``pages`` as ``n`` 1-D uint8 page views (no copy where the layout allows)."""
        spec = self.spec
        pb = spec.page_bytes
        shape_hint = (
            f"[{n}, {pb}] uint8 or [{n}, {', '.join(map(str, spec.page_shape))}] {spec.dtype}"
        )
        if isinstance(pages, list | tuple):
            if len(pages) != n:
                raise KVTierUsageError(f"{what}: got {len(pages)} pages for {n} keys")
            return [self._one_row(p, f"{what}[{i}]", writable) for i, p in enumerate(pages)]
        arr = self._as_numpy(pages, what, writable)
        if arr.dtype == np.uint8 and arr.ndim == 2:
            if arr.shape != (n, pb):
                raise KVTierUsageError(
                    f"{what}: shape {tuple(arr.shape)} does not match {shape_hint}"
                )
        else:
            expected = (n, *spec.page_shape)
            if tuple(arr.shape) != expected:
                raise KVTierUsageError(
                    f"{what}: shape {tuple(arr.shape)} does not match {shape_hint}"
                )
            arr = arr.view(np.uint8).reshape(n, pb)
        return list(arr)

    def _one_row(self, page: Any, what: str, writable: bool) -> np.ndarray:
        """One page buffer as a 1-D uint8 view: bytes-like, flat uint8, or page_shape."""
        if isinstance(page, bytes | bytearray | memoryview):
            row = check_buffer(page, self.spec.page_bytes, what)
        else:
            arr = self._as_numpy(page, what, writable)
            if arr.dtype != np.uint8 or arr.ndim != 1:
                if tuple(arr.shape) != self.spec.page_shape:
                    raise KVTierUsageError(
                        f"{what}: shape {tuple(arr.shape)} is neither [{self.spec.page_bytes}] "
                        f"uint8 nor the page shape {list(self.spec.page_shape)}"
                    )
                arr = arr.view(np.uint8).reshape(-1)
            row = check_buffer(arr, self.spec.page_bytes, what)
        if writable and not row.flags.writeable:
            raise KVTierUsageError(f"{what} must be writable to receive a page")
        return row

    def _as_numpy(self, obj: Any, what: str, writable: bool) -> np.ndarray:
        """A C-contiguous numpy view of a numpy array or CPU torch tensor, dtype-checked."""
        if type(obj).__module__.startswith("torch"):
            import torch

            if not isinstance(obj, torch.Tensor):
                raise KVTierUsageError(f"{what}: unsupported type {type(obj).__name__}")
            if obj.device.type != "cpu":
                raise KVTierUsageError(
                    f"{what}: tensor is on {obj.device}; kvtier's facade takes CPU tensors"
                )
            if obj.dtype != torch.uint8:
                self._check_dtype(str(obj.dtype), what)
            if not obj.is_contiguous():
                if writable:
                    raise KVTierUsageError(f"{what}: output tensor must be contiguous")
                obj = obj.contiguous()
            flat: np.ndarray = obj.detach().reshape(-1).view(torch.uint8).numpy()
            # keep the logical shape for the checks, in bytes along the last axis
            shape = tuple(obj.shape)
            if obj.dtype == torch.uint8:
                return flat.reshape(shape)
            return _ByteRows(flat, shape, obj.element_size()).array()
        if not isinstance(obj, np.ndarray):
            raise KVTierUsageError(
                f"{what}: expected a numpy array, a CPU torch tensor or a list of page "
                f"buffers, got {type(obj).__name__}"
            )
        if not obj.dtype.isnative:  # its bytes are not the spec dtype's bytes
            raise KVTierUsageError(
                f"{what}: dtype {obj.dtype.str} is not in native byte order; convert it "
                f"first (.astype({obj.dtype.name!r}))"
            )
        if obj.dtype != np.uint8:
            self._check_dtype(obj.dtype.name, what)
        if not obj.flags.c_contiguous:
            if writable:
                raise KVTierUsageError(f"{what}: output array must be C-contiguous")
            obj = np.ascontiguousarray(obj)
        if writable and not obj.flags.writeable:
            raise KVTierUsageError(f"{what}: output array must be writable")
        return np.asarray(obj)

    def _check_dtype(self, name: str, what: str) -> None:
        try:
            dtype = canonical_dtype(name)
        except KVTierUsageError:
            dtype = name
        if dtype != self.spec.dtype:
            raise KVTierUsageError(
                f"{what}: dtype {name} does not match the model's KV dtype {self.spec.dtype} "
                f"(pass the spec dtype, or raw uint8 page bytes)"
            )

    # -- the API -------------------------------------------------------------------------

    def page_keys(
        self, tokens: Sequence[int] | np.ndarray, parent: PageKey = ROOT_KEY
    ) -> list[PageKey]:
        """Keys of every full page of ``tokens`` in this cache's namespace."""
        return page_keys(tokens, self.namespace, _check_key(parent, "parent"))

    async def store(
        self, tokens: Sequence[int] | np.ndarray, pages: Any, parent: PageKey = ROOT_KEY
    ) -> StoreResult:
        """Store one page per full page of ``tokens`` (a trailing partial page is ignored).

        ``pages``: uint8 ``[n, page_bytes]``, or ``[n, *spec.page_shape]`` of the spec
        dtype (numpy or CPU torch), or a list of ``n`` page buffers. Raises
        :class:`KVTierUsageError` for a wrong shape, dtype or count.
        """
        keys = self.page_keys(tokens, parent)
        rows = self._rows(pages, len(keys), "pages")
        parents: list[PageKey | None] = [parent, *keys[:-1]] if keys else []
        stored = await self.pipeline.store(keys, rows, parents, self.namespace.label)
        return StoreResult(keys, stored)

    async def store_pages(
        self,
        keys: Sequence[PageKey],
        pages: Any,
        parents: Sequence[PageKey | None] | None = None,
        namespace: Namespace | str | None = None,
    ) -> list[bool]:
        """Store pages under explicit keys (``True`` where committed in the top tier)."""
        ks = _check_keys(keys)
        rows = self._rows(pages, len(ks), "pages")
        pars: list[PageKey | None] = [None] * len(ks)
        if parents is not None:
            if isinstance(parents, bytes | bytearray | str):
                raise KVTierUsageError(
                    f"parents must be a sequence of page keys, not a single "
                    f"{type(parents).__name__}"
                )
            if len(parents) != len(ks):
                raise KVTierUsageError(f"parents: got {len(parents)} for {len(ks)} keys")
            pars = [
                None if p is None else _check_key(p, f"parents[{i}]", optional=True)
                for i, p in enumerate(parents)
            ]
        if isinstance(namespace, Namespace):
            label = namespace.label
        elif namespace is None:
            label = self.namespace.label
        elif isinstance(namespace, str):
            label = namespace
        else:
            raise KVTierUsageError(
                f"namespace must be a Namespace, a label string or None, got "
                f"{type(namespace).__name__}"
            )
        return await self.pipeline.store(ks, rows, pars, label)

    async def lookup(
        self, tokens: Sequence[int] | np.ndarray, parent: PageKey = ROOT_KEY
    ) -> LookupResult:
        """The longest cached prefix of ``tokens`` (pages readable in some tier) and the
        highest tier of each page. No page bytes move; past the pages this process knows,
        tiers on shared backends (a remote pool) are asked whether other processes stored
        the rest, and what they hold is indexed so that :meth:`load` finds it."""
        self.pipeline  # noqa: B018 - raises when not open
        keys = self.page_keys(tokens, parent)
        found: list[PageKey] = []
        tiers: list[str] = []
        for attempt in range(2):
            for k in keys[len(found) :]:
                tier = next(
                    (t.name for t in self.tiers if self.directory.is_committed(k, t.name)), None
                )
                if tier is None:
                    break
                found.append(k)
                tiers.append(tier)
            rest = keys[len(found) :]
            if attempt or not rest or not await self._index_shared(rest, parent, found):
                break
        if self._observers or self._hint_targets():
            self._observe_lookup(keys, tiers)
        return LookupResult(found, tiers, len(found) * self.spec.page_tokens)

    # -- hints and observers (issue 15) ------------------------------------------------

    def attach(self, observer: CacheObserver) -> Callable[[], None]:
        """Tell ``observer`` about every lookup, hint and clock tick from now on (see
        :mod:`kvtier.observers`); its ``stats()`` appear in :meth:`stats` under its
        ``name``. Returns a function that detaches it. Raises
        :class:`KVTierUsageError` for a name already attached or used by ``stats()``."""
        name = getattr(observer, "name", None)
        if (
            not isinstance(name, str)
            or name in ("tiers", "metrics")
            or any(o.name == name for o in self._observers)
        ):
            raise KVTierUsageError(f"cannot attach an observer named {name!r}")
        self._observers.append(observer)

        def detach() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return detach

    def _hint_targets(self) -> list[Any]:
        """The tiers' hint-aware policies (found once: policies never change)."""
        if self._targets is None:
            self._targets = [a for t in self.tiers if (a := hint_target(t.policy)) is not None]
        return self._targets

    def _call_observers(self, what: str, *args: Any) -> None:
        for obs in list(self._observers):
            hook = getattr(obs, what, None)
            if hook is None:
                continue  # optional hook (on_load)
            try:
                hook(*args)
            except Exception as exc:  # an observer never breaks the cache
                _log.warning("observer failed; detached", observer=obs.name, error=repr(exc))
                self._observers.remove(obs)

    def _tick(self) -> float:
        now = time.monotonic()
        for target in self._hint_targets():
            target.on_time(now)
        self._call_observers("on_time", now)
        return now

    def _observe_lookup(self, keys: Sequence[PageKey], tiers: Sequence[str]) -> None:
        self._tick()
        self._call_observers("on_lookup", keys, tiers)

    def hint(self, kind: str, keys: Sequence[PageKey], value: float | None = None) -> None:
        """Tell the cache what the engine knows about ``keys`` (see
        :mod:`kvtier.policy.hints`): ``open`` / ``close`` a session, ``next_turn`` in
        ``value`` seconds, a ``ttl`` of ``value`` seconds, a ``priority`` weight,
        ``pin`` / ``unpin`` a system prompt. Hint-aware eviction policies (``hinted``,
        and ``adaptive``, which follows hints only while they prove right) use it; the
        others ignore it. Raises :class:`KVTierUsageError` for an unknown kind, a bad
        value or a key that is not a page key."""
        self.pipeline  # noqa: B018 - raises when not open
        h = make_hint(kind, _check_keys(keys, "hint keys"), value)
        self._hints_total.inc(h.kind)
        now = self._tick()
        for target in self._hint_targets():
            target.on_hint(h, now)
        self._call_observers("on_hint", h, now)

    async def _index_shared(
        self, keys: list[PageKey], parent: PageKey, before: list[PageKey]
    ) -> int:
        """Index the leading run of ``keys`` that shared tiers hold but the directory does
        not know (committed there by another process). Returns how many were indexed; a
        tier that fails to answer is skipped (a miss, as always)."""
        shared = [t for t in self.tiers if t.backend.shared]
        if not shared:
            return 0
        holder: list[Tier | None] = [None] * len(keys)
        for tier in shared:
            try:
                hits = await tier.backend.contains(keys)
            except Exception as exc:
                tier.record_failure("lookup", len(keys), exc)
                continue
            for i, hit in enumerate(hits):
                if hit and holder[i] is None:
                    holder[i] = tier
        added = 0
        prev = before[-1] if before else parent
        for k, owner in zip(keys, holder, strict=True):
            if owner is None:
                break
            if self.directory.state(k, owner.name) is None:  # may have changed meanwhile
                self.directory.reserve(k, owner.name, self.namespace.label, prev)
                self.directory.commit(k, owner.name)
                owner.policy.on_insert(k, prev)
                added += 1
            prev = k
        if added:
            for tier in shared:
                self.metrics.used.set(self.directory.used(tier.name), tier.name)
        return added

    async def reserve_private(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation]:
        """Reserve one top-tier slot per key, never to be committed: an engine's private
        working pages (e.g. unverified speculative KV), invisible to lookups and never
        written down. Other pages are evicted per policy to make room; the slots stay
        taken (and count against the tier) until :meth:`release_private`.

        Raises :class:`KVTierUsageError` when the top tier is not an arena or a key is
        already known, and :class:`~kvtier.errors.CapacityError` when room cannot be made
        (what fills the tier is pinned or reserved)."""
        pipe = self.pipeline
        top = pipe.top
        ks = _check_keys(keys)
        if not isinstance(top.backend, ArenaBackend):
            raise KVTierUsageError(
                f"private slots need an arena top tier; {top.name!r} is a {top.backend.kind}"
            )
        if len(set(ks)) != len(ks) or any(self.directory.get(k) is not None for k in ks):
            raise KVTierUsageError("private slot keys must be distinct and not yet known")
        if not ks:
            return []
        if not await pipe.make_room(top, len(ks), Priority.FETCH):
            raise CapacityError(f"tier {top.name!r}: no room for {len(ks)} private slots")
        for k in ks:
            self.directory.reserve(k, top.name, namespace)
        top.claimed -= len(ks)  # the claim became directory reservations
        try:
            res = await top.backend.reserve(ks, namespace)
        except BaseException:
            for k in ks:
                self.directory.abort(k, top.name)
            raise
        got = [r for r in res if r is not None]
        if len(got) < len(ks):
            await top.backend.abort(got)
            for k in ks:
                self.directory.abort(k, top.name)
            raise CapacityError(
                f"tier {top.name!r} could give only {len(got)} of {len(ks)} private slots"
            )
        return got

    async def release_private(self, reservations: Sequence[Reservation]) -> None:
        """Give back slots taken by :meth:`reserve_private` (their bytes are dropped)."""
        top = self.pipeline.top
        await top.backend.abort(list(reservations))
        for r in reservations:
            if self.directory.get(r.key) is not None:
                self.directory.abort(r.key, top.name)
        top.notify()

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> LoadResult:
        """Bring ``keys`` to the top tier in one batched pass.

        With ``pin`` every key (found or not) is pinned until :meth:`release`; the slots
        stay valid meanwhile. Raises :class:`~kvtier.errors.CapacityError` when the pages
        cannot fit because the top tier is pinned full.
        """
        result = await self.pipeline.load(ks := _check_keys(keys), pin)
        if self._observers:
            self._call_observers("on_load", ks)
        return result

    def release(self, keys: Sequence[PageKey]) -> Any:
        """Unpin keys pinned by :meth:`load` (one pin per occurrence).

        Takes effect immediately; the returned object may be awaited (``await
        cache.release(keys)`` and ``cache.release(keys)`` are equivalent; typed ``Any`` so
        that both sync and async call sites type-check). Raises
        :class:`KVTierUsageError` for a key that is not pinned (released twice).
        """
        self.pipeline.release(_check_keys(keys))
        return _Done()

    async def read(self, keys: Sequence[PageKey], out: Any) -> list[bool]:
        """Copy each page's bytes into ``out`` (a writable ``[n, page_bytes]`` uint8 or
        ``[n, *page_shape]`` array/tensor, or a list of buffers). ``False`` is a miss;
        pages read back from stores are checksum-verified."""
        ks = _check_keys(keys)
        rows = self._rows(out, len(ks), "out", writable=True)
        return await self.pipeline.read(ks, rows)

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Move ``keys`` toward the top tier; returns what arrived within ``deadline_s``."""
        return await self.pipeline.prefetch(_check_keys(keys), deadline_s)

    async def delete(self, keys: Sequence[PageKey]) -> int:
        """Remove ``keys`` from every tier (pinned keys raise); returns pages removed."""
        return await self.pipeline.delete(_check_keys(keys))

    async def flush(self) -> int:
        """Finish background write-downs and write dirty memory-tier pages down."""
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
        out: dict[str, Any] = {"tiers": tiers}
        for obs in list(self._observers):
            out[obs.name] = obs.stats()
        out["metrics"] = self.metrics.snapshot()
        return out


class _Done:
    """An already-completed awaitable (for calls that act at once but may be awaited)."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # pragma: no cover - makes this a generator


class _ByteRows:
    """Reinterpret a flat byte buffer of a typed tensor with the tensor's logical shape,
    the last axis in bytes (so shape checks against page_shape still work)."""

    def __init__(self, flat: np.ndarray, shape: tuple[int, ...], itemsize: int) -> None:
        self.flat = flat
        self.shape = shape
        self.itemsize = itemsize

    def array(self) -> np.ndarray:
        if not self.shape:
            return self.flat
        dtype = np.dtype(f"V{self.itemsize}")
        return self.flat.view(dtype).reshape(self.shape)
