"""The live multi-turn chat workload behind ``kvtier bench run``.

Sessions share a few system prompts; every turn's prompt is the session's previous context
plus new user tokens. Per turn, like an inference server would:

1. ``lookup`` the longest cached prefix of the prompt (which tier each page is in);
2. ``load`` it into the top tier (pinned), check every loaded page's bytes, ``release``;
3. "compute" the pages past the cached prefix (prompt and the reply) and ``store`` them.

Page contents are a pure function of the page key (:func:`page_content`), so every page
read back is checked against what must have been stored: the report counts checked pages
and mismatches (which must be 0). Token streams are a pure function of the seed, so a
second run with the same seed over a kept disk tier finds the first run's pages.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import ROOT_KEY, PageKey

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: Token ids are drawn from [0, VOCAB).
VOCAB = 32_000


def page_content(key: bytes, page_bytes: int) -> np.ndarray:
    """The bytes of the page stored under ``key``: a position-dependent pattern seeded by
    the key (every 8-byte word differs between two keys, and between two offsets of one
    page, so a page from another key or a shifted/torn read never matches)."""
    words = -(-page_bytes // 8)
    lo = np.uint64(int.from_bytes(key[:8], "little"))
    hi = np.uint64(int.from_bytes(key[8:16], "little"))
    base = np.arange(words, dtype=np.uint64)
    base += hi
    base *= _GOLDEN
    base ^= lo
    return base.view(np.uint8)[:page_bytes]


#: Most tokens a chat workload may generate (its streams are built up front, 8 bytes each).
MAX_WORKLOAD_TOKENS = 1 << 25
#: Longest queueing delay a turn may be given (ms): a minute.
MAX_QUEUE_DELAY_MS = 60_000.0


@dataclass(frozen=True)
class ChatParams:
    """Shape of the chat workload.

    Attributes:
        sessions: concurrent conversations (their turns are interleaved round-robin, so a
            session's pages age out of the top tier before it comes back).
        turns: turns per session.
        system_prompts: distinct system prompts the sessions share.
        system_tokens: tokens per system prompt.
        user_tokens: (min, max) new user tokens per turn.
        reply_tokens: (min, max) generated tokens per turn.
        concurrency: sessions whose turns run at once (``asyncio.gather``).
        seed: seed of every token stream.
        queue_delay_ms: how long a turn waits between its ``lookup`` (the request
            arrives) and its ``load`` (it is scheduled), as in a busy server's queue;
            a live prefetch predictor can move pages up meanwhile.
    """

    sessions: int = 8
    turns: int = 4
    system_prompts: int = 2
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (40, 120)
    reply_tokens: tuple[int, int] = (40, 120)
    concurrency: int = 2
    seed: int = 0
    queue_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        delay = self.queue_delay_ms
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not 0 <= delay <= MAX_QUEUE_DELAY_MS
        ):
            raise KVTierUsageError(
                "bench run: --queue-delay-ms must be a number of ms from 0 to "
                f"{MAX_QUEUE_DELAY_MS:g} (a minute per turn), got {delay!r}"
            )
        for name in ("sessions", "turns", "system_prompts", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise KVTierUsageError(f"bench run: {flag} must be an integer >= 1, got {value!r}")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            # numpy's generators take only seeds >= 0 (a ValueError deep in the run)
            raise KVTierUsageError(f"--seed must be an integer >= 0, got {seed!r}")
        if self.system_tokens < 0:
            raise KVTierUsageError(
                f"bench run: --system-tokens must be >= 0, got {self.system_tokens}"
            )
        for name in ("user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise KVTierUsageError(f"bench run: {name} must be 0 <= min <= max, got {(lo, hi)}")
        # The token streams are generated up front: refuse what would not fit in memory.
        per_session = self.turns * (self.user_tokens[1] + self.reply_tokens[1])
        total = self.sessions * per_session + self.system_prompts * self.system_tokens
        if total > MAX_WORKLOAD_TOKENS:
            raise KVTierUsageError(
                f"bench run: the workload would hold up to {total:,} tokens "
                f"(sessions x turns x tokens per turn); at most {MAX_WORKLOAD_TOKENS:,}"
            )


def conversation_tokens(params: ChatParams) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per session, per turn: (user tokens, reply tokens); the system prompt is turn 0's
    first user tokens. Deterministic in ``params.seed``."""
    rng = np.random.default_rng(params.seed)
    prompts = [
        rng.integers(0, VOCAB, params.system_tokens, dtype=np.int64)
        for _ in range(params.system_prompts)
    ]
    out = []
    for s in range(params.sessions):
        srng = np.random.default_rng([params.seed, s])
        turns = []
        for t in range(params.turns):
            user = srng.integers(0, VOCAB, int(srng.integers(*_closed(params.user_tokens))))
            reply = srng.integers(0, VOCAB, int(srng.integers(*_closed(params.reply_tokens))))
            if t == 0:
                user = np.concatenate([prompts[s % params.system_prompts], user])
            turns.append((user.astype(np.int64), reply.astype(np.int64)))
        out.append(turns)
    return out


@dataclass(frozen=True)
class Footprint:
    """Page counts of a workload for one page size.

    Attributes:
        working_set_pages: distinct full pages the whole run stores.
        max_wave_pages: most pages one wave of concurrent turns holds at once (every
            session's whole context after its turn: pinned prefix plus new pages), an upper
            bound of what the top tier must fit at a time.
        max_wave_cached_pages: most pages one wave of concurrent turns loads and pins at
            once: each session's whole context before its turn (the cached prefix).
    """

    working_set_pages: int
    max_wave_pages: int
    max_wave_cached_pages: int = 0

    @property
    def min_top_pages(self) -> int:
        """Top-tier pages the run needs at least: what one wave of concurrent turns loads
        and pins at once (:attr:`max_wave_cached_pages`). Below it a load cannot find
        room (measured: the documented 4-session, 3-turn llama3-8b run needs 78 pages
        and runs with 78, not with 76)."""
        return max(1, self.max_wave_cached_pages)


def footprint(params: ChatParams, page_tokens: int) -> Footprint:
    """The :class:`Footprint` of ``params`` with ``page_tokens`` tokens per page."""
    convo = conversation_tokens(params)
    lengths = [0] * params.sessions
    per_turn: list[list[int]] = []
    cached: list[list[int]] = []
    for turn in range(params.turns):
        cached.append([n // page_tokens for n in lengths])
        for s in range(params.sessions):
            user, reply = convo[s][turn]
            lengths[s] += len(user) + len(reply)
        per_turn.append([n // page_tokens for n in lengths])
    step = params.concurrency
    waves = [
        sum(pages[i : i + step]) for pages in per_turn for i in range(0, params.sessions, step)
    ]
    cached_waves = [
        sum(pages[i : i + step]) for pages in cached for i in range(0, params.sessions, step)
    ]
    shared = params.system_tokens // page_tokens
    sessions_used = min(params.sessions, params.system_prompts)
    working = shared * sessions_used + sum(n // page_tokens - shared for n in lengths)
    return Footprint(working, max(waves), max(cached_waves))


def _closed(bounds: tuple[int, int]) -> tuple[int, int]:
    return bounds[0], bounds[1] + 1


class _Lookup(Protocol):
    keys: list[PageKey]
    tiers: list[str]


class _Load(Protocol):
    slots: list[int | None]
    missing: list[PageKey]


class ChatCache(Protocol):
    """What the workload needs of :class:`kvtier.cache.KVCache`."""

    def page_keys(self, tokens: Any, parent: PageKey = ...) -> list[PageKey]: ...

    async def lookup(self, tokens: Any) -> Any: ...

    async def load(self, keys: Sequence[PageKey], pin: bool = ...) -> Any: ...

    def release(self, keys: Sequence[PageKey]) -> None: ...

    async def read(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]: ...

    async def store_pages(
        self, keys: Sequence[PageKey], pages: Any, parents: Any = ..., namespace: Any = ...
    ) -> list[bool]: ...


@dataclass
class ChatReport:
    """What a chat run measured (plain data; see :meth:`to_dict`).

    ``hits_by_tier[t]`` counts prompt pages ``lookup`` found in tier ``t``;
    ``pages_looked_up`` counts every full page of every prompt, so
    ``hits_by_tier[t] / pages_looked_up`` is tier ``t``'s hit rate.
    """

    turns: int = 0
    pages_looked_up: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    pages_missed: int = 0
    pages_loaded: int = 0
    load_missing: int = 0
    checked_pages: int = 0
    mismatches: int = 0
    pages_stored: int = 0
    store_failed: int = 0
    fetch_latencies_s: list[float] = field(default_factory=list)
    load_latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Rates and latency percentiles derived from the counts."""
        n = max(self.pages_looked_up, 1)
        hits = sum(self.hits_by_tier.values())
        return {
            "hit_rate": hits / n,
            "hit_rate_by_tier": {t: c / n for t, c in sorted(self.hits_by_tier.items())},
            "fetch_latency_ms": _latency_ms(self.fetch_latencies_s),
            "load_latency_ms": _latency_ms(self.load_latencies_s),
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["fetch_latencies_s"]
        del out["load_latencies_s"]
        out.update(self.summary())
        return out


def _latency_ms(values: Sequence[float]) -> dict[str, Any]:
    lat = sorted(values)
    return {
        "count": len(lat),
        "p50": _percentile(lat, 0.50) * 1e3 if lat else None,
        "p99": _percentile(lat, 0.99) * 1e3 if lat else None,
        "mean": statistics.fmean(lat) * 1e3 if lat else None,
        "max": lat[-1] * 1e3 if lat else None,
    }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    idx = min(len(sorted_values) - 1, max(0, int(np.ceil(q * len(sorted_values))) - 1))
    return sorted_values[idx]


class ChatWorkload:
    """Plays :class:`ChatParams` against an open cache (see module docstring).

    ``top_view`` gives zero-copy access to a loaded page by its top-tier slot (an arena's
    ``view``); without it pages are checked through ``cache.read``.
    """

    def __init__(
        self,
        cache: ChatCache,
        params: ChatParams,
        page_bytes: int,
        page_tokens: int,
        top_view: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        self.cache = cache
        self.params = params
        self.page_bytes = page_bytes
        self.page_tokens = page_tokens
        self.top_view = top_view
        self.report = ChatReport()
        self._hits: Counter[str] = Counter()

    async def run(self, on_turn: Callable[[], None] | None = None) -> ChatReport:
        """Play every turn of every session; returns the report (also in ``.report``)."""
        import asyncio

        convo = conversation_tokens(self.params)
        contexts = [np.empty(0, dtype=np.int64) for _ in convo]
        start = time.perf_counter()
        order = list(range(self.params.sessions))
        for turn in range(self.params.turns):
            for i in range(0, len(order), self.params.concurrency):
                wave = order[i : i + self.params.concurrency]
                new = await asyncio.gather(
                    *(self._turn(contexts[s], *convo[s][turn]) for s in wave)
                )
                for s, ctx in zip(wave, new, strict=True):
                    contexts[s] = ctx
                    if on_turn is not None:
                        on_turn()
        self.report.wall_s = time.perf_counter() - start
        self.report.hits_by_tier = dict(self._hits)
        return self.report

    async def _turn(self, context: np.ndarray, user: np.ndarray, reply: np.ndarray) -> np.ndarray:
        rep = self.report
        prompt = np.concatenate([context, user])
        full = len(prompt) // self.page_tokens
        t0 = time.perf_counter()
        found = await self.cache.lookup(prompt)
        keys: list[PageKey] = list(found.keys)
        valid = 0
        if self.params.queue_delay_ms:
            import asyncio

            await asyncio.sleep(self.params.queue_delay_ms / 1e3)  # waiting to be scheduled
        if keys:
            t1 = time.perf_counter()
            loaded = await self.cache.load(keys)
            done = time.perf_counter()
            rep.fetch_latencies_s.append(done - t0)
            rep.load_latencies_s.append(done - t1)
            try:
                valid = await self._check_loaded(keys, list(loaded.slots))
            finally:
                self.cache.release(keys)
            rep.load_missing += len(keys) - sum(s is not None for s in loaded.slots)
        rep.turns += 1
        rep.pages_looked_up += full
        for tier in found.tiers[: len(keys)]:
            self._hits[str(tier)] += 1
        rep.pages_missed += full - len(keys)
        # "Compute" every page past the valid cached prefix (prompt and reply), store them.
        context = np.concatenate([prompt, reply])
        all_keys = self.cache.page_keys(context)
        new_keys = all_keys[valid:]
        if new_keys:
            parents = [all_keys[i - 1] if i > 0 else ROOT_KEY for i in range(valid, len(all_keys))]
            pages = np.stack([page_content(k, self.page_bytes) for k in new_keys])
            stored = await self.cache.store_pages(new_keys, pages, parents=parents)
            rep.pages_stored += sum(stored)
            rep.store_failed += len(stored) - sum(stored)
        return context

    async def _check_loaded(self, keys: list[PageKey], slots: list[int | None]) -> int:
        """Check the loaded pages' bytes; returns the length of the prefix that was loaded
        and correct (the engine recomputes from there)."""
        rep = self.report
        if self.top_view is None:
            out = [np.empty(self.page_bytes, dtype=np.uint8) for _ in keys]
            ok = await self.cache.read(keys, out)
            got: list[np.ndarray | None] = [
                o if hit else None for o, hit in zip(out, ok, strict=True)
            ]
        else:
            got = [self.top_view(s) if s is not None else None for s in slots]
        valid = 0
        prefix = True
        for key, page in zip(keys, got, strict=True):
            if page is None:
                prefix = False
                continue
            rep.pages_loaded += 1
            rep.checked_pages += 1
            good = bool(np.array_equal(page, page_content(key, self.page_bytes)))
            if not good:
                rep.mismatches += 1
            prefix = prefix and good
            valid += prefix
        return valid
