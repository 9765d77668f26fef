"""A live workload with forks and speculative steps, on :class:`~kvtier.sequences.SequenceManager`.

Sequences are prefilled in chunks, then decode in speculative steps: snapshot, append
``draft_tokens`` proposed tokens, accept a leading run of them (each accepted with
probability ``accept_rate``, as a verifier would), then ``commit`` what was accepted (the
rest is dropped as by a rollback; a step that accepts nothing is a plain ``rollback``),
and append the verifier's own next token. Every ``fork_every`` steps a live sequence
forks (beam search / parallel sampling), sharing its pages copy-on-write; the oldest
sequence finishes when more than ``max_live`` are alive.

After each step every live sequence is faulted in (``ensure_resident``, a few at a
time so the pinned pages fit the top tier) and every token's KV is read back through the
packed block table and compared with what was appended: KV is a pure function of
(token, position), so the check needs no copy of the data. The report counts rollbacks,
pages discarded per tier (all in the working pool of the top tier: unverified pages never
go further), pages of unverified tokens found stored in any tier (must be 0) and
mismatches (must be 0). Returns plain data; the CLI renders it.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.attention import torch_dtype
from kvtier.bench.live import RunResult, failed_tiers, run_config, tier_health
from kvtier.config import ResolvedConfig
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey, page_keys
from kvtier.sequences import PageCache, SequenceManager
from kvtier.spec import KVSpec

#: Upper bound of every integer parameter (a token count beyond it is a mistake).
_MAX_PARAM = 1 << 20


@dataclass(frozen=True)
class SpeculativeParams:
    """Shape of the speculative workload.

    Attributes:
        sequences: sequences prefilled at the start.
        prompt_tokens: tokens per prompt (prefilled in chunks of ``chunk_tokens``).
        chunk_tokens: prefill chunk size.
        steps: speculative decode steps per sequence.
        draft_tokens: tokens the draft proposes per step.
        accept_rate: probability that each proposed token is accepted (a step keeps the
            leading run of accepted tokens).
        fork_every: fork a live sequence every this many steps (0: never).
        max_live: live sequences at most (the oldest finishes beyond it).
        fault_batch: sequences faulted in together (their pages are pinned at once).
        working_pages: working pool size (``None``: enough for ``max_live``).
        seed: seed of tokens, acceptance and forks.
    """

    sequences: int = 4
    prompt_tokens: int = 200
    chunk_tokens: int = 64
    steps: int = 12
    draft_tokens: int = 4
    accept_rate: float = 0.6
    fork_every: int = 4
    max_live: int = 8
    fault_batch: int = 2
    working_pages: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sequences", "chunk_tokens", "draft_tokens", "max_live", "fault_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVTierUsageError(f"speculative workload: {name} must be >= 1, got {v!r}")
        for name in ("prompt_tokens", "steps", "fork_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise KVTierUsageError(f"speculative workload: {name} must be >= 0, got {v!r}")
        for name in ("sequences", "chunk_tokens", "draft_tokens", "max_live", "fault_batch",
                     "prompt_tokens", "steps", "fork_every"):  # fmt: skip
            v = getattr(self, name)
            if v > _MAX_PARAM:  # token streams are allocated: keep them within memory
                raise KVTierUsageError(
                    f"speculative workload: {name} must be at most {_MAX_PARAM:,}, got {v:,}"
                )
        if isinstance(self.accept_rate, bool) or not isinstance(self.accept_rate, int | float):
            raise KVTierUsageError(
                f"speculative workload: accept_rate must be a number in [0, 1], "
                f"got {self.accept_rate!r}"
            )
        if not 0.0 <= self.accept_rate <= 1.0:  # also refuses nan
            raise KVTierUsageError(
                f"speculative workload: accept_rate must lie in [0, 1], got {self.accept_rate}"
            )

    def pool_pages(self, spec: KVSpec) -> int:
        """Working pages the run needs: per live sequence its partial page, the pages a
        draft can open, and one copy-on-write copy, twice over for forks in flight."""
        if self.working_pages is not None:
            return self.working_pages
        per_seq = 2 + spec.pages_for(self.draft_tokens + 1) + 1
        return 2 * self.max_live * per_seq


@dataclass
class SpeculativeReport:
    """What a run measured (plain data through :meth:`to_dict`)."""

    workload: str = "speculative"
    sequences_created: int = 0
    forks: int = 0
    steps: int = 0
    tokens_proposed: int = 0
    tokens_accepted: int = 0
    rollbacks: int = 0
    partial_accepts: int = 0
    full_accepts: int = 0
    pages_discarded: dict[str, int] = field(default_factory=dict)
    cow_copies: int = 0
    pages_published: int = 0
    resident_calls: int = 0
    pages_loaded: int = 0
    fault_errors: int = 0
    checked_pages: int = 0
    mismatches: int = 0
    unverified_pages_stored: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["accept_rate_observed"] = (
            self.tokens_accepted / self.tokens_proposed if self.tokens_proposed else None
        )
        return out


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (uint64 in, uint64 out; wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def token_kv(spec: KVSpec, tokens: list[int], start: int) -> torch.Tensor:
    """The KV appended for ``tokens`` at positions ``start..``: a pure function of
    (token, position). Each token's bytes are a fixed per-element pattern XOR a 64-bit hash
    of (token, position) repeated over the row, so two tokens or two positions collide
    only if 48 hash bits agree. Every byte is below 0x40: finite in every float dtype."""
    row = spec.num_layers * spec.kv_factor * spec.num_kv_heads * spec.head_dim * spec.dtype_size
    n = len(tokens)
    elems = np.arange(row, dtype=np.uint64)
    base = _mix64(elems).astype(np.uint8)  # fixed per-element pattern
    tok = np.asarray(tokens, dtype=np.uint64)
    pos = np.arange(start, start + n, dtype=np.uint64)
    h = _mix64(tok * np.uint64(0x9E3779B97F4A7C15) + pos).view(np.uint8).reshape(n, 8)
    reps = -(-row // 8)
    raw = np.bitwise_xor(base[None, :], np.tile(h, (1, reps))[:, :row])
    raw &= np.uint8(0x3F)
    # [tokens, layers*kv*heads*dim*size] -> [layers, kv, tokens, heads, dim]
    shaped = raw.reshape(
        n, spec.num_layers, spec.kv_factor, spec.num_kv_heads * spec.head_dim * spec.dtype_size
    ).transpose(1, 2, 0, 3)
    t = torch.from_numpy(np.ascontiguousarray(shaped))
    return t.view(torch_dtype(spec)).reshape(
        spec.num_layers, spec.kv_factor, n, spec.num_kv_heads, spec.head_dim
    )


class SpeculativeWorkload:
    """Runs the workload on an open manager (see the module docstring)."""

    def __init__(self, manager: SequenceManager, params: SpeculativeParams) -> None:
        self.mgr = manager
        self.params = params
        self.spec = manager.spec
        self.rng = random.Random(params.seed)
        self.tokens: dict[int, list[int]] = {}
        self.order: list[int] = []
        self.verified: set[PageKey] = set()
        self.report = SpeculativeReport()

    def _new_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32_000) for _ in range(n)]

    async def _append(self, s: int, tokens: list[int]) -> None:
        start = len(self.tokens[s])
        await self.mgr.append(s, tokens, token_kv(self.spec, tokens, start))
        self.tokens[s] += tokens

    def _note_verified(self, s: int) -> None:
        table = self.mgr.tables.table(s)
        self.verified.update(page_keys(self.tokens[s][: table.verified_tokens], self.mgr.namespace))

    async def _step(self, s: int) -> None:
        p = self.params
        v = self.mgr.snapshot(s)
        base = len(self.tokens[s])
        await self._append(s, self._new_tokens(p.draft_tokens))
        accepted = 0
        while accepted < p.draft_tokens and self.rng.random() < p.accept_rate:
            accepted += 1
        self.report.tokens_proposed += p.draft_tokens
        self.report.tokens_accepted += accepted
        if accepted == 0:
            await self.mgr.rollback(s, v)
            self.report.rollbacks += 1
        elif accepted < p.draft_tokens:
            await self.mgr.commit(s, v, keep=accepted)
            self.report.partial_accepts += 1
        else:
            await self.mgr.commit(s, v)
            self.report.full_accepts += 1
        del self.tokens[s][base + accepted :]
        await self._append(s, self._new_tokens(1))  # the verifier's own token
        self._note_verified(s)

    async def _check(self) -> None:
        live = list(self.order)
        pt = self.spec.page_tokens
        for i in range(0, len(live), self.params.fault_batch):
            group = live[i : i + self.params.fault_batch]
            batch = await self.mgr.ensure_resident(group)
            try:
                for row, s in enumerate(group):
                    toks = self.tokens[s]
                    expect = token_kv(self.spec, toks, 0)
                    for lp in range(self.spec.pages_for(len(toks))):
                        slot = int(batch.block_table[row, lp])
                        n = min(pt, len(toks) - lp * pt)
                        got = self.mgr.page(slot)[:, :, :n].cpu()  # an hbm page: a copy
                        want = expect[:, :, lp * pt : lp * pt + n]
                        self.report.checked_pages += 1
                        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                            self.report.mismatches += 1
            finally:
                await self.mgr.release(batch)

    def _unverified_stored(self) -> int:
        directory = self.mgr.cache.directory
        ns = self.mgr.namespace.label
        bad = 0
        for key in directory:
            entry = directory.get(key)
            if entry is None or entry.namespace != ns or not directory.tiers_of(key):
                continue
            if key not in self.verified:
                bad += 1
        return bad

    async def run(self, on_step: Callable[[], None] | None = None) -> SpeculativeReport:
        p = self.params
        t0 = time.perf_counter()
        for _ in range(p.sequences):
            s = self.mgr.create()
            self.tokens[s] = []
            self.order.append(s)
            self.report.sequences_created += 1
            prompt = self._new_tokens(p.prompt_tokens)
            for c in range(0, len(prompt), p.chunk_tokens):  # chunked prefill
                await self._append(s, prompt[c : c + p.chunk_tokens])
            self._note_verified(s)
        for step in range(p.steps):
            for s in list(self.order):
                await self._step(s)
            self.report.steps += 1
            if p.fork_every and (step + 1) % p.fork_every == 0:
                parent = self.rng.choice(self.order)
                child = self.mgr.fork(parent)
                self.tokens[child] = list(self.tokens[parent])
                self.order.append(child)
                self.report.forks += 1
                while len(self.order) > p.max_live:
                    gone = self.order.pop(0)
                    await self.mgr.free(gone)
                    del self.tokens[gone]
            await self._check()
            if on_step is not None:
                on_step()
        self.report.unverified_pages_stored = self._unverified_stored()
        for s in self.order:
            await self.mgr.free(s)
        st = self.mgr.stats
        self.report.pages_discarded = {t.name: 0 for t in self.mgr.cache.tiers}
        self.report.pages_discarded[self.mgr.top_tier] = st.pages_discarded
        self.report.cow_copies = st.cow_copies
        self.report.pages_published = st.pages_published
        self.report.resident_calls = st.resident_calls
        self.report.pages_loaded = st.pages_loaded
        self.report.fault_errors = st.fault_errors
        self.report.seconds = time.perf_counter() - t0
        return self.report


async def run_speculative(
    cache: PageCache, params: SpeculativeParams, on_step: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Play the workload on an open :class:`~kvtier.cache.KVCache`; returns the report
    as plain data (the cache stays open: take its metrics afterwards)."""
    mgr = await SequenceManager.open(cache, params.pool_pages(cache.spec))
    try:
        report = await SpeculativeWorkload(mgr, params).run(on_step)
    finally:
        await mgr.close()
    return report.to_dict()


