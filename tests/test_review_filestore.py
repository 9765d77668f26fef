"""Review findings on FileStore: one process (or object) at a time per directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
