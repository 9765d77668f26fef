"""``kvtier bench codec``: what each codec costs and saves, measured in one run.

Two parts, each with its own baseline measured in the same run (ratios, never bare times):

* **codec speed** (:func:`codec_speed`): encode and decode GB/s of logical (page) bytes on
  one thread (per core), beside a ``memcpy`` of the same pages; the ratio (page bytes per
  stored byte, frame included) and, for lossy codecs, the error relative to each page's
  largest value;
* **tier throughput** (:func:`tier_throughput`): the effective GB/s of a store tier (file,
  NVMe, remote) with each codec, in logical bytes per second through a
  :class:`~kvtier.codec.store.CodecStore`, beside the same store without a codec
  (``none``), rounds alternating between codecs so load drifts hit them alike. Reads of
  the file store run with its pages dropped from the page cache.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.backend import Backend
from kvtier.codec import CodecStore, make_codec, slot_bytes
from kvtier.codec.frame import FRAME_SIZE
from kvtier.codec.registry import registered_names
from kvtier.codec.tiers import create_backend
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.spec import KVSpec

#: Codecs measured by default: name, parameters, label.
DEFAULT_CODECS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("lz4", {}),
    ("lz4", {"shuffle": False}),
    ("zstd", {}),
    ("zstd", {"shuffle": False}),
    ("zstd", {"level": 3}),
    ("fp8-e4m3", {}),
    ("fp8-e4m3", {"scale": "token"}),
    ("int8", {}),
    ("int8", {"scale": "token"}),
]


def label(name: str, params: dict[str, Any]) -> str:
    """``zstd(level=3)``-style label of a codec and its parameters."""
    if not params:
        return name
    return f"{name}({', '.join(f'{k}={v}' for k, v in sorted(params.items()))})"


def parse_codec(text: str) -> tuple[str, dict[str, Any]]:
    """``zstd``, ``zstd:level=3`` or ``zstd:level=3,shuffle=false`` -> (name, params);
    a plugin's ``module:Class`` path works as a name, as in a tier's ``codec``
    (``mypkg.codecs:Rle``, ``mypkg.codecs:Rle:level=3``).

    A value is a bool (``true``/``false``), an integer (ASCII digits with an optional
    sign: ``-5``, ``+3``) or else the string as written (the codec checks it). Raises
    :class:`KVTierUsageError` for an item that is not ``key=value``, a blank key or a key
    given twice."""
    name, _, rest = text.partition(":")
    cls, colon, after = rest.partition(":")
    if cls and "=" not in cls and "," not in cls and name not in registered_names():
        name, rest = f"{name}:{cls}", after if colon else ""  # module:Class[:params]
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise KVTierUsageError(f"codec parameter {item!r} in {text!r} is not key=value")
        if not key.strip():
            raise KVTierUsageError(f"codec parameter {item!r} in {text!r} has no name")
        if key in params:
            raise KVTierUsageError(f"codec parameter {key!r} is given twice in {text!r}")
        params[key] = parse_value(value)
    return name, params


def parse_value(value: str) -> bool | int | str:
    """A codec parameter's value: ``true``/``false`` (any case) as a bool, an integer
    of ASCII digits with an optional sign as an int, anything else as the string."""
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"[+-]?[0-9]+", value):
        return int(value)
    return value


def _best(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def codec_speed(
    spec: KVSpec,
    pages: np.ndarray,
    codecs: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_CODECS,
    repeat: int = 3,
) -> dict[str, Any]:
    """Encode/decode GB/s on one thread, ratio and error of each codec over ``pages``
    (``[n, page_bytes]`` uint8), with a memcpy of the same bytes as the baseline."""
    n, pb = pages.shape
    if pb != spec.page_bytes:
        raise KVTierUsageError(f"pages hold {pb} bytes, the spec {spec.page_bytes}")
    logical = n * pb
    copy = np.empty_like(pages)
    memcpy_s = _best(lambda: np.copyto(copy, pages), repeat)
    rows: list[dict[str, Any]] = []
    for name, params in codecs:
        codec = make_codec(name, spec, **params)
        enc = np.zeros((n, codec.max_encoded_bytes()), dtype=np.uint8)
        lengths: list[int] = [0] * n

        def encode() -> None:
            for i in range(n):
                got = codec.encode(pages[i], enc[i])  # noqa: B023 - run at once
                lengths[i] = pb if got is None else got  # noqa: B023

        def decode() -> None:
            for i in range(n):
                if lengths[i] == pb and not codec.fixed_size:  # noqa: B023
                    copy[i] = pages[i]  # kept raw: a copy, as the store does
                else:
                    codec.decode(enc[i, : lengths[i]], copy[i])  # noqa: B023

        enc_s = _best(encode, repeat)
        dec_s = _best(decode, repeat)
        stored = sum(lengths) + n * FRAME_SIZE
        row: dict[str, Any] = {
            "codec": label(name, params),
            "lossy": codec.lossy,
            "ratio": logical / stored,
            "raw_pages": sum(1 for x in lengths if x == pb and not codec.fixed_size),
            "encode_gbps": logical / enc_s / 1e9,
            "decode_gbps": logical / dec_s / 1e9,
            "encode_vs_memcpy": memcpy_s / enc_s,
            "decode_vs_memcpy": memcpy_s / dec_s,
            "exact": bool(np.array_equal(copy, pages)),
        }
        if codec.lossy:
            row.update(_error(spec, pages, copy))
        rows.append(row)
    return {
        "pages": n,
        "page_bytes": pb,
        "memcpy_gbps": logical / memcpy_s / 1e9,
        "codecs": rows,
    }


def _error(spec: KVSpec, pages: np.ndarray, decoded: np.ndarray) -> dict[str, float]:
    """Error of decoded pages relative to each page's largest magnitude."""
    import torch

    dt = getattr(torch, spec.dtype)
    x = torch.from_numpy(pages).view(dt).float().reshape(len(pages), -1)
    y = torch.from_numpy(decoded).view(dt).float().reshape(len(pages), -1)
    peak = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    err = (y - x).abs() / peak
    rel = (y - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)
    return {
        "max_error_of_peak": float(err.max()),
        "mean_error_of_peak": float(err.mean()),
        "rms_relative_error": float(rel.mean()),
    }


