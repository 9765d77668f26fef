"""Crash safety: SIGKILL a writer process at random moments, reopen, check every page.

The writer (a child process) puts batches of pages from two concurrent tasks (so commits
are grouped), deletes some pages to force slot reuse, and prints ``C <key>`` for every
page *after* its commit returned ``True`` and ``D <key>`` *before* it deletes one. The
parent kills it with SIGKILL at a random time (also during open and recovery), then
reopens the store and checks that every page reported committed and not deleted is there
with exactly the right bytes, and that no page the store serves has wrong bytes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_inspect import inspect_store

from kvtier.keys import PageKey

PAGE = 16 * 1024 + 300
CAPACITY = 160
SLAB = 24 * (PAGE + 4096)
KILLS = 24

WRITER = textwrap.dedent(
    """
    import asyncio, random, sys
    import numpy as np
    from kvtier.backends.nvme import NvmeStore

    PAGE, CAPACITY, SLAB, RUN = {page}, {capacity}, {slab}, int(sys.argv[1])

    def payload(key):
        return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
            0, 256, PAGE, dtype=np.uint8)

    async def stream(s, rng, lane):
        n = 0
        while True:
            keys = [(RUN * 10**9 + lane * 10**6 + n + i).to_bytes(16, "little")
                    for i in range(rng.randint(1, 6))]
            n += len(keys)
            ok = await s.put(keys, [payload(k) for k in keys], "crash-test")
            sys.stdout.write("".join(f"C {{k.hex()}}\\n" for k, o in zip(keys, ok) if o))
            sys.stdout.flush()
            if s.used_pages() > CAPACITY * 0.6:
                have = await s.keys()
                victims = rng.sample(have, min(len(have), rng.randint(1, 8)))
                sys.stdout.write("".join(f"D {{k.hex()}}\\n" for k in victims))
                sys.stdout.flush()
                await s.delete(victims)

    async def main():
        async with NvmeStore(page_bytes=PAGE, capacity_pages=CAPACITY, path=sys.argv[2],
                             slab_bytes=SLAB, engine="posix", io_threads=4) as s:
            print("ready", flush=True)
            rng = random.Random(RUN)
            await asyncio.gather(stream(s, rng, 0), stream(s, rng, 1))

    asyncio.run(main())
    """
).format(page=PAGE, capacity=CAPACITY, slab=SLAB)


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, PAGE, dtype=np.uint8
    )


async def check_store(root: Path, committed: set[bytes], maybe_gone: set[bytes]) -> int:
    """Reopen and check; returns how many pages the store holds."""
    async with NvmeStore(page_bytes=PAGE, capacity_pages=CAPACITY, path=root, slab_bytes=SLAB) as s:
        must = committed - maybe_gone
        present = set(await s.keys())
        missing = must - present
        assert not missing, f"{len(missing)} committed pages lost, e.g. {next(iter(missing)).hex()}"
        keys = [PageKey(k) for k in present]
        outs = [np.empty(PAGE, np.uint8) for _ in keys]
        hits = await s.get(keys, outs)
        for k, hit, out in zip(keys, hits, outs, strict=True):
            # Verification must not reject committed pages, and what is served is exact.
            assert hit, f"committed page {k.hex()} failed verification after a crash"
            assert np.array_equal(out, payload(k)), f"page {k.hex()} served with wrong bytes"
        assert s.stats()["recovery_seconds"] < 5
        return len(keys)


async def test_sigkill_at_random_points_loses_nothing_committed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = random.Random(20261129)
    committed: set[bytes] = set()
    maybe_gone: set[bytes] = set()
    total_reported = 0
    deadline = time.monotonic() + 45
    runs = 0
    for run in range(1, KILLS + 1):
        if time.monotonic() > deadline:
            break
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
        )
        # Kill during start-up/recovery sometimes, mostly mid-write.
        time.sleep(rng.uniform(0.05, 1.2))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        runs += 1
        for line in out.decode().splitlines():
            parts = line.split()
            if len(parts) != 2 or len(parts[1]) != 32:
                continue  # "ready", or a line cut by the kill
            k = bytes.fromhex(parts[1])
            if parts[0] == "C":
                committed.add(k)  # a "D" may precede it: the other lane saw the commit first
                total_reported += 1
            elif parts[0] == "D":
                maybe_gone.add(k)
        held = await check_store(root, committed, maybe_gone)
        assert held <= CAPACITY
    assert runs >= 10
    assert total_reported > 50, "the writer should have committed pages before most kills"
    report = inspect_store(root, verify=True)
    assert report["bad"] == []
