"""Helpers for the KVCache / pipeline tests: configs over real DRAM and file tiers, and
file-store subclasses that are slow, count their calls, or fail on demand.

The subclasses are real FileStores (real files in a tmp dir); they only add a delay,
a counter or a failure switch in the executor function or around a call. They are
referenced from configs by ``module:Class`` path, exactly as a third-party backend is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from kvtier.backends.dram import DramArena
from kvtier.backends.filestore import FileStore

from kvtier import registry
from kvtier.backend import Medium
from kvtier.cache import KVCache
from kvtier.errors import TierIOError
from kvtier.keys import PageKey
from kvtier.spec import preset

SPEC = preset("tiny")  # 512-byte pages, 4 tokens per page
PAGE = SPEC.page_bytes
PT = SPEC.page_tokens


def open_cache(cfg: dict[str, Any]) -> KVCache:
    """A cache over ``cfg`` alone: the environment's ``KVTIER_*`` variables are ignored."""
    return KVCache(cfg, env={})


def tier(name: str, backend: str, pages: int, **extra: Any) -> dict[str, Any]:
    """A tier table holding ``pages`` pages of the tiny spec: ``pages`` times the room one
    takes in ``backend`` (``Backend.page_footprint``: a 4 KiB slot on nvme)."""
    footprint = registry.resolve(backend).page_footprint(PAGE)
    out: dict[str, Any] = {"name": name, "backend": backend, "capacity": pages * footprint}
    out.update(extra)
    return out


def config(
    tmp: Path,
    dram_pages: int = 16,
    file_pages: int = 256,
    *,
    file_backend: str = "file",
    extra_tiers: list[dict[str, Any]] | None = None,
    **pipeline: Any,
) -> dict[str, Any]:
    """DRAM over a file store in ``tmp`` (plus ``extra_tiers`` below), tiny model."""
    tiers = [
        tier("dram", "dram", dram_pages),
        tier("file", file_backend, file_pages, options={"path": str(tmp / "file")}),
    ]
    tiers.extend(extra_tiers or [])
    return {
        "model": {"preset": "tiny"},
        "pipeline": pipeline,
        "log": {"format": "json"},
        "tiers": tiers,
    }