# -- tier throughput -----------------------------------------------------------------


#: The backends whose throughput ``tier_throughput`` measures.
THROUGHPUT_TIERS: tuple[str, ...] = ("file", "nvme", "redis")


def check_throughput_tiers(backends: Sequence[str]) -> None:
    """Raise :class:`KVTierUsageError` naming the first of ``backends`` that
    :func:`tier_throughput` cannot measure (checked before any work starts)."""
    for backend in backends:
        if backend not in THROUGHPUT_TIERS:
            raise KVTierUsageError(
                f"tier throughput runs on {', '.join(THROUGHPUT_TIERS)}, not {backend!r}"
            )


@contextlib.asynccontextmanager
async def _tier_options(backend: str, root: Path) -> AsyncIterator[Callable[[str], dict[str, Any]]]:
    """Per codec label, the options of a fresh store of ``backend`` (a Valkey server is
    started on 127.0.0.1 for ``redis`` and stopped afterwards)."""
    if backend in ("file", "nvme"):
        extra = {"slab_bytes": 1 << 28} if backend == "nvme" else {}
        yield lambda tag: {"path": str(root / tag.replace("(", "_").replace(")", "")), **extra}
    elif backend == "redis":
        from kvtier.bench.baselines import valkey_options

        async with valkey_options(root) as opts:
            yield lambda tag: {**opts, "key_prefix": f"bench-codec-{tag}"}
    else:
        check_throughput_tiers([backend])


async def _timed(
    store: Backend, keys: list[PageKey], pages: np.ndarray, batch: int
) -> tuple[float, float]:
    """(write seconds, read seconds) of every page in batches of ``batch``."""
    from kvtier.bench.pagecache import drop_page_cache

    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ok = await store.put(keys[i : i + batch], list(pages[i : i + batch]))
        if not all(ok):
            raise KVTierUsageError(f"{type(store).__name__}: a benchmark write failed")
    write_s = time.perf_counter() - t0
    inner = store.inner if isinstance(store, CodecStore) else store
    path = getattr(inner, "path", None)
    if path is not None:
        drop_page_cache(Path(path))
    out = np.empty_like(pages)
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        got = await store.get(keys[i : i + batch], list(out[i : i + batch]))
        if not all(got):
            raise KVTierUsageError(f"{type(store).__name__}: a benchmark read missed")
    read_s = time.perf_counter() - t0
    return write_s, read_s


async def tier_throughput(
    spec: KVSpec,
    pages: np.ndarray,
    backend: str,
    codecs: Sequence[tuple[str, dict[str, Any]]],
    *,
    batch_pages: int = 16,
    rounds: int = 3,
    scratch: Path | None = None,
) -> dict[str, Any]:
    """Effective write and read GB/s (logical bytes) of ``backend`` with each codec,
    median of ``rounds`` alternating rounds, and each codec's ratio to ``none``.
    ``stored_bytes_per_page`` is what the store keeps and moves per page: the blob on a
    variable-length store, the whole slot on a fixed-slot one."""
    n, pb = pages.shape
    if ("none", {}) not in [(c, p) for c, p in codecs]:
        codecs = [("none", {}), *codecs]
    results: dict[str, dict[str, list[float]]] = {
        label(c, p): {"w": [], "r": []} for c, p in codecs
    }
    stored: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-", dir=scratch) as tmp:
        async with _tier_options(backend, Path(tmp)) as options:
            for rnd in range(rounds):
                for name, params in codecs:
                    tag = label(name, params)
                    made = make_codec(name, spec, **params)
                    store = create_backend(
                        backend,
                        spec=spec,
                        capacity_bytes=(n + 1) * max(slot_bytes(made), pb),
                        options=options(f"{tag}-{rnd}"),
                        codec=name,
                        codec_params=params,
                    )
                    rng = np.random.default_rng(rnd)
                    keys = [PageKey(rng.bytes(16)) for _ in range(n)]
                    async with store:
                        w, r = await _timed(store, keys, pages, batch_pages)
                        if isinstance(store, CodecStore) and store.sized:
                            st = store.stats()
                            stored[tag] = st["stored_bytes_written"] / max(1, st["encoded_pages"])
                        elif isinstance(store, CodecStore):
                            stored[tag] = store.slot  # a fixed slot: padded to its size
                        else:
                            stored[tag] = pb
                        await store.delete(keys)
                    results[tag]["w"].append(n * pb / w / 1e9)
                    results[tag]["r"].append(n * pb / r / 1e9)
    base = results["none"]
    rows = []
    for tag, res in results.items():
        w, r = statistics.median(res["w"]), statistics.median(res["r"])
        rows.append({
            "codec": tag,
            "stored_bytes_per_page": stored[tag],
            "write_gbps": w,
            "read_gbps": r,
            "write_vs_none": w / statistics.median(base["w"]),
            "read_vs_none": r / statistics.median(base["r"]),
        })  # fmt: skip
    return {"backend": backend, "pages": n, "page_bytes": pb, "batch_pages": batch_pages,
            "rounds": rounds, "codecs": rows}  # fmt: skip
