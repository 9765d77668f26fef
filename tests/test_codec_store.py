"""CodecStore: a codec over a real store (file, NVMe, Valkey). The conformance kit and the state
machine on wrapped stores, bytes on the media, corrupted and foreign pages (misses, never
decoded), pages the codec cannot encode, one executor hop per batch."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from kvtier.backends.filestore import FileStore

from kvtier.codec import CodecStore, make_codec, slot_bytes, wrap
from kvtier.codec.frame import FRAME_SIZE
from kvtier.codec.lossless import ZstdCodec
from kvtier.codec.tiers import create_backend
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.pageformat import HEADER_SIZE
from kvtier.spec import KVSpec
from kvtier.testing import check_backend
from kvtier.testing.model import backend_state_machine
from kvtier.testing.servers import RedisServer, unavailable_reason

#: 4 KiB float16 pages: 2 layers, K/V, 8 tokens, 2 heads of 32.
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_tokens=8, name="t")
CAPACITY = 16


def _store(
    backend: str, codec: str, path: Path, capacity: int = CAPACITY, **params: Any
) -> CodecStore:
    options: dict[str, Any] = {"path": str(path)}
    if backend == "nvme":
        options["slab_bytes"] = 1 << 20
    b = create_backend(
        backend,
        spec=SPEC,
        capacity_bytes=capacity * slot_bytes(make_codec(codec, SPEC, **params)),
        options=options,
        codec=codec,
        codec_params=params,
    )
    assert isinstance(b, CodecStore)
    return b


def _kv_pages(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Pages that look like KV: normal values with a scale per head."""
    out = []
    for _ in range(n):
        spread = 10.0 ** rng.uniform(-1, 1, size=(2, 2, 1, 2, 1))
        x = (rng.standard_normal(SPEC.page_shape) * spread).astype(np.float16)
        out.append(x.view(np.uint8).reshape(-1).copy())
    return out


def _fp8_fixed_points(rng: np.random.Generator, n: int, page_bytes: int) -> list[np.ndarray]:
    """KV pages already rounded by fp8-e4m3: the codec keeps them byte for byte."""
    assert page_bytes == SPEC.page_bytes
    codec = make_codec("fp8-e4m3", SPEC)
    enc = np.empty(codec.max_encoded_bytes(), dtype=np.uint8)
    out = []
    for page in _kv_pages(rng, n):
        codec.encode(page, enc)
        codec.decode(enc, page)
        out.append(page)
    return out


def _keys(n: int, seed: int = 0) -> list[PageKey]:
    rng = np.random.default_rng(seed)
    return [PageKey(rng.bytes(16)) for _ in range(n)]


# -- the contract, on wrapped stores -----------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "codec"),
    [("file", "zstd"), ("file", "lz4"), ("nvme", "zstd"), ("file", "fp8-e4m3"),
     ("nvme", "fp8-e4m3")],
)  # fmt: skip
async def test_conformance_kit_passes_on_codec_wrapped_stores(
    backend: str, codec: str, tmp_path: Path
) -> None:
    pages = _fp8_fixed_points if codec == "fp8-e4m3" else None
    report = await check_backend(
        lambda: _store(backend, codec, tmp_path / "s"), persistent=True, pages=pages
    )
    assert "round_trip" in report.passed and "survives_reopen" in report.passed
    assert "loop_not_blocked" in report.passed


def _machine_factory() -> CodecStore:
    inner = FileStore(page_bytes=64 + FRAME_SIZE, capacity_pages=4, io_threads=2,
                      path=_MACHINE_DIR.name)  # fmt: skip
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
    return wrap(inner, make_codec("zstd", spec))


_MACHINE_DIR = tempfile.TemporaryDirectory(prefix="kvtier-codec-machine-")
#: the machine's pages (one byte repeated) compress: the encoded path, not the raw one
TestZstdFileStoreStateMachine = backend_state_machine(_machine_factory, max_examples=15).TestCase


# -- bytes on the media ------------------------------------------------------------------


