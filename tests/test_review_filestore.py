"""Review findings on FileStore: one process (or object) at a time per directory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.filestore import FileStore
from kvtier.backends.nvme_index import StoreLockedError

from kvtier.keys import PageKey

PAGE = 4096


def _store(path: Path) -> FileStore:
    return FileStore(page_bytes=PAGE, capacity_pages=8, path=path)


async def test_a_second_opener_is_refused_not_let_in_to_wipe_pending_writes(
    tmp_path: Path,
) -> None:
    key = PageKey(bytes(range(16)))
    page = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    async with _store(tmp_path) as first:
        (r,) = await first.reserve([key])
        assert r is not None
        assert await first.write([r], [page]) == [True]
        with pytest.raises(StoreLockedError, match=str(tmp_path)):
            await _store(tmp_path).open()
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
    async with _store(tmp_path) as again:  # released on close
        assert await again.keys() == [key]


@pytest.mark.parametrize("damage", ["vanished", "corrupt"])
async def test_a_page_committed_again_during_a_failing_read_is_kept(
    tmp_path: Path, damage: str
) -> None:
    """A read that finds the old file gone or damaged must not drop the page that a
    delete + put of the same key committed while that read was on its way back."""
    key = PageKey(bytes(range(16)))
    page = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    store = _store(tmp_path)
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
        real_read = store._read_files
        done_reading, go = threading.Event(), threading.Event()

        def held_read(jobs: Any) -> Any:
            out = real_read(jobs)
            done_reading.set()
            go.wait(30)
            return out

        store._read_files = held_read  # type: ignore[method-assign]
        reading = asyncio.ensure_future(store.get([key], [np.empty(PAGE, np.uint8)]))
        assert await asyncio.to_thread(done_reading.wait, 30)
        # Meanwhile the page is deleted and stored again, whole.
        assert await store.delete([key]) == [True]
        assert await store.put([key], [page]) == [True]
        go.set()
        assert await reading == [False]  # what that read found was not servable
        store._read_files = real_read  # type: ignore[method-assign]
        out = np.empty(PAGE, np.uint8)
        assert await store.contains([key]) == [True], "the fresh commit was dropped"
        assert await store.get([key], [out]) == [True]
        np.testing.assert_array_equal(out, page)
    finally:
        go.set()
        await store.close()
