"""An NVMe store whose directory is deleted (or moved) while it is open fails its commits,
naming why, so its tier fails and the cache stores nothing more there. Before, SQLite went
on writing to the index file it held open: every store answered True, the tier stayed
healthy, and all those pages were gone once the store closed (a docs-only probe lost 64
pages that way; moved, the store went on writing into the moved directory and the
configured path reopened as a new, empty store). The same for its slab files alone
(deleted or replaced): a probe's 160 pages committed into deleted slabs were all gone at
reopen, the tier healthy all along."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from cache_kit import open_cache, sequence, tier


def _config(path: Path) -> dict[str, object]:
    nvme = {"name": "nvme", "backend": "nvme", "capacity": "1MiB", "options": {"path": str(path)}}
    return {"model": {"preset": "tiny"}, "tiers": [tier("dram", "dram", 4), nvme]}


def _replace_slabs(store: Path) -> None:
    """Each slab file replaced by a copy under its name (another inode)."""
    for slab in (store / "slabs").iterdir():
        copy = slab.with_suffix(".copy")
        shutil.copyfile(slab, copy)
        copy.replace(slab)


@pytest.mark.parametrize("how", ["deleted", "moved", "slabs deleted", "slabs replaced"])
async def test_a_store_whose_directory_went_away_fails_its_commits(
    tmp_path: Path, how: str
) -> None:
    rng = np.random.default_rng(11)
    store = tmp_path / "nvme"
    async with open_cache(_config(store)) as cache:
        tokens, data = sequence(rng, 8)
        assert all((await cache.store(tokens, data)).stored)
        await cache.flush()
        if how == "deleted":
            shutil.rmtree(store)
        elif how == "moved":
            store.rename(tmp_path / "elsewhere")
        elif how == "slabs deleted":  # the index stays: only the pages' bytes go
            shutil.rmtree(store / "slabs")
        else:
            _replace_slabs(store)
        tokens, data = sequence(rng, 8)
        result = await cache.store(tokens, data)
        await cache.flush()
        nvme = next(t for t in cache.stats()["tiers"] if t["name"] == "nvme")
        assert nvme["healthy"] is False
        assert not any(cache.directory.is_committed(k, "nvme") for k in result.keys)
        assert not all(result.stored)  # pages that could not stay in DRAM say so
