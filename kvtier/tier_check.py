"""Checking a configuration's tiers without running a cache: ``kvtier inspect config``.

* :func:`create_backend` builds tier ``i``'s backend (not opened) exactly as
  :class:`~kvtier.cache.KVCache` does, so every backend name and option is validated:
  an unknown backend, an unknown option or a missing required one (``nvme`` without
  ``path``) raises, naming the tier; so is its codec (``tiers[i].codec``), and a top
  tier too small to take a page beside the page it extends (:func:`check_top_tier_room`).
* :func:`check_tiers` (``--check``) checks each tier. A backend with a check without
  side effects (:meth:`~kvtier.backend.Backend.preflight`: the persistent ``file`` and
  ``nvme`` stores) gets that check only, so checking never creates or modifies a store: a
  missing store directory is reported as one that will be created (its nearest existing
  parent is writable); a codec on it encodes and decodes a probe page in memory. Any
  other backend (memory arenas, a remote pool) is opened and stores, reads back and
  deletes one probe page (:func:`probe_page`) under a random key: the tier is reachable,
  authenticated and writable, and returns what it stored (a tier with a lossy codec: the
  codec's rounding of it, :meth:`~kvtier.codec.store.CodecStore.round_trip`). Each tier
  gets a :class:`TierCheck` saying what failed, or what was found.

A store that holds pages of another size than the configuration's model makes is a
failure when the configuration names its model; when it does not (``model_known``
false: the page size then comes from the engine, as under vLLM), it is a note saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier.backend import Backend, Preflight
from kvtier.codec import tiers as codec_tiers
from kvtier.codec.scaled import INPUT_DTYPES, np_dtype
from kvtier.codec.store import CodecStore
from kvtier.codec.tiers import TierCapacityError, TierCodecError
from kvtier.config import KVTierConfig
from kvtier.errors import BackendUnavailableError, ConfigError, KVTierUsageError
from kvtier.keys import PageKey
from kvtier.spec import KVSpec


def create_backend(config: KVTierConfig, i: int) -> Backend:
    """Tier ``i``'s backend, constructed (not opened); a tier with a codec gets its store
    wrapped in a :class:`~kvtier.codec.store.CodecStore` (by
    :func:`kvtier.codec.tiers.create_backend`).
    Raises :class:`ConfigError` for a bad option or codec and the registry's errors for an
    unknown or unavailable backend (or one whose constructor failed), each naming the
    tier (``tiers[1] (nvme, backend 'nvme')``, ``tiers[1].codec (nvme)``)."""
    tc = config.tiers[i]
    try:
        backend = codec_tiers.create_backend(
            tc.backend,
            spec=config.spec,
            capacity_bytes=tc.capacity_bytes,
            options=tc.options,
            codec=tc.codec,
            codec_params=tc.codec_params,
        )
    except TierCapacityError as exc:
        raise ConfigError(f"tiers[{i}].capacity ({tc.name}): {exc}") from None
    except TierCodecError as exc:
        raise ConfigError(f"tiers[{i}].codec ({tc.name}): {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"tiers[{i}].options ({tc.name}): {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"tiers[{i}].options ({tc.name}): {exc}") from None
    except (KVTierUsageError, BackendUnavailableError) as exc:
        raise type(exc)(f"tiers[{i}] ({tc.name}, backend {tc.backend!r}): {exc}") from None
    check_top_tier_room(config, i, backend.capacity_pages)
    return backend


def check_top_tier_room(config: KVTierConfig, i: int, capacity_pages: int) -> None:
    """Raise :class:`ConfigError` when tier ``i`` is the top tier and, holding
    ``capacity_pages`` pages, cannot take a batch of one page beside the page it extends.

    Under leaf-first eviction (``pipeline.leaf_first``, the default) room made for a batch
    never evicts the batch's parents: the page before the batch stays while the batch
    lands. A top tier of one page therefore made ``store`` raise
    :class:`~kvtier.errors.CapacityError` on the second page of every sequence, even with
    a lower tier to take the ancestors; with two pages or more (and a high watermark below
    1) a batch, sized to the high watermark, always fits beside its parent. The message
    names the minimum. Lower tiers are not checked: there a batch that finds no room is
    not written (its pages stay where they are, or ``store`` answers ``False``)."""
    if i != 0 or not config.leaf_first or capacity_pages >= 2:
        return
    tc = config.tiers[i]
    size = f" ({2 * config.spec.page_bytes} bytes)" if tc.codec == "none" else ""
    raise ConfigError(
        f"tiers[{i}].capacity ({tc.name}): {capacity_pages} page cannot hold a page beside "
        "the one it extends, which leaf-first eviction keeps while the page lands (storing "
        f"any sequence of more than one page would raise CapacityError): the tier needs at "
        f"least 2 pages{size}, or set pipeline.leaf_first = false"
    )


def probe_page(spec: KVSpec) -> np.ndarray:
    """A random page (``page_bytes`` uint8) that every tier can store: finite values for a
    float KV dtype (a lossy codec refuses NaN and infinities, which random bytes hold),
    random bytes otherwise."""
    rng = np.random.default_rng()
    if spec.dtype in INPUT_DTYPES:
        values = rng.standard_normal(spec.page_bytes // spec.dtype_size, dtype=np.float32)
        return values.astype(np_dtype(spec.dtype)).view(np.uint8)
    return rng.integers(0, 256, spec.page_bytes, dtype=np.uint8)


@dataclass
class TierCheck:
    """The outcome of checking one tier.

    Attributes:
        tier / backend: the tier's name and backend.
        ok: the check passed: opened, stored, read back and deleted a probe page, or,
            for a backend checked without side effects, found that it would open.
        step: the step that failed (``create``, ``open``, ``write``, ``read``, ``delete``;
            ``open`` also for what a check without side effects finds would fail it).
        error: why, in words.
        note: what a check without side effects found (``.kvtier-cache/vllm will be
            created (.kvtier-cache is writable)``, ``holds 12 pages of 2097152 bytes``);
            ``None`` for a backend that was opened and probed.
    """

    tier: str
    backend: str
    ok: bool = False
    step: str | None = None
    error: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _why(backend: Backend, default: str) -> str:
    """A failure reason from the backend's stats when it keeps one."""
    try:
        stats = backend.stats()
    except Exception:  # stats are best effort here
        return default
    reason = stats.get("down_reason") or stats.get("last_error")
    return f"{default}: {reason}" if reason else default