async def test_fp8_pages_take_half_the_bytes_on_disk(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    async with _store("file", "fp8-e4m3", tmp_path) as store:
        keys, pages = _keys(4), _kv_pages(rng, 4)
        assert await store.put(keys, pages) == [True] * 4
        codec = store.codec
        for key in keys:
            size = store.inner.page_path(key).stat().st_size  # type: ignore[attr-defined]
            assert size == HEADER_SIZE + FRAME_SIZE + codec.max_encoded_bytes()
            assert size < SPEC.page_bytes // 2 + SPEC.page_bytes // 16
        out = [np.empty(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True] * 4
        for o, p in zip(out, pages, strict=True):
            x, y = p.view(np.float16).astype(np.float32), o.view(np.float16).astype(np.float32)
            assert np.abs(y - x).max() <= np.abs(x).max() / 16  # half an e4m3 ulp, at most
        assert store.stats()["codec_ratio"] > 1.8


async def test_zstd_keeps_only_the_compressed_bytes_on_a_variable_length_store(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(2)
    smooth = np.repeat(rng.standard_normal(SPEC.page_bytes // 16), 8).astype(np.float16)
    page = smooth.view(np.uint8).reshape(-1)
    noise = rng.integers(0, 256, SPEC.page_bytes, dtype=np.uint8)
    async with _store("file", "zstd", tmp_path) as store:
        keys = _keys(2)
        assert await store.put(keys, [page, noise]) == [True, True]
        sizes = [store.inner.page_path(k).stat().st_size for k in keys]  # type: ignore[attr-defined]
        assert sizes[0] < HEADER_SIZE + FRAME_SIZE + SPEC.page_bytes // 2
        assert sizes[1] == HEADER_SIZE + FRAME_SIZE + SPEC.page_bytes  # noise is kept raw
        out = [np.empty(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True, True]
        assert np.array_equal(out[0], page) and np.array_equal(out[1], noise)
        stats = store.stats()
        assert stats["raw_pages"] == 1 and stats["encoded_pages"] == 2


async def test_a_fixed_slot_store_gets_the_blob_zero_padded(tmp_path: Path) -> None:
    """NVMe slots have one size: a compressed page is padded with zeros, never with
    stale memory."""
    page = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    async with _store("nvme", "zstd", tmp_path) as store:
        assert not store.sized
        keys = _keys(1)
        assert await store.put(keys, [page]) == [True]
        blob = [np.full(store.slot, 0xAB, dtype=np.uint8)]
        assert await store.inner.get(keys, blob) == [True]
        used = store.stats()["stored_bytes_written"]
        assert FRAME_SIZE < used < store.slot // 4
        assert not blob[0][used:].any()


# -- failures: never decoded, never served ------------------------------------------------


def _count_decodes(store: CodecStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = store.codec.decode

    def counting(data: np.ndarray, out: np.ndarray) -> None:
        calls.append(data.nbytes)
        real(data, out)

    monkeypatch.setattr(store.codec, "decode", counting)
    return calls


async def test_a_corrupted_page_on_disk_is_a_miss_before_any_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    async with _store("file", "fp8-e4m3", tmp_path) as store:
        keys, pages = _keys(3), _kv_pages(rng, 3)
        assert await store.put(keys, pages) == [True] * 3
        path = store.inner.page_path(keys[1])  # type: ignore[attr-defined]
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + FRAME_SIZE + 100] ^= 0x10  # one bit of the encoded bytes
        path.write_bytes(bytes(raw))
        decodes = _count_decodes(store, monkeypatch)
        out = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True, False, True]
        assert len(decodes) == 2  # the damaged page never reached the decoder
        assert not out[1].any()
        assert store.inner.stats()["checksum_failures"] == 1
        assert await store.contains(keys) == [True, False, True]  # removed: can be stored again


@pytest.mark.parametrize("damage", ["encoded", "length", "tag"])
async def test_a_bad_frame_behind_a_valid_store_checksum_is_a_counted_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """The inner store verifies its own checksum over the blob it was given; a blob whose
    frame does not verify (damaged before the store saw it, or framed by another codec)
    is still a miss: counted, logged, deleted, never decoded."""
    rng = np.random.default_rng(5)
    async with _store("file", "zstd", tmp_path) as store:
        page = np.repeat(_kv_pages(rng, 1)[0][:64], 64)
        key = _keys(1)
        assert await store.put(key, [page]) == [True]
        blob = [np.zeros(store.slot, np.uint8)]
        (n,) = await store.inner.get_sized(key, blob)
        assert n is not None
        bad = blob[0][:n].copy()
        if damage == "encoded":
            bad[FRAME_SIZE + 3] ^= 1
        elif damage == "length":
            bad = bad[:-1]  # the frame claims one byte more than the blob holds
        else:
            lz4 = make_codec("lz4", SPEC)
            enc = np.zeros(lz4.max_encoded_bytes(), np.uint8)
            m = lz4.encode(page, enc)
            assert m is not None
            from kvtier.codec.frame import codec_tag, write_frame

            bad = np.zeros(FRAME_SIZE + m, np.uint8)
            bad[FRAME_SIZE:] = enc[:m]
            write_frame(bad, codec_tag(lz4.identity), 0, m, SPEC.page_bytes)
        assert await store.inner.delete(key) == [True]
        with pytest.raises(KVTierUsageError, match="one page"):  # plain put: whole pages only
            await store.inner.put(key, [bad])
        res = await store.inner.reserve(key)
        assert res[0] is not None
        assert await store.inner.write_blobs([res[0]], [bad]) == [True]
        assert await store.inner.commit([res[0]]) == [True]
        decodes = _count_decodes(store, monkeypatch)
        out = [np.zeros(SPEC.page_bytes, np.uint8)]
        assert await store.get(key, out) == [False]
        assert decodes == [] and not out[0].any()
        assert store.stats()["frame_failures"] == 1
        assert await store.contains(key) == [False]


async def test_a_tier_reconfigured_to_another_codec_misses_the_old_pages(tmp_path: Path) -> None:
    page = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    keys = _keys(2)
    async with _store("file", "lz4", tmp_path) as store:
        assert await store.put(keys, [page, page]) == [True, True]
    async with _store("file", "zstd", tmp_path) as store:
        assert set(await store.keys()) == set(keys)  # indexed, but framed by lz4
        out = [np.ones(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [False, False]
        assert store.stats()["frame_failures"] == 2
        assert await store.keys() == []


async def test_a_page_the_codec_cannot_encode_is_not_written(tmp_path: Path) -> None:
    x = np.ones(SPEC.page_shape, dtype=np.float16)
    x[0, 1, 2, 1, 5] = np.inf
    bad = x.view(np.uint8).reshape(-1)
    good = _kv_pages(np.random.default_rng(6), 1)[0]
    async with _store("file", "fp8-e4m3", tmp_path) as store:
        keys = _keys(2)
        assert await store.put(keys, [bad, good]) == [False, True]
        assert store.used_pages() == 1 and await store.contains(keys) == [False, True]
        assert store.stats()["encode_failures"] == 1


async def test_one_executor_hop_per_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _store("file", "zstd", tmp_path) as store:
        hops: list[str] = []
        real = store.run_blocking

        async def counting(fn: Any, *args: Any) -> Any:
            hops.append(getattr(fn, "__name__", "?"))
            return await real(fn, *args)

        monkeypatch.setattr(store, "run_blocking", counting)
        keys, pages = _keys(5), _kv_pages(np.random.default_rng(7), 5)
        assert await store.put(keys, pages) == [True] * 5
        out = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True] * 5
        assert hops == ["_encode", "_decode"]
        assert all(np.array_equal(o, p) for o, p in zip(out, pages, strict=True))


async def test_a_large_batch_is_split_across_the_worker_threads(tmp_path: Path) -> None:
    """Batches of a MiB or more are encoded in one chunk per worker thread, results in
    order."""
    async with _store("file", "lz4", tmp_path, capacity=300) as store:
        keys, pages = _keys(300), _kv_pages(np.random.default_rng(8), 300)
        assert await store.put(keys, pages) == [True] * 300
        out = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True] * 300
        assert all(np.array_equal(o, p) for o, p in zip(out, pages, strict=True))


def test_a_wrapper_checks_its_inner_store(tmp_path: Path) -> None:
    from kvtier.backends.dram import DramArena

    codec = make_codec("zstd", SPEC)
    with pytest.raises(KVTierUsageError, match="needs"):
        wrap(FileStore(page_bytes=SPEC.page_bytes, capacity_pages=2, path=tmp_path), codec)
    with pytest.raises(KVTierUsageError, match="not one"):
        CodecStore(DramArena(page_bytes=slot_bytes(codec), capacity_pages=2), codec)  # type: ignore[arg-type]


async def test_a_bad_page_the_store_cannot_delete_is_still_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    keys = _keys(1)
    async with _store("file", "lz4", tmp_path) as store:
        assert await store.put(keys, [page]) == [True]
    async with _store("file", "zstd", tmp_path) as store:

        async def failing(_keys: Any) -> list[bool]:
            raise OSError("disk went read-only")

        monkeypatch.setattr(store.inner, "delete", failing)
        out = [np.ones(SPEC.page_bytes, np.uint8)]
        assert await store.get(keys, out) == [False]
        assert store.stats()["frame_failures"] == 1


# -- the remote store: a compressed page crosses the network at its compressed size ------


@pytest.fixture
def valkey() -> Any:
    reason = unavailable_reason("valkey")
    if reason:
        pytest.skip(reason)
    with RedisServer("valkey") as server:
        yield server


def _remote(url: str, codec: str, prefix: str = "codec") -> CodecStore:
    b = create_backend(
        "redis",
        spec=SPEC,
        capacity_bytes=CAPACITY * slot_bytes(make_codec(codec, SPEC)),
        options={"url": url, "key_prefix": prefix},
        codec=codec,
    )
    assert isinstance(b, CodecStore)
    return b


async def test_conformance_kit_passes_on_a_zstd_remote_store(valkey: Any) -> None:
    report = await check_backend(lambda: _remote(valkey.url, "zstd"), persistent=True)
    assert "round_trip" in report.passed and "survives_reopen" in report.passed


async def test_zstd_sends_and_keeps_only_the_compressed_bytes_on_the_remote_store(
    valkey: Any,
) -> None:
    """The remote store keeps short blobs: a compressible page is a short value on the
    server, noise is kept raw (a page and its frame), and both read back byte for byte;
    a plain ``get`` of the store underneath takes whole pages only."""
    rng = np.random.default_rng(2)
    smooth = np.repeat(rng.standard_normal(SPEC.page_bytes // 16), 8).astype(np.float16)
    page = smooth.view(np.uint8).reshape(-1)
    noise = rng.integers(0, 256, SPEC.page_bytes, dtype=np.uint8)
    raw = redis.Redis(port=valkey.port)
    try:
        async with _remote(valkey.url, "zstd") as store:
            assert store.sized
            keys = _keys(2)
            assert await store.put(keys, [page, noise]) == [True, True]
            names = [store.inner.page_name(k) for k in keys]  # type: ignore[attr-defined]
            sizes = [raw.strlen(n) for n in names]
            assert sizes[0] < HEADER_SIZE + FRAME_SIZE + SPEC.page_bytes // 2
            assert sizes[1] == HEADER_SIZE + FRAME_SIZE + SPEC.page_bytes  # kept raw
            assert store.stats()["stored_bytes_written"] == sizes[0] + sizes[1] - 2 * HEADER_SIZE
            out = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
            assert await store.get(keys, out) == [True, True]
            assert np.array_equal(out[0], page) and np.array_equal(out[1], noise)
            blob = [np.zeros(store.slot, np.uint8)]
            assert await store.inner.get(keys[:1], blob) == [False]  # short: not a page
            assert store.inner.stats()["checksum_failures"] == 1
            assert raw.exists(names[0]) == 0  # and dropped, like a damaged page
    finally:
        raw.close()


async def test_a_damaged_short_blob_on_the_remote_store_is_a_miss_never_decoded(
    valkey: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    raw = redis.Redis(port=valkey.port)
    try:
        async with _remote(valkey.url, "lz4") as store:
            keys = _keys(3)
            assert await store.put(keys, [page, page, page]) == [True] * 3
            names = [store.inner.page_name(k) for k in keys]  # type: ignore[attr-defined]
            raw.setrange(names[0], FRAME_SIZE + 2, b"\xff")  # the encoded bytes
            raw.set(names[1], raw.get(names[1])[1:])  # one byte short
            decodes = _count_decodes(store, monkeypatch)
            out = [np.ones(SPEC.page_bytes, np.uint8) for _ in keys]
            assert await store.get(keys, out) == [False, False, True]
            assert len(decodes) == 1 and not out[2].any()
            assert store.inner.stats()["checksum_failures"] == 2
            assert await store.contains(keys) == [False, False, True]
    finally:
        raw.close()


class _BuggyZstd(ZstdCodec):
    """zstd with the bugs a plugin may have: an encode that writes to its input, returns
    a length that is no length, and a decode that raises a plain exception, each for the
    page whose first byte says so."""

    name = "buggy-zstd"

    def encode(self, page: np.ndarray, out: np.ndarray) -> int | None:
        if page[0] == 1:
            page[1] ^= 0xFF  # the cache's own copy, if it were writable
        if page[0] == 2:
            return -5
        return super().encode(page, out)

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        super().decode(data, out)
        if out[0] == 3:
            raise RuntimeError("injected decoder bug")


async def test_a_buggy_codec_fails_its_own_pages_only(tmp_path: Path) -> None:
    """An encode that wrote to its input changed the caller's page (the cache's DRAM
    copy, then served wrong); an encode returning -5 or a decode raising a plain
    exception failed the whole batch (every page a miss, on every reopen). Now each is
    that page's failure: not written, or a miss and deleted."""
    codec = _BuggyZstd(SPEC)
    inner = FileStore(page_bytes=slot_bytes(codec), capacity_pages=64, path=tmp_path / "f")
    store = wrap(inner, codec)
    pages = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(5)]
    for i, p in enumerate(pages):
        p[0] = i  # 0 and 4: fine; 1: writes its input; 2: bad length; 3: bad decode
    before = [p.copy() for p in pages]
    keys = _keys(5)
    async with store:
        assert await store.put(keys, pages) == [True, False, False, True, True]
        assert all(np.array_equal(p, b) for p, b in zip(pages, before, strict=True))
        assert store.stats()["encode_failures"] == 2
        out = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True, False, False, False, True]
        for i in (0, 4):
            assert np.array_equal(out[i], before[i])
        assert store.stats()["frame_failures"] == 1
        assert await store.contains(keys) == [True, False, False, False, True]  # deleted
