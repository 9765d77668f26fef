"""FileStore specifics: layout, nothing visible before commit, verified reads, reopen,
a crash mid-write, options, and a state machine against the model of the contract."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.filestore import FileStore
from kvtier.backends.nvme_index import StoreLockedError

from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.pageformat import HEADER_SIZE, decode_header, namespace_digest
from kvtier.testing.model import backend_state_machine

PAGE = 4096
NS = Namespace("filestore-test")


def _keys(n: int) -> list[PageKey]:
    return page_keys(np.arange(n * NS.page_tokens), NS)


def _pages(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def _store(path: Path, capacity: int = 8, **options: object) -> FileStore:
    return FileStore(page_bytes=PAGE, capacity_pages=capacity, path=path, **options)


async def _read(store: FileStore, keys: list[PageKey]) -> tuple[list[bool], list[np.ndarray]]:
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    return await store.get(keys, out), out


async def test_layout_and_header(tmp_path: Path) -> None:
    keys, data = _keys(2), _pages(2)
    async with _store(tmp_path) as store:
        assert await store.put(keys, data, NS.label) == [True, True]
        for key, page in zip(keys, data, strict=True):
            path = store.page_path(key)
            assert path == tmp_path / key.hex()[:2] / key.hex()
            raw = path.read_bytes()
            assert len(raw) == HEADER_SIZE + PAGE
            header = decode_header(raw[:HEADER_SIZE])
            assert header.key == key and header.payload_len == PAGE
            assert header.namespace_digest == namespace_digest(NS.label) == NS.digest
            assert raw[HEADER_SIZE:] == page.tobytes()


async def test_nothing_is_visible_on_disk_before_commit(tmp_path: Path) -> None:
    keys, data = _keys(2), _pages(2)
    async with _store(tmp_path) as store:
        res = [r for r in await store.reserve(keys) if r is not None]
        assert await store.write(res, data) == [True, True]
        assert not store.page_path(keys[0]).exists()
        assert len(list((tmp_path / ".tmp").iterdir())) == 2
        assert await store.commit(res[:1]) == [True]
        assert store.page_path(keys[0]).exists()
        await store.abort(res[1:])
        assert list((tmp_path / ".tmp").iterdir()) == []
        assert not store.page_path(keys[1]).exists()


async def test_one_executor_hop_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _store(tmp_path) as store:
        hops: list[str] = []
        real = store.run_blocking

        async def counting(fn: Any, *args: Any) -> Any:
            hops.append(getattr(fn, "__name__", "?"))
            return await real(fn, *args)

        monkeypatch.setattr(store, "run_blocking", counting)
        keys, data = _keys(5), _pages(5)
        assert await store.put(keys, data) == [True] * 5
        assert hops == ["write_files", "commit_files"]
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True] * 5
        assert await store.delete(keys[:2]) == [True, True]
        assert hops[2:] == ["read_files", "unlink_all"]


async def test_commit_of_an_unwritten_reservation_fails_and_frees(tmp_path: Path) -> None:
    async with _store(tmp_path, capacity=1) as store:
        (r,) = await store.reserve(_keys(1))
        assert r is not None
        assert await store.commit([r]) == [False]
        assert store.used_pages() == 0 and await store.keys() == []


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (lambda raw: raw[:HEADER_SIZE] + bytes([raw[HEADER_SIZE] ^ 1]) + raw[HEADER_SIZE + 1 :],
         "payload checksum"),
        (lambda raw: raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], "header checksum"),
        (lambda raw: raw[:-1], "bytes"),
        (lambda raw: raw + b"x", "bytes"),
        (lambda raw: bytes(len(raw)), "magic"),
    ],
    ids=["payload-bit", "header-bit", "truncated", "extended", "zeroed"],
)  # fmt: skip
async def test_damaged_pages_are_misses_counted_logged_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, what: str
) -> None:
    keys, data = _keys(3), _pages(3)
    caplog.set_level(logging.WARNING, logger="kvtier.backends.filestore")
    async with _store(tmp_path) as store:
        assert await store.put(keys, data) == [True] * 3
        path = store.page_path(keys[1])
        path.write_bytes(damage(path.read_bytes()))
        ok, out = await _read(store, keys)
        assert ok == [True, False, True]
        assert np.array_equal(out[0], data[0]) and np.array_equal(out[2], data[2])
        assert store.stats()["checksum_failures"] == 1
        assert not path.exists()
        assert await store.contains(keys) == [True, False, True]
        assert store.used_pages() == 2
        logged = [r.getMessage() for r in caplog.records]
        assert any(keys[1].hex() in m and str(path) in m and what in m for m in logged)
        # the page can be stored again
        assert await store.put(keys[1:2], data[1:2]) == [True]
        ok, out = await _read(store, keys[1:2])
        assert ok == [True] and np.array_equal(out[0], data[1])


async def test_a_page_under_another_keys_name_is_not_served(tmp_path: Path) -> None:
    keys, data = _keys(2), _pages(2)
    async with _store(tmp_path) as store:
        assert await store.put(keys, data) == [True, True]
        store.page_path(keys[1]).write_bytes(store.page_path(keys[0]).read_bytes())
        ok, out = await _read(store, keys)
        assert ok == [True, False] and np.array_equal(out[0], data[0])
        assert store.stats()["checksum_failures"] == 1


async def test_a_vanished_file_is_a_miss(tmp_path: Path) -> None:
    keys, data = _keys(1), _pages(1)
    async with _store(tmp_path) as store:
        assert await store.put(keys, data) == [True]
        store.page_path(keys[0]).unlink()
        ok, _ = await _read(store, keys)
        assert ok == [False] and store.stats()["read_errors"] == 1
        assert await store.contains(keys) == [False]


async def test_reopen_indexes_pages_and_clears_leftovers(tmp_path: Path) -> None:
    keys, data = _keys(3), _pages(3)
    async with _store(tmp_path) as store:
        assert await store.put(keys, data) == [True] * 3
        res = [r for r in await store.reserve(_keys(4)[3:]) if r is not None]
        assert await store.write(res, _pages(1, seed=9)) == [True]
    (tmp_path / ".tmp" / "stray").write_bytes(b"left by a crash")
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / ("ab" + "0" * 30)).write_bytes(b"wrong size")
    (tmp_path / "ab" / "not-a-key").write_bytes(b"")
    async with _store(tmp_path) as store:
        assert set(await store.keys()) == set(keys)
        assert store.used_pages() == 3
        assert store.stats()["skipped_files"] == 2
        assert list((tmp_path / ".tmp").iterdir()) == []
        ok, out = await _read(store, keys)
        assert ok == [True] * 3
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))


async def test_reopened_store_honours_capacity(tmp_path: Path) -> None:
    keys, data = _keys(3), _pages(3)
    async with _store(tmp_path, capacity=2) as store:
        assert await store.put(keys, data) == [True, True, False]
    async with _store(tmp_path, capacity=2) as store:
        assert await store.reserve(keys[2:]) == [None]


async def test_fsync_option_round_trips(tmp_path: Path) -> None:
    keys, data = _keys(2), _pages(2)
    async with _store(tmp_path, fsync=True) as store:
        assert store.stats()["fsync"] is True
        assert await store.put(keys, data) == [True, True]
        ok, out = await _read(store, keys)
        assert ok == [True, True] and np.array_equal(out[1], data[1])


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'path'.*required"):
        FileStore(page_bytes=PAGE, capacity_pages=2)
    with pytest.raises(ConfigError, match=r"'path'.*required"):
        FileStore(page_bytes=PAGE, capacity_pages=2, path="")
    with pytest.raises(ConfigError, match="'path'"):
        FileStore(page_bytes=PAGE, capacity_pages=2, path=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'fsync'"):
        _store(tmp_path, fsync="yes")
    with pytest.raises(ConfigError, match="compress"):
        _store(tmp_path, compress=True)


async def test_keys_must_be_page_keys(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        for bad in (b"short", "0" * 16, bytes(17)):
            with pytest.raises(KVTierUsageError, match="key 0 must be 16 bytes"):
                await store.put([bad], _pages(1))  # type: ignore[list-item]
        assert store.used_pages() == 0


async def test_unusable_directory_raises_on_open(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store = _store(blocker / "sub")
    with pytest.raises(OSError):
        await store.open()
    assert store.stats()["used_pages"] == 0


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    from kvtier.backends.filestore import FileStore
    from kvtier.keys import Namespace, page_keys

    async def main():
        ns = Namespace("filestore-test")
        keys = page_keys(np.arange(4096 * ns.page_tokens), ns)
        async with FileStore(page_bytes=%d, capacity_pages=4096, path=sys.argv[1]) as s:
            for i, key in enumerate(keys):
                page = np.full(%d, i %% 251, dtype=np.uint8)
                assert await s.put([key], [page]) == [True]
                print(i, flush=True)

    asyncio.run(main())
    """
) % (PAGE, PAGE)


