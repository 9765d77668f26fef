"""An NVMe store keeps one descriptor per slab file open. With more slabs than the
process's open-file limit allowed, reads of the later slabs failed with EMFILE forever (a
probe: 347 of 400 reads, under ``ulimit -n 64``), and a slab that could not be opened was
reported as "the file system refused the space". Opening the store now raises the soft
limit towards the hard one when it is short, and warns, naming the limit, when the hard
limit itself is too low. Each case runs in a child process: limits are per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_CHILD = textwrap.dedent(
    """
    import asyncio, resource, sys
    import numpy as np
    from kvtier.backends.nvme import NvmeStore
    from kvtier.keys import PageKey

    soft, hard = int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    PAGE, PAGES = 4096, 300

    async def main():
        store = NvmeStore(page_bytes=PAGE, capacity_pages=PAGES, path=sys.argv[1],
                          engine="posix", slab_bytes=PAGE)  # one page per slab file
        await store.open()
        keys = [PageKey(i.to_bytes(16, "big")) for i in range(1, PAGES + 1)]
        data = [np.full(PAGE, i % 251, np.uint8) for i in range(PAGES)]
        stored = await store.put(keys, data)
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        hits = await store.get(keys, out)
        good = sum(h and np.array_equal(o, d) for h, o, d in zip(hits, out, data))
        try:
            await store.reserve([PageKey(bytes([255]) * 16)])
        except Exception as exc:  # a slab that could not be opened: why, in words
            print("reserve:", exc, file=sys.stderr)
        await store.close()
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        print("stored", sum(stored), "served", good)

    asyncio.run(main())
    """
)


def _run(tmp_path: Path, soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "nvme"), str(soft), str(hard)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_store_with_more_slabs_than_the_soft_limit_raises_it(tmp_path: Path) -> None:
    done = _run(tmp_path, 64, 4096)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert int(lines[0].split()[1]) > 300 + 64  # soft limit raised for 300 slab files
    assert lines[1] == "stored 300 served 300"
    assert "raised the open-file limit" in done.stderr


def test_a_store_reopened_under_a_low_soft_limit_opens_every_slab(tmp_path: Path) -> None:
    """The probe's case: 300 slabs made without a limit, reopened under ``ulimit -n 64``
    (soft): the limit is raised before the slab files are opened."""
    first = _run(tmp_path, 4096, 4096)
    assert first.returncode == 0 and "stored 300 served 300" in first.stdout, first.stderr
    again = _run(tmp_path, 64, 4096)
    assert again.returncode == 0, again.stderr
    assert "stored 300 served 300" in again.stdout


def test_a_hard_limit_too_low_is_named_and_the_error_says_why(tmp_path: Path) -> None:
    done = _run(tmp_path, 64, 64)
    assert done.returncode == 0, done.stderr
    assert "needs about 300 open files but the open-file limit is 64" in done.stderr
    assert "too many open files (the process's open-file limit, ulimit -n, is 64)" in done.stderr
    assert "its slab file could not be made, the store is not full" in done.stderr
    assert "the file system refused the space" not in done.stderr