def sequence(rng: np.random.Generator, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids for ``pages`` full pages and random page bytes for them."""
    tokens = rng.integers(0, 50_000, size=pages * PT)
    data = rng.integers(0, 256, size=(pages, PAGE), dtype=np.uint8)
    return tokens, data


def dram_over_redis(url: str, dram_pages: int = 8, **options: Any) -> dict[str, Any]:
    """The tiny model, write-through, ``dram_pages`` of DRAM over a ``redis`` tier of 1,024
    pages at ``url`` with ``options`` (the remote tests' hierarchy)."""
    return {
        "model": {"preset": "tiny"},
        "pipeline": {"write_policy": "write-through"},
        "tiers": [
            tier("dram", "dram", dram_pages),
            {
                "name": "remote",
                "backend": "redis",
                "capacity": 1024 * PAGE,
                "options": {"url": url, **options},
            },
        ],
    }


async def sequence_below_dram(
    cache: KVCache, rng: np.random.Generator, pages: int
) -> tuple[list[PageKey], np.ndarray]:
    """:func:`stored_below_dram`, checking that every page left ``dram``: the keys and
    the page bytes (to compare what is read back)."""
    tokens, data = sequence(rng, pages)
    keys = (await cache.store(tokens, data)).keys
    await cache.flush()
    assert await cache.demote("dram", keys) == [], "pages stayed in dram"
    return keys, data


def damage_on_disk(cache: KVCache, key: PageKey) -> None:
    """Flip the last payload byte of ``key``'s page file in the file tier (``tiers[1]``):
    the checksum no longer matches."""
    path = cache.tiers[1].backend.page_path(key)  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


async def stored_below_dram(cache: KVCache, rng: np.random.Generator, pages: int) -> list[PageKey]:
    """Store a random sequence of ``pages`` pages, write it through, and push it out of
    the ``dram`` tier: its keys, now held by the tier below only."""
    tokens, data = sequence(rng, pages)
    keys = (await cache.store(tokens, data)).keys
    await cache.flush()
    await cache.demote("dram", keys)
    return keys


class SlowFileStore(FileStore):
    """A file store whose reads sleep ``delay_s`` per batch in the executor thread, and
    which records the most reads it ever had in flight at once."""

    delay_s: ClassVar[float] = 0.2
    max_concurrent: ClassVar[int] = 0
    _active: ClassVar[int] = 0
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def read_files(self, jobs: Any) -> Any:
        cls = type(self)
        with cls._lock:
            cls._active += 1
            cls.max_concurrent = max(cls.max_concurrent, cls._active)
        try:
            time.sleep(cls.delay_s)
            return super().read_files(jobs)
        finally:
            with cls._lock:
                cls._active -= 1


class CountingFileStore(FileStore):
    """A file store that counts calls of each batch method (one call = one batch)."""

    calls: ClassVar[dict[str, int]] = {}

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        type(self).calls["write"] = type(self).calls.get("write", 0) + 1
        return await super().write(reservations, data)

    async def get(self, keys: Any, out: Any) -> list[bool]:
        type(self).calls["get"] = type(self).calls.get("get", 0) + 1
        return await super().get(keys, out)


class FailingFileStore(FileStore):
    """A file store that, once ``failing`` is set, raises TierIOError on every read and
    write (as a backend whose device went away would), and reports per-page failure on
    reserve."""

    failing: ClassVar[bool] = False
    #: writes refused since ``failing`` was last set (pages)
    refused: ClassVar[int] = 0

    async def get(self, keys: Any, out: Any) -> list[bool]:
        if type(self).failing:
            raise TierIOError("injected: device gone")
        return await super().get(keys, out)

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        if type(self).failing:
            type(self).refused += len(reservations)
            raise TierIOError("injected: device gone")
        return await super().write(reservations, data)


async def _pass_gate(cls: Any) -> None:
    """Wait at ``cls.gate`` (an asyncio.Event, or None: go through), counted in
    ``cls.held`` while waiting."""
    if cls.gate is None:
        return
    cls.held += 1
    try:
        await cls.gate.wait()
    finally:
        cls.held -= 1


class GatedFileStore(FileStore):
    """A file store whose writes wait, once ``gate`` is set to an event, until it is set:
    a write-down the test holds back (and counts: ``held`` writes are waiting)."""

    gate: ClassVar[Any] = None  # an asyncio.Event, or None: writes go through
    held: ClassVar[int] = 0

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        await _pass_gate(type(self))
        return await super().write(reservations, data)


class GatedDeleteFileStore(FileStore):
    """A file store whose deletes wait, once ``gate`` is set to an event, until it is set
    (``held`` deletes are waiting): the last step of an eviction, held back."""

    gate: ClassVar[Any] = None  # an asyncio.Event, or None: deletes go through
    held: ClassVar[int] = 0

    async def delete(self, keys: Any) -> list[bool]:
        await _pass_gate(type(self))
        return await super().delete(keys)


class DeviceLikeArena(DramArena):
    """A DRAM arena that calls its memory ``device`` (host memory standing in for a GPU
    arena): it has a ``device_view`` of each slot, as the HBM arena does."""

    medium: ClassVar[Medium] = Medium.DEVICE

    def device_view(self, slot: int) -> Any:
        return self.view(slot)


class RefusingArena(DramArena):
    """A DRAM arena whose writes fail (per page, ``False``, as the backend contract
    allows) for the keys in ``refused`` when the write begins: pages the top tier will
    not take. A write of a key in ``gated`` then waits at ``gate`` (an asyncio.Event,
    ``held`` writes waiting) before it ends."""

    refused: ClassVar[set[PageKey]] = set()
    gated: ClassVar[set[PageKey]] = set()
    gate: ClassVar[Any] = None
    held: ClassVar[int] = 0

    async def write(self, reservations: Any, data: Any) -> list[bool]:
        cls = type(self)
        refused = [r.key in cls.refused for r in reservations]
        if any(r.key in cls.gated for r in reservations):
            await _pass_gate(cls)
        done = await super().write(reservations, data)
        return [ok and not no for ok, no in zip(done, refused, strict=True)]


class DeviceReadingStore(FileStore):
    """A file store that says it reads straight into device memory (as a GPUDirect
    Storage store would) and records the buffers each ``get`` filled."""

    reads_to_device: ClassVar[bool] = True
    targets: ClassVar[list[Any]] = []

    async def get(self, keys: Any, out: Any) -> list[bool]:
        type(self).targets.extend(out)
        return await super().get(keys, out)


class LabelFailingFileStore(FileStore):
    """A file store whose ``reserve`` raises for pages of one namespace label (as a store
    whose per-namespace area went away would)."""

    bad_label: ClassVar[str] = "bad"

    async def reserve(self, keys: Any, namespace: str = "") -> Any:
        if namespace == type(self).bad_label:
            raise TierIOError(f"injected: namespace {namespace!r} unavailable")
        return await super().reserve(keys, namespace)


class SlowWriteFileStore(FileStore):
    """A file store whose page writes sleep ``delay_s`` per batch in the executor thread,
    and which records, when closed, how many tasks ``pipeline`` was still running."""

    delay_s: ClassVar[float] = 0.2
    pipeline: ClassVar[Any] = None
    busy_at_close: ClassVar[list[int]] = []

    def write_files(self, jobs: Any) -> Any:
        time.sleep(type(self).delay_s)
        return super().write_files(jobs)

    async def close(self) -> None:
        if type(self).pipeline is not None:
            type(self).busy_at_close.append(type(self).pipeline.pending_tasks)
        await super().close()


class SlowKeysFileStore(FileStore):
    """A file store whose ``keys()`` (the recovery scan at start-up) takes ``delay_s``."""

    delay_s: ClassVar[float] = 5.0

    async def keys(self) -> Any:
        await asyncio.sleep(type(self).delay_s)
        return await super().keys()


class DeleteFailingFileStore(FileStore):
    """A file store whose ``delete`` reports per-page failure (``False``, as the backend
    contract asks) while ``failing`` is set, leaving its pages in place, as a remote
    store that cannot reach its server does."""

    failing: ClassVar[bool] = False
    #: ``contains`` raises too while ``failing`` (an outage: the store cannot say)
    unanswered: ClassVar[bool] = False

    async def delete(self, keys: Any) -> list[bool]:
        if type(self).failing:
            return [False] * len(keys)
        return await super().delete(keys)

    async def contains(self, keys: Any) -> list[bool]:
        if type(self).failing and type(self).unanswered:
            raise TierIOError("contains: the store does not answer")
        return await super().contains(keys)