#: How long ``--check`` waits for one tier's check (a backend whose calls never return,
#: a network store without a deadline, would otherwise hold it for good).
TIER_CHECK_TIMEOUT_S = 30.0


async def check_tier(
    config: KVTierConfig, i: int, model_known: bool = True, into: TierCheck | None = None
) -> TierCheck:
    """Create tier ``i`` and check it: :meth:`~kvtier.backend.Backend.preflight` when the
    backend has it (nothing is created or changed), else open, probe (store, read back,
    delete one page) and close it. ``model_known``: see the module docstring. ``into``:
    the result to fill, whose ``step`` says the step in progress while it runs."""
    tc = config.tiers[i]
    result = TierCheck(tc.name, tc.backend) if into is None else into
    try:
        backend = create_backend(config, i)
    except Exception as exc:
        result.step, result.error = "create", str(exc)
        return result
    result.step = "open"
    try:
        found = await asyncio.to_thread(backend.preflight)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if found is not None:
        return _judge(config, backend, found, result, model_known)
    try:
        await backend.open()
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.step = "write"  # the step in progress: an exception is reported at it
    try:
        key = PageKey(os.urandom(16))
        page = probe_page(config.spec)
        # a lossy codec gives back its own rounding of the page, not the page
        want = backend.round_trip(page) if isinstance(backend, CodecStore) else page
        if await backend.put([key], [page]) != [True]:
            result.error = _why(backend, "a probe page could not be stored (full, unreachable?)")
            return result
        result.step = "read"
        out = np.empty(config.spec.page_bytes, np.uint8)
        if await backend.get([key], [out]) != [True] or not np.array_equal(out, want):
            result.error = _why(backend, "the probe page did not read back intact")
            with contextlib.suppress(Exception):  # leave no probe page behind
                await backend.delete([key])
            return result
        result.step = "delete"
        if await backend.delete([key]) != [True] or await backend.contains([key]) != [False]:
            result.error = _why(backend, "the probe page was not deleted")
            return result
        result.ok, result.step = True, None
        return result
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        await backend.close()


def _judge(
    config: KVTierConfig, backend: Backend, found: Preflight, result: TierCheck, model_known: bool
) -> TierCheck:
    """The outcome of a check without side effects; a codec on the tier encodes and
    decodes a probe page in memory (a lossless one must give it back unchanged)."""
    result.note = found.note
    if found.page_size_conflict is not None:
        if model_known:
            result.step, result.error = "open", f"ConfigError: {found.page_size_conflict}"
            return result
        spec = config.spec
        want = backend.inner.page_bytes if isinstance(backend, CodecStore) else spec.page_bytes
        result.note = (
            f"{found.note}, not {want} as with the default model "
            f"({spec.name}): the page size comes from the model, which this configuration "
            "does not name (under vLLM, from the engine); while the store holds pages, a "
            "cache with another page size cannot open it. To check for a model, give its "
            "geometry: a [model] section or KVTIER_MODEL__* variables"
        )
    if isinstance(backend, CodecStore):
        try:
            page = probe_page(config.spec)
            back = backend.round_trip(page)
        except Exception as exc:
            result.step, result.error = "write", f"{type(exc).__name__}: {exc}"
            return result
        if not backend.codec.lossy and not np.array_equal(back, page):
            result.step, result.error = "read", "the codec did not give the probe page back"
            return result
    result.ok, result.step = True, None
    return result


async def check_tiers(
    config: KVTierConfig, model_known: bool = True, timeout_s: float = TIER_CHECK_TIMEOUT_S
) -> list[TierCheck]:
    """:func:`check_tier` for every tier, top first (one at a time); a tier whose check
    has not ended after ``timeout_s`` fails at the step it was in (cancelled)."""
    out = []
    for i, tc in enumerate(config.tiers):
        result = TierCheck(tc.name, tc.backend)
        try:
            await asyncio.wait_for(check_tier(config, i, model_known, result), timeout_s)
        except TimeoutError:  # result.step is the step it hung at
            result.error = (
                f"no answer within {timeout_s:g} s (a hang? a network store should bound "
                "each call with a deadline)"
            )
        out.append(result)
    return out