def default_top_pages(params: SpeculativeParams, spec: KVSpec, batch_pages: int) -> int:
    """Top-tier pages for a run that spills: the working pool, the pages of the
    ``fault_batch`` longest sequences pinned at once, and one transfer batch of room;
    with ``max_live`` above ``fault_batch`` the other sequences' pages must go down."""
    longest = params.prompt_tokens + params.steps * (params.draft_tokens + 1)
    pinned = params.fault_batch * spec.pages_for(longest)
    return params.pool_pages(spec) + pinned + batch_pages


async def bench_speculative(
    base: ResolvedConfig,
    params: SpeculativeParams,
    *,
    model: str | None = None,
    top_capacity: int | None = None,
    disk_dir: Path | None = None,
    on_step: Callable[[], None] | None = None,
) -> RunResult:
    """Run the speculative workload on a :class:`~kvtier.cache.KVCache` opened on ``base``
    with ``bench run``'s overrides (see :func:`kvtier.bench.live.run_config`).

    When neither ``top_capacity`` nor the configuration sets the top tier's capacity, it
    is sized by :func:`default_top_pages` so that pages spill to the disk tier. Without
    ``disk_dir`` the disk tier lives in a temporary directory, removed afterwards.
    """
    from kvtier.cache import KVCache

    if top_capacity is None and base.sources.get("tiers[0].capacity", "default") == "default":
        cfg = run_config(base, model=model, disk_dir=None)
        top_capacity = default_top_pages(params, cfg.spec, cfg.batch_pages) * cfg.spec.page_bytes
    kept = disk_dir is not None
    tmp = None if kept else Path(tempfile.mkdtemp(prefix="kvtier-bench-spec-"))
    directory = disk_dir if disk_dir is not None else tmp
    try:
        config = run_config(
            base, model=model, top_capacity=top_capacity, disk_dir=directory, disk_required=kept
        )
        async with KVCache(config) as cache:
            planner = cache.pipeline.planner
            report = await run_speculative(cache, params, on_step)
        metrics = cache.metrics.snapshot()
        health = tier_health(cache, planner)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    failures = failed_tiers(metrics, [t.name for t in config.tiers], health)
    return RunResult(report, metrics, config.to_dict(), str(directory), kept, failures)