async def test_kill_9_mid_write_leaves_only_whole_pages(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    assert proc.stdout is not None
    committed = -1
    deadline = time.monotonic() + 30
    while committed < 40 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        committed = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert committed >= 40, "the writer did not get going"
    async with _store(tmp_path, capacity=4096) as store:
        found = await store.keys()
        keys = page_keys(np.arange(4096 * NS.page_tokens), NS)
        index = {k: i for i, k in enumerate(keys)}
        assert set(keys[: committed + 1]) <= set(found)
        out = [np.zeros(PAGE, np.uint8) for _ in found]
        assert await store.get(found, out) == [True] * len(found)
        for key, page in zip(found, out, strict=True):
            assert (page == index[key] % 251).all()
        assert store.stats()["checksum_failures"] == 0


def _machine_factory() -> FileStore:
    return FileStore(page_bytes=64, capacity_pages=4, io_threads=2, path=_MACHINE_DIR.name)


_MACHINE_DIR = tempfile.TemporaryDirectory(prefix="kvtier-filestore-machine-")
TestFileStoreStateMachine = backend_state_machine(_machine_factory, max_examples=15).TestCase


def _store_2(path: Path) -> FileStore:
    return FileStore(page_bytes=PAGE, capacity_pages=8, path=path)


async def test_a_second_opener_is_refused_not_let_in_to_wipe_pending_writes(
    tmp_path: Path,
) -> None:
    key = PageKey(bytes(range(16)))
    page = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    async with _store_2(tmp_path) as first:
        (r,) = await first.reserve([key])
        assert r is not None
        assert await first.write([r], [page]) == [True]
        with pytest.raises(StoreLockedError, match=str(tmp_path)):
            await _store_2(tmp_path).open()
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                "import asyncio, sys\n"
                "from kvtier.backends.filestore import FileStore\n"
                "async def main():\n"
                f"    s = FileStore(page_bytes={PAGE}, capacity_pages=8, path=sys.argv[1])\n"
                "    await s.open()\n"
                "asyncio.run(main())\n",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,  # not the repository root, where kvtier/ would shadow the install
        )
        assert holder.returncode != 0 and "StoreLockedError" in holder.stderr
        # The refused openers did not clear this store's pending write.
        assert await first.commit([r]) == [True]
    async with _store_2(tmp_path) as again:  # released on close
        assert await again.keys() == [key]


