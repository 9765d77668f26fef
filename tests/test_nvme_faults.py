"""NVMe store faults: corruption, truncation, full disk, and bad store directories."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    NotAStoreError,
    StoreLockedError,
    StoreReadOnlyError,
    StoreVersionError,
)
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.backends.nvme_layout import BLOCK, SlotLayout
from kvtier.backends.nvme_slabs import slab_path
from kvtier.cli.app import get_app
from structlog.testing import capture_logs
from typer.testing import CliRunner

from kvtier.keys import PageKey

PAGE = 2 * BLOCK
SLAB = 8 * (PAGE + BLOCK)  # 8 slots per slab


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def store(path: Path, capacity: int = 64, page_bytes: int = PAGE, **opts: object) -> NvmeStore:
    opts.setdefault("slab_bytes", SLAB)
    return NvmeStore(page_bytes=page_bytes, capacity_pages=capacity, path=path, **opts)  # type: ignore[arg-type]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``where`` (skips the test where mounting is not allowed)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


# -- corruption ----------------------------------------------------------------------------


async def test_flipped_and_truncated_pages_are_detected_never_served(tmp_path: Path) -> None:
    root = tmp_path / "s"
    n = 20
    async with store(root) as s:
        assert all(await s.put([key(i) for i in range(n)], [page(i) for i in range(n)], "ns"))
    lay = SlotLayout(PAGE, 8)
    # Page 1: payload byte; page 2: header byte; page 3: index-consistent but key swapped
    # in by copying page 4's whole slot over it; slab 2 (pages 16..19) cut inside page 17.
    slab0, off1 = lay.locate(1)
    flip(slab_path(root, slab0), off1 + 100)
    _, off2 = lay.locate(2)
    flip(slab_path(root, 0), off2 + PAGE + 30)
    with open(slab_path(root, 0), "r+b") as f:
        f.seek(lay.locate(4)[1])
        slot4 = f.read(lay.slot_bytes)
        f.seek(lay.locate(3)[1])
        f.write(slot4)
    slab2, off17 = lay.locate(17)
    os.truncate(slab_path(root, slab2), off17 + PAGE // 2)
    damaged = {1, 2, 3, 17, 18, 19}

    report = inspect_store(root, verify=True)
    assert report["verified"] == n
    assert {b["key"] for b in report["bad"]} == {key(i).hex() for i in damaged}
    by_key = {b["key"]: b for b in report["bad"]}
    assert by_key[key(17).hex()]["slab"] == 2
    assert by_key[key(17).hex()]["offset"] == off17

    result = CliRunner().invoke(get_app(), ["inspect", "store", str(root), "--verify", "--json"])
    assert result.exit_code == 1
    assert len(json.loads(result.stdout)["bad"]) == len(damaged)

    # Pages past the end of the cut slab are found when the store opens (their rows point
    # outside the file): quarantined and logged then; the others when they are read.
    cut = {17, 18, 19}
    s = store(root)
    with capture_logs() as open_logs:
        await s.open()
    async with s:
        rows = [e for e in open_logs if e["event"] == "nvme.index_row_quarantined"]
        assert {e["key"] for e in rows} == {key(i).hex() for i in cut}
        assert all("past the end of slab file 2" in e["reason"] for e in rows)
        assert s.stats()["index_rows_dropped_at_open"] == len(cut)
        outs = [np.empty(PAGE, np.uint8) for _ in range(n)]
        with capture_logs() as logs:
            hits = await s.get([key(i) for i in range(n)], outs)
        assert hits == [i not in damaged for i in range(n)]
        for i in range(n):
            if i not in damaged:
                np.testing.assert_array_equal(outs[i], page(i))
        events = [e for e in logs if e["event"] == "nvme.page_unreadable"]
        assert {e["key"] for e in events} == {key(i).hex() for i in damaged - cut}
        assert all("slab" in e and "offset" in e for e in events)
        st = s.stats()
        assert st["integrity_errors"] == len(damaged - cut)
        assert st["quarantined_slots"] == len(damaged)
        assert await s.contains([key(1)]) == [False]
        # Quarantined slots are never handed out again; the store is full at capacity.
        assert s.used_pages() == n
    # Quarantine is durable, and the damaged pages are gone from the index.
    report = inspect_store(root, verify=True)
    assert report["bad"] == [] and report["quarantined"] == len(damaged)
    assert report["pages"] == n - len(damaged)


# -- full disk ------------------------------------------------------------------------------


async def test_enospc_on_slab_allocation_fails_cleanly_logged_once(tmp_path: Path) -> None:
    big = 64 * 1024
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        async with store(mnt / "s", capacity=64, page_bytes=big, slab_bytes=2 * (big + BLOCK)) as s:
            with capture_logs() as logs:
                ok: list[bool] = []
                for b in range(8):  # 32 pages of 64 KiB cannot fit in 1 MiB
                    ks = [key(b * 4 + i) for i in range(4)]
                    ok += await s.put(ks, [page(b * 4 + i, big) for i in range(4)])
            assert any(ok) and not all(ok)
            assert sum(e["event"] == "nvme.slab_allocation_failed" for e in logs) == 1
            assert s.stats()["errors.nvme.slab_allocation_failed"] > 1
            stored = [i for i, o in enumerate(ok) if o]
            outs = [np.empty(big, np.uint8) for _ in stored]
            assert await s.get([key(i) for i in stored], outs) == [True] * len(stored)
            for i, out in zip(stored, outs, strict=True):
                np.testing.assert_array_equal(out, page(i, big))
            assert s.used_pages() == len(stored)
        async with store(mnt / "s", capacity=64, page_bytes=big) as s:
            assert sorted(await s.keys()) == sorted(key(i) for i in stored)


async def test_enospc_on_write_fails_those_pages_only(tmp_path: Path) -> None:
    big = 64 * 1024
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        async with store(
            mnt / "s", capacity=64, page_bytes=big, slab_bytes=64 * (big + BLOCK), preallocate=False
        ) as s:
            with capture_logs() as logs:
                ok: list[bool] = []
                for b in range(8):
                    ks = [key(b * 4 + i) for i in range(4)]
                    ok += await s.put(ks, [page(b * 4 + i, big) for i in range(4)])
            assert any(ok) and not all(ok)
            failures = [e for e in logs if e["event"] == "nvme.write_failed"]
            assert len(failures) == 1 and failures[0]["cause"] == "write:ENOSPC"
            stored = [i for i, o in enumerate(ok) if o]
            outs = [np.empty(big, np.uint8) for _ in stored]
            assert await s.get([key(i) for i in stored], outs) == [True] * len(stored)
            assert s.used_pages() == len(stored)


def test_index_write_failure_in_a_subprocess(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the index's WAL hit "disk full" (no root needed): commits fail
    cleanly, logged once; every page reported committed survives, the rest are absent."""
    root = tmp_path / "s"
    limit = 72 * 1024
    script = textwrap.dedent(
        f"""
        import asyncio, json, resource
        import numpy as np
        from kvtier.backends.nvme import NvmeStore
        from kvtier.log import configure_logging
        configure_logging("json")
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        async def main():
            async with NvmeStore(page_bytes={PAGE}, capacity_pages=64, path={str(root)!r},
                                 slab_bytes={2 * (PAGE + BLOCK)}) as s:
                ok = []
                for i in range(12):
                    buf = np.random.default_rng(i).integers(0, 256, {PAGE}, dtype=np.uint8)
                    ok += await s.put([i.to_bytes(16, "little")], [buf])
                print(json.dumps(ok))
        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    ok = json.loads(done.stdout.strip().splitlines()[-1])
    assert ok[0] and not all(ok)
    assert done.stderr.count("nvme.commit_failed") == 1
    report = inspect_store(root, verify=True)
    assert report["bad"] == [] and report["pages"] == sum(ok)

    async def reopen() -> None:
        async with store(root, slab_bytes=2 * (PAGE + BLOCK)) as s:
            kept = [i for i, o in enumerate(ok) if o]
            assert sorted(await s.keys()) == sorted(key(i) for i in kept)
            outs = [np.empty(PAGE, np.uint8) for _ in kept]
            assert await s.get([key(i) for i in kept], outs) == [True] * len(kept)
            for i, out in zip(kept, outs, strict=True):
                np.testing.assert_array_equal(out, page(i))
            assert await s.put([key(100)], [page(100)]) == [True]  # healthy again

    asyncio.run(reopen())


# -- bad store directories -------------------------------------------------------------------


async def test_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(NotAStoreError, match=r"not an NVMe store.*cat\.jpg"):
        await store(tmp_path / "photos").open()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotAStoreError, match="not a directory"):
        await store(tmp_path / "afile").open()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / INDEX_FILE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(NotAStoreError, match="not a kvtier store index"):
        await store(tmp_path / "junk").open()
    with pytest.raises(NotAStoreError):
        inspect_store(tmp_path / "photos")
    result = CliRunner().invoke(get_app(), ["inspect", "store", str(tmp_path / "photos")])
    assert result.exit_code == 2
    assert "is not an NVMe store" in " ".join(result.stderr.split())


async def test_newer_format_is_refused(tmp_path: Path) -> None:
    async with store(tmp_path / "s") as s:
        await s.put([key(1)], [page(1)])
    db = sqlite3.connect(tmp_path / "s" / INDEX_FILE)
    db.execute("UPDATE meta SET v = '99' WHERE k = 'format_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreVersionError, match="format version 99, newer"):
        await store(tmp_path / "s").open()
    with pytest.raises(StoreVersionError):
        inspect_store(tmp_path / "s")


async def test_store_is_locked_against_a_second_opener(tmp_path: Path) -> None:
    root = tmp_path / "s"
    async with store(root):
        with pytest.raises(StoreLockedError, match=f"holder pid {os.getpid()}"):
            await store(root).open()
        with pytest.raises(StoreLockedError, match="--verify needs it closed"):
            inspect_store(root, verify=True)
        assert inspect_store(root)["pages"] == 0  # plain inspect works on a live store
    # Another process holding it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import asyncio, sys\n"
            "from kvtier.backends.nvme import NvmeStore\n"
            "async def main():\n"
            f"    async with NvmeStore(page_bytes={PAGE}, capacity_pages=4, path={str(root)!r}):\n"
            "        print('ready', flush=True); sys.stdin.readline()\n"
            "asyncio.run(main())\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLockedError, match=f"holder pid {holder.pid}"):
            await store(root).open()
    finally:
        holder.communicate("\n", timeout=30)
    async with store(root) as s:  # released when the holder exits
        assert s.used_pages() == 0


async def test_read_only_directory(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        async with store(ro) as s:
            await s.put([key(1)], [page(1)])
        ro.chmod(0o555)
        try:
            with pytest.raises(StoreReadOnlyError, match="read-only"):
                await store(ro).open()
        finally:
            ro.chmod(0o755)
        return
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        async with store(mnt / "s") as s:
            await s.put([key(1)], [page(1)])
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(StoreReadOnlyError, match="read-only"):
            await store(mnt / "s").open()
        report = inspect_store(mnt / "s", verify=True)  # inspection needs no write access
        assert report["pages"] == 1 and report["bad"] == []


def page_2(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


async def test_pages_of_a_missing_slab_file_are_dropped_and_can_be_stored_again(
    tmp_path: Path,
) -> None:
    from kvtier.backends.nvme_slabs import slab_path

    root = tmp_path / "s"
    opts: dict[str, object] = {"slab_bytes": 2 * (PAGE + BLOCK), "engine": "posix"}
    async with NvmeStore(page_bytes=PAGE, capacity_pages=8, path=root, **opts) as s:  # type: ignore[arg-type]
        assert all(await s.put([key(i) for i in range(4)], [page_2(i) for i in range(4)]))
    slab_path(root, 1).unlink()  # slots 2 and 3 lived there
    async with NvmeStore(page_bytes=PAGE, capacity_pages=8, path=root, **opts) as s:  # type: ignore[arg-type]
        outs = [np.empty(PAGE, np.uint8) for _ in range(4)]
        assert await s.get([key(i) for i in range(4)], outs) == [True, True, False, False]
        # Gone for good: not reported present, so the page_2 can be stored again.
        assert await s.contains([key(2), key(3)]) == [False, False]
        assert await s.put([key(2)], [page_2(2)]) == [True]
        assert await s.get([key(2)], outs[:1]) == [True]
        np.testing.assert_array_equal(outs[0], page_2(2))


async def test_a_writer_shut_out_by_a_verify_is_told_so(tmp_path: Path) -> None:
    from kvtier.backends.nvme_index import StoreLock

    root = tmp_path / "s"
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=root) as s:
        await s.put([key(1)], [page_2(1)])
    verifying = StoreLock(root, exclusive=False)  # what inspect store --verify holds
    try:
        with pytest.raises(StoreLockedError, match=r"being verified.*--verify") as info:
            await NvmeStore(page_bytes=PAGE, capacity_pages=4, path=root).open()
        assert "holder pid" not in str(info.value)  # that pid is the last writer, long gone
    finally:
        verifying.release()
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=root) as s:
        assert await s.keys() == [key(1)]


async def test_a_new_slab_files_directory_entry_is_made_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data made durable in a file whose name is not is lost on power loss: creating a
    slab syncs the directory that holds it before any page_2 in it can be committed."""
    import os

    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "s"
    async with NvmeStore(page_bytes=PAGE, capacity_pages=4, path=root) as s:
        assert await s.put([key(1)], [page_2(1)]) == [True]
    assert (root / "slabs").stat().st_ino in synced
    assert root.stat().st_ino in synced  # where the slabs directory itself was made


async def test_a_delete_that_fails_on_disk_keeps_the_page(tmp_path: Path) -> None:
    """A delete whose index row cannot be removed answers False and keeps the page (it is
    still on disk, still counted, and would come back on reopen): it used to answer True,
    and the cache forgot a page this store still counted and brought back."""
    import sqlite3

    async with NvmeStore(page_bytes=PAGE, capacity_pages=2, path=tmp_path / "s") as s:
        assert await s.put([key(1), key(2)], [page_2(1), page_2(2)]) == [True, True]
        assert s._index is not None
        real_delete = s._index.delete

        def failing_delete(keys: object) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        s._index.delete = failing_delete  # type: ignore[method-assign]
        assert await s.delete([key(1)]) == [False]
        s._index.delete = real_delete  # type: ignore[method-assign]
        assert s.used_pages() == 2 and await s.contains([key(1)]) == [True]
        assert await s.put([key(3)], [page_2(3)]) == [False]  # full
        out = [np.zeros(PAGE, np.uint8)]
        assert await s.get([key(1)], out) == [True] and (out[0] == page_2(1)).all()
        assert s.layout is not None
        assert len(list((tmp_path / "s" / "slabs").iterdir())) * s.layout.slots_per_slab <= 2
    async with NvmeStore(page_bytes=PAGE, capacity_pages=2, path=tmp_path / "s") as s:
        assert sorted(await s.keys()) == [key(1), key(2)]  # the delete never reached disk
        assert await s.delete([key(1)]) == [True]  # and a later one does
        assert s.used_pages() == 1
