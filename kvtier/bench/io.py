"""Tier I/O measurement: kvtier's own path next to a raw baseline, in the same run.

For each backend, every repeat writes ``pages`` pages through the backend contract
(:meth:`~kvtier.backend.Backend.put`: reserve -> write -> commit, checksums included where
the backend computes them), drops the page cache of disk stores, reads them back with
:meth:`~kvtier.backend.Backend.get` (verification included), checks every byte outside the
timed region, then runs the backend's raw baseline (:mod:`kvtier.bench.baselines`) on the
same memory, directory or server. Figures are medians over repeats; the ratio
kvtier / baseline is what to read, since absolute figures on a shared machine are noisy.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvtier import registry
from kvtier.backend import Backend
from kvtier.bench.baselines import (
    PROFILE_ENTRY_POINT_GROUP,
    BaselineSample,
    IOTarget,
    aligned_buffers,
    kvtier_call_threads,
    profile_for,
    registered_profile,
)
from kvtier.bench.memory import require_memory
from kvtier.bench.pagecache import drop_page_cache
from kvtier.errors import ConfigError, KVTierUsageError, TierIOError
from kvtier.keys import PageKey

DEFAULT_PAGE_BYTES = 4 * 1024 * 1024
#: Most timed repeats a run takes (``--repeats``): medians settle long before, and a run
#: this long already takes hours on a slow disk.
MAX_REPEATS = 10_000


@dataclass(frozen=True)
class IOBenchParams:
    """What ``kvtier bench io`` measures.

    Attributes:
        page_bytes: bytes per page (the transfer unit).
        pages: pages written and read per repeat.
        repeats: timed repeats (at most :data:`MAX_REPEATS`); figures are medians. One
            untimed warm-up pass runs first (first-touch effects would otherwise land on
            kvtier's side only).
        batch_pages: pages per backend call (and the remote baseline's pipeline depth).
        workdir: directory for disk stores (a sub-directory per backend is created and
            removed); ``None`` = a temporary directory.
        seed: seed of the page contents.
    """

    page_bytes: int = DEFAULT_PAGE_BYTES
    pages: int = 64
    repeats: int = 5
    batch_pages: int = 8
    workdir: Path | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("page_bytes", "pages", "repeats", "batch_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                flag = {"page_bytes": "--page-size", "batch_pages": "--batch"}.get(
                    name, f"--{name}"
                )
                raise KVTierUsageError(
                    f"bench io: {flag} must be a positive integer, got {value!r}"
                )
        if self.repeats > MAX_REPEATS:
            raise KVTierUsageError(
                f"bench io: --repeats must be at most {MAX_REPEATS:,}, got {self.repeats}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            # numpy's generators take only seeds >= 0 (a ValueError deep in the run)
            raise KVTierUsageError(f"--seed must be an integer >= 0, got {self.seed!r}")
        # The pages, the read buffers and an arena tier's own buffer are all in memory.
        require_memory("bench io", self.pages, self.page_bytes, 3, "--pages or --page-size")


@dataclass(frozen=True)
class TierIOResult:
    """The figures of one backend. Rates in GB/s (1e9 bytes per second), medians over
    repeats; ratios are medians of the per-repeat ratios kvtier / baseline.
    ``threads`` is the number of threads kvtier's path copied one call of
    ``batch_pages`` pages on (:func:`path_threads`). ``other_baselines`` has, per further
    baseline measured beside the main one (e.g. ``redis.asyncio`` beside the C client),
    its ``write_gbps``, ``read_gbps``, ``write_ratio`` and ``read_ratio`` computed the
    same way."""

    tier: str
    kind: str
    baseline_method: str
    page_bytes: int
    pages: int
    repeats: int
    threads: int
    kvtier_write_gbps: float
    kvtier_read_gbps: float
    baseline_write_gbps: float
    baseline_read_gbps: float
    write_ratio: float
    read_ratio: float
    verified_pages: int
    mismatches: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    other_baselines: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def page_data(n: int, page_bytes: int, seed: int) -> list[np.ndarray]:
    """``n`` pages of pseudo-random bytes (incompressible, distinct), each in its own
    page-aligned buffer: pages reach a store from arena slots, which are aligned, and the
    disk baselines use aligned buffers too."""
    rng = np.random.default_rng(seed)
    pages = aligned_buffers(n, page_bytes)
    for page in pages:
        page[:] = np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8)
    return pages


def bench_keys(tier: str, repeat: int, n: int, seed: int) -> list[PageKey]:
    """Distinct keys for one repeat (so a put is never a no-op on a present key)."""
    return [
        PageKey(xxhash.xxh3_128_digest(f"kvtier-bench-io/{tier}/{seed}/{repeat}/{i}".encode()))
        for i in range(n)
    ]


def copy_threads(backend: Backend) -> int:
    """Threads a backend's batch copies run on (its I/O threads, at most one per core)."""
    return max(1, min(backend.io_threads, os.cpu_count() or 1))


def path_threads(backend: Backend, params: IOBenchParams) -> int:
    """Threads kvtier's path copies one backend call of ``batch_pages`` pages (at most
    ``pages``: a call holds no more) on, as the backend decides per call
    (:func:`~kvtier.bench.baselines.kvtier_call_threads`): the ``threads`` a result
    reports, and the count the memcpy baseline of an arena matches."""
    call_pages = min(params.batch_pages, params.pages)
    return kvtier_call_threads(backend, call_pages, params.page_bytes, copy_threads(backend))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _paired_ratio(
    nbytes: int, kv_seconds: Sequence[float], base: Sequence[BaselineSample], write: bool
) -> float:
    """Median over repeats of kvtier's rate / the baseline's rate in the same repeat.

    Pairs measured moments apart share the machine's load, so their ratio is steadier on
    a busy machine than the ratio of the two medians.
    """
    ratios = []
    for k, b in zip(kv_seconds, base, strict=True):
        b_seconds = b.write_seconds if write else b.read_seconds
        ratios.append(_gbps(nbytes, k) / _gbps(b.nbytes, b_seconds))
    return statistics.median(ratios)


async def _timed_batches(
    fn: Callable[[Sequence[PageKey], Sequence[Any]], Any],
    keys: Sequence[PageKey],
    bufs: Sequence[np.ndarray],
    batch: int,
) -> tuple[float, list[bool]]:
    results: list[bool] = []
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        results.extend(await fn(keys[i : i + batch], bufs[i : i + batch]))
    return time.perf_counter() - start, results


async def bench_backend(
    name: str,
    params: IOBenchParams,
    scratch: Path,
    on_repeat: Callable[[], None] | None = None,
) -> TierIOResult:
    """Measure backend ``name`` (an entry-point name or ``module:Class``).

    Raises :class:`~kvtier.errors.UnknownBackendError` (usage) for an unknown name,
    :class:`~kvtier.errors.BackendUnavailableError` when it cannot run here, and
    :class:`~kvtier.errors.TierIOError` when a page cannot be written or read.
    """
    cls = registry.resolve(name)
    profile = profile_for(name, cls.kind)
    workdir = scratch / name.replace(":", "_").replace("/", "_")
    pages = page_data(params.pages, params.page_bytes, params.seed)
    outs = aligned_buffers(params.pages, params.page_bytes)
    kv_w: list[float] = []
    kv_r: list[float] = []
    base: list[BaselineSample] = []
    verified = mismatches = 0
    threads = 1
    async with profile.options(workdir) as options:
        try:
            backend: Backend = cls(
                page_bytes=params.page_bytes, capacity_pages=params.pages, **options
            )
        except ConfigError as exc:
            if registered_profile(name) is not None:
                raise
            given = ", ".join(f"{k}={v}" for k, v in options.items()) or "none"
            raise ConfigError(
                f"{exc} (no bench profile is registered for {name!r}: the default one for "
                f"its kind passed options {given}; register one in the entry-point group "
                f"'{PROFILE_ENTRY_POINT_GROUP}', see docs/backend-authors.md)"
            ) from exc
        async with backend:
            threads = path_threads(backend, params)
            for repeat in range(-1, params.repeats):  # -1: the warm-up pass
                keys = bench_keys(name, repeat, params.pages, params.seed)
                write_s, ok = await _timed_batches(backend.put, keys, pages, params.batch_pages)
                if not all(ok):
                    raise TierIOError(
                        f"{name}: {ok.count(False)} of {len(ok)} pages could not be written"
                    )
                drop_page_cache(workdir)
                read_s, hits = await _timed_batches(backend.get, keys, outs, params.batch_pages)
                if not all(hits):
                    raise TierIOError(
                        f"{name}: {hits.count(False)} of {len(hits)} pages missing on read"
                    )
                mismatches += sum(
                    not np.array_equal(o, p) for o, p in zip(outs, pages, strict=True)
                )
                verified += len(keys)
                target = IOTarget(
                    name,
                    backend,
                    keys,
                    pages,
                    params.page_bytes,
                    Path(options["path"]) if "path" in options else None,
                    options,
                    copy_threads(backend),
                    params.batch_pages,
                )
                sample = await profile.baseline(target)
                await backend.delete(keys)
                if repeat >= 0:
                    kv_w.append(write_s)
                    kv_r.append(read_s)
                    base.append(sample)
                if on_repeat is not None:
                    on_repeat()
    nbytes = params.pages * params.page_bytes
    kw = _gbps(nbytes, statistics.median(kv_w))
    kr = _gbps(nbytes, statistics.median(kv_r))
    bw = statistics.median(_gbps(s.nbytes, s.write_seconds) for s in base)
    br = statistics.median(_gbps(s.nbytes, s.read_seconds) for s in base)
    others: dict[str, dict[str, float]] = {}
    for other in base[-1].others:
        pairs = [s.others[other] for s in base if other in s.others]
        if len(pairs) != len(base):
            continue  # not measured in every repeat: no paired ratio
        alt = [BaselineSample(other, w, r, base[0].nbytes) for w, r in pairs]
        others[other] = {
            "write_gbps": statistics.median(_gbps(s.nbytes, s.write_seconds) for s in alt),
            "read_gbps": statistics.median(_gbps(s.nbytes, s.read_seconds) for s in alt),
            "write_ratio": _paired_ratio(nbytes, kv_w, alt, write=True),
            "read_ratio": _paired_ratio(nbytes, kv_r, alt, write=False),
        }
    return TierIOResult(
        tier=name,
        kind=str(cls.kind),
        baseline_method=base[-1].method,
        page_bytes=params.page_bytes,
        pages=params.pages,
        repeats=params.repeats,
        threads=threads,
        kvtier_write_gbps=kw,
        kvtier_read_gbps=kr,
        baseline_write_gbps=bw,
        baseline_read_gbps=br,
        write_ratio=_paired_ratio(nbytes, kv_w, base, write=True),
        read_ratio=_paired_ratio(nbytes, kv_r, base, write=False),
        verified_pages=verified,
        mismatches=mismatches,
        samples={
            "kvtier_write_s": kv_w,
            "kvtier_read_s": kv_r,
            "baseline_write_s": [s.write_seconds for s in base],
            "baseline_read_s": [s.read_seconds for s in base],
        },
        other_baselines=others,
    )


def default_tiers() -> tuple[list[str], list[dict[str, str]]]:
    """Backends ``bench io`` measures when none is named, and those it skips with why.

    Measured: every available arena, and every available store with a registered bench
    profile (:mod:`kvtier.bench.baselines`). Skipped: unavailable backends, and stores
    without a profile (how to set them up for a run is not known).
    """
    names: list[str] = []
    skipped: list[dict[str, str]] = []
    for info in registry.discover():
        if not info.available:
            skipped.append({"tier": info.name, "reason": info.reason or "unavailable"})
        elif info.kind == "arena" or registered_profile(info.name) is not None:
            names.append(info.name)
        else:
            skipped.append(
                {
                    "tier": info.name,
                    "reason": "no bench io profile registered (name it with --tier to try "
                    "the disk profile)",
                }
            )
    return names, skipped


def check_workdir(path: Path) -> None:
    """``--dir`` must be an existing, writable directory: the bench creates only its own
    scratch directories inside it (and removes them), never the directory itself.
    Raises :class:`KVTierUsageError` naming what is wrong."""
    if "\x00" in str(path):
        raise KVTierUsageError(f"--dir {str(path)!r} contains a NUL byte")
    if not path.exists():
        raise KVTierUsageError(f"--dir {path} does not exist: create it first")
    if not path.is_dir():
        raise KVTierUsageError(f"--dir {path} is not a directory")
    # tried, not asked (os.access): root passes every permission check, yet /proc or a
    # read-only mount refuses to create anything
    try:
        os.rmdir(tempfile.mkdtemp(prefix="kvtier-bench-io-probe-", dir=path))
    except OSError as exc:
        raise KVTierUsageError(
            f"--dir {path} is not writable: cannot create a directory in it ({exc.strerror})"
        ) from None


async def bench_io(
    tiers: Sequence[str],
    params: IOBenchParams,
    on_repeat: Callable[[], None] | None = None,
) -> list[TierIOResult]:
    """Measure each backend in ``tiers`` in turn (see :func:`bench_backend`).

    Disk stores write under ``params.workdir`` (a sub-directory per backend, removed
    afterwards) or a temporary directory.
    """
    if not tiers:
        raise KVTierUsageError("bench io: no tier to measure")
    parent = str(params.workdir) if params.workdir is not None else None
    if params.workdir is not None:
        check_workdir(params.workdir)
    results = []
    for name in tiers:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-io-", dir=parent) as tmp:
            results.append(await bench_backend(name, params, Path(tmp), on_repeat))
    return results