@pytest.mark.parametrize("damage", ["vanished", "corrupt"])
async def test_a_page_committed_again_during_a_failing_read_is_kept(
    tmp_path: Path, damage: str
) -> None:
    """A read that finds the old file gone or damaged must not drop the page that a
    delete + put of the same key committed while that read was on its way back."""
    key = PageKey(bytes(range(16)))
    page = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    store = _store_2(tmp_path)
    await store.open()
    try:
        assert await store.put([key], [page]) == [True]
        path = store.page_path(key)
        if damage == "vanished":
            path.unlink()
        else:
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(bytes(raw))
        real_read = store.read_files
        done_reading, go = threading.Event(), threading.Event()

        def held_read(jobs: Any) -> Any:
            out = real_read(jobs)
            done_reading.set()
            go.wait(30)
            return out

        store.read_files = held_read  # type: ignore[method-assign]
        reading = asyncio.ensure_future(store.get([key], [np.empty(PAGE, np.uint8)]))
        assert await asyncio.to_thread(done_reading.wait, 30)
        # Meanwhile the page is deleted and stored again, whole.
        assert await store.delete([key]) == [True]
        assert await store.put([key], [page]) == [True]
        go.set()
        assert await reading == [False]  # what that read found was not servable
        store.read_files = real_read  # type: ignore[method-assign]
        out = np.empty(PAGE, np.uint8)
        assert await store.contains([key]) == [True], "the fresh commit was dropped"
        assert await store.get([key], [out]) == [True]
        np.testing.assert_array_equal(out, page)
    finally:
        go.set()
        await store.close()
