"""NVMe store hardening: a damaged or edited index, permissions, planted symlinks, and
rebuilding the index from the slabs (issue 12, items 1 and 3-6).

Every damaged store here either opens with the damage quarantined and logged (the other
pages intact) or is refused with an error that names the damage; never a bare exception,
never a wrong byte, never unbounded memory.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_index import INDEX_FILE, DamagedStoreError
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.backends.nvme_layout import BLOCK
from kvtier.backends.nvme_rebuild import rebuild_index
from kvtier.backends.nvme_slabs import slab_path
from kvtier.backends.store_files import UnsafeStoreError
from kvtier.cli.app import get_app
from structlog.testing import capture_logs
from typer.testing import CliRunner

from kvtier.errors import ConfigError
from kvtier.keys import PageKey

PAGE = 2 * BLOCK
SLAB = 8 * (PAGE + BLOCK)  # 8 slots per slab
N = 12


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


def store(path: Path, **opts: Any) -> NvmeStore:
    opts.setdefault("slab_bytes", SLAB)
    return NvmeStore(page_bytes=PAGE, capacity_pages=64, path=path, **opts)


async def filled(root: Path, n: int = N) -> None:
    async with store(root) as s:
        assert (
            await s.put([key(i) for i in range(n)], [page(i) for i in range(n)], "ns@x/f")
            == [True] * n
        )


def sql(root: Path, statement: str, *args: object) -> None:
    db = sqlite3.connect(root / INDEX_FILE)
    db.execute(statement, args)
    db.commit()
    db.close()


async def read_all(s: NvmeStore, n: int = N) -> list[bool]:
    outs = [np.empty(PAGE, np.uint8) for _ in range(n)]
    hits = await s.get([key(i) for i in range(n)], outs)
    for i, hit in enumerate(hits):
        if hit:
            np.testing.assert_array_equal(outs[i], page(i))  # never a wrong byte
    return hits


def cli(*args: str) -> Any:
    return CliRunner().invoke(get_app(), list(args))


# -- item 1: one bad row must not exhaust memory ---------------------------------------------


def test_a_huge_slot_is_quarantined_with_memory_bounded(tmp_path: Path) -> None:
    """Before: a row with slot 2**40 made the free-list rebuild allocate ~14 GB. The
    reopen runs in a process limited to 1 GiB of address space."""
    import asyncio

    root = tmp_path / "s"
    asyncio.run(filled(root))
    sql(root, "UPDATE pages SET slot = 1099511627776 WHERE key = ?", key(3))
    script = textwrap.dedent(
        f"""
        import asyncio, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        import numpy as np
        from kvtier.backends.nvme import NvmeStore
        async def main():
            async with NvmeStore(page_bytes={PAGE}, capacity_pages=64, path={str(root)!r},
                                 slab_bytes={SLAB}, io_threads=2) as s:
                outs = [np.empty({PAGE}, np.uint8) for _ in range({N})]
                keys = [i.to_bytes(16, "little") for i in range({N})]
                print(sum(await s.get(keys, outs)), s.stats()["index_rows_dropped_at_open"])
        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(N - 1), "1"]
    assert "nvme.index_row_quarantined" in done.stderr and "outside the slab files" in done.stderr


BAD_ROWS = [
    ("key = x'01'", "key is 1 bytes"),
    ("key = 42", "key is int"),
    ("key = 'text key'", "key is str"),
    ("slot = -1", "slot -1 is not an integer >= 0"),
    ("slot = 'abc'", "slot 'abc' is not an integer"),
    ("slot = 2.5", "slot 2.5 is not an integer"),
    ("slot = 9223372036854775807", "outside the slab files"),
    ("slab = 7", "do not match slot"),
    ("offset = 5", "do not match slot"),
    ("length = 1", "is not the page size"),
    ("length = 'big'", "is not the page size"),
    ("checksum = 'x'", "checksum 'x' is not a 64-bit integer"),
    ("namespace = x'00ff'", "is not text"),
    ("created = 'yesterday'", "is not a time"),
]


@pytest.mark.parametrize("change", ["length = 999999999999", "namespace = x'00ff'"])
async def test_totals_count_only_the_valid_rows(tmp_path: Path, change: str) -> None:
    """Before: a row with length 999999999999 made ``bytes`` 1,000,000,002,559 while the
    same report called the row invalid (opening the store drops it)."""
    root = tmp_path / "s"
    await filled(root)
    sql(root, f"UPDATE pages SET {change} WHERE key = ?", key(5))
    report = inspect_store(root)
    assert report["invalid_index_rows"] == 1
    assert (report["pages"], report["bytes"]) == (N - 1, (N - 1) * PAGE)
    assert report["namespaces"] == {"ns@x/f": {"pages": N - 1, "bytes": (N - 1) * PAGE}}
    assert report["fill"] == (N - 1) / report["capacity_pages"]
    result = cli("inspect", "store", str(root), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["bytes"] == (N - 1) * PAGE


async def test_verify_lists_every_invalid_row_not_the_first_20(tmp_path: Path) -> None:
    """``--verify`` listed only the first 20 invalid rows (the cap of the plain report's
    ``index_problems``): 40 pages lost to a truncated slab were reported as 20 bad."""
    root = tmp_path / "s"
    await filled(root, 40)
    sql(root, "UPDATE pages SET length = 1 WHERE rowid <= 30")
    report = inspect_store(root, verify=True)
    assert report["invalid_index_rows"] == 30
    assert len(report["bad"]) == 30
    assert len(report["index_problems"]) == 20  # the plain listing stays capped
    assert len(inspect_store(root)["index_problems"]) == 20


async def test_quarantined_counts_the_slots_opening_the_store_holds(tmp_path: Path) -> None:
    """Before: ``quarantined`` counted every quarantine row, a row naming a slot outside
    the slab files included (opening the store deletes it), and not the slot of an
    invalid page row (opening the store quarantines it)."""
    root = tmp_path / "s"
    await filled(root)
    for slot in (10**9, 10**9 + 1, -3):
        sql(root, "INSERT INTO quarantine (slot, key, reason, at) VALUES (?, NULL, 'x', 0)", slot)
    sql(root, "UPDATE pages SET length = 1 WHERE key = ?", key(5))
    report = inspect_store(root)
    assert (report["quarantined"], report["invalid_index_rows"]) == (1, 4)
    s = store(root)
    async with s:
        assert s.stats()["quarantined_slots"] == report["quarantined"]


@pytest.mark.parametrize(("change", "reason"), BAD_ROWS, ids=[c for c, _ in BAD_ROWS])
async def test_every_index_field_is_validated(tmp_path: Path, change: str, reason: str) -> None:
    root = tmp_path / "s"
    await filled(root)
    db = sqlite3.connect(root / INDEX_FILE)
    # Columns are declared typed, but SQLite stores whatever it is given.
    db.execute(
        f"UPDATE pages SET {change} WHERE rowid = (SELECT rowid FROM pages WHERE key = ?)",
        (key(5),),
    )
    db.commit()
    db.close()
    report = inspect_store(root, verify=True)
    assert report["invalid_index_rows"] == 1
    assert reason in report["bad"][0]["reason"]
    result = cli("inspect", "store", str(root), "--verify")
    assert result.exit_code == 1 and reason in " ".join(result.output.split())
    s = store(root)
    with capture_logs() as logs:
        await s.open()
    async with s:
        logged = [e for e in logs if e["event"] == "nvme.index_row_quarantined"]
        assert len(logged) == 1 and reason in logged[0]["reason"]
        hits = await read_all(s)
        assert hits == [i != 5 for i in range(N)]
        # The page can be stored again (its row is gone, not half-present).
        assert await s.put([key(5)], [page(5)]) == [True]
        assert (await read_all(s))[5]
    assert inspect_store(root, verify=True)["bad"] == []


async def test_rows_sharing_a_slot_or_key_in_an_index_without_constraints(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    db = sqlite3.connect(root / INDEX_FILE)
    db.executescript(
        "CREATE TABLE loose AS SELECT * FROM pages; DROP TABLE pages; "
        "ALTER TABLE loose RENAME TO pages;"
    )
    # Page 20's row claims page 4's slot; a second row for key 6 claims slot 11's.
    db.execute(
        "INSERT INTO pages SELECT ?, slot, slab, offset, length, checksum, namespace, created, "
        "accessed FROM pages WHERE key = ?",
        (key(20), key(4)),
    )
    db.execute(
        "INSERT INTO pages SELECT key, 40, 5, 0, length, checksum, namespace, created, "
        "accessed FROM pages WHERE key = ?",
        (key(6),),
    )
    db.commit()
    db.close()
    with capture_logs() as logs:
        async with store(root) as s:
            assert await read_all(s) == [True] * N
            assert await s.contains([key(20)]) == [False]
    reasons = [e["reason"] for e in logs if e["event"] == "nvme.index_row_quarantined"]
    assert any("already held by another page" in r for r in reasons)
    assert any("outside the slab files" in r or "indexed twice" in r for r in reasons)


async def test_bad_quarantine_rows_are_dropped(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    for slot in ("1099511627776", "40", "-3"):
        sql(root, f"INSERT INTO quarantine (slot, key, reason, at) VALUES ({slot}, NULL, 'r', 0)")
    with capture_logs() as logs:
        async with store(root) as s:
            assert await read_all(s) == [True] * N
            assert s.stats()["quarantined_slots"] == 0
    assert sum(e["event"] == "nvme.index_row_quarantined" for e in logs) == 3


@pytest.mark.parametrize(
    ("key_", "value", "match"),
    [
        ("format_version", "abc", "format_version = 'abc' is not an integer"),
        ("page_bytes", "2.5", "page_bytes = '2.5' is not an integer"),
        ("slots_per_slab", "0", r"slots_per_slab = '0' is not an integer in \[1"),
        ("slot_bytes", "123", "slot_bytes = 123 does not match"),
    ],
)
async def test_damaged_meta_is_refused_by_name(
    tmp_path: Path, key_: str, value: str, match: str
) -> None:
    root = tmp_path / "s"
    await filled(root)
    sql(root, "UPDATE meta SET v = ? WHERE k = ?", value, key_)
    with pytest.raises(DamagedStoreError, match=match):
        await store(root).open()
    with pytest.raises(DamagedStoreError, match="--rebuild-index"):
        inspect_store(root)
    result = cli("inspect", "store", str(root), "--json")
    assert result.exit_code == 1
    assert match.split(" = ")[0] in json.loads(result.stdout)["error"]["message"]
    # The slabs are intact: the index can be rebuilt and every page comes back.
    assert rebuild_index(root, page_bytes=PAGE)["pages"] == N
    async with store(root) as s:
        assert await read_all(s) == [True] * N


async def test_a_directory_where_the_lock_should_be_is_named(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    (root / "lock").unlink()
    (root / "lock").mkdir()
    with pytest.raises(UnsafeStoreError, match=r"lock.*should be a file but is a directory"):
        await store(root).open()
    result = cli("inspect", "store", str(root), "--verify")
    assert result.exit_code == 1 and "should be a file" in result.output


# -- item 5: a lost index is rebuilt from the slabs -------------------------------------------


@pytest.mark.parametrize("damage", ["deleted", "emptied", "pages table dropped", "meta deleted"])
async def test_a_lost_index_is_rebuilt_at_open(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "s"
    await filled(root)
    async with store(root) as s:  # a deleted page comes back only if its slot was not reused
        assert await s.delete([key(0)]) == [True]
        assert await s.put([key(100)], [page(0)]) == [True]  # reuses slot 0
    if damage == "deleted":
        for suffix in ("", "-wal", "-shm"):
            (root / f"{INDEX_FILE}{suffix}").unlink(missing_ok=True)
        with pytest.raises(DamagedStoreError, match=r"no index\.sqlite.*--rebuild-index"):
            inspect_store(root)
    elif damage == "emptied":
        os.truncate(root / INDEX_FILE, 0)
        (root / f"{INDEX_FILE}-wal").unlink(missing_ok=True)
    elif damage == "pages table dropped":
        sql(root, "DROP TABLE pages")
        with pytest.raises(DamagedStoreError, match="no pages table"):
            inspect_store(root)
        assert "no pages table" in cli("inspect", "store", str(root)).output
    else:
        sql(root, "DELETE FROM meta")
    s = store(root)
    with capture_logs() as logs:
        await s.open()
    async with s:
        events = [e["event"] for e in logs if e["log_level"] == "warning"]
        assert "nvme.index_rebuilding" in events and "nvme.index_rebuilt" in events
        assert s.stats()["index_rebuilt_at_open"]
        hits = await read_all(s)
        assert hits == [i != 0 for i in range(N)]
        out = [np.empty(PAGE, np.uint8)]
        assert await s.get([key(100)], out) == [True]
        np.testing.assert_array_equal(out[0], page(0))
        # Rebuilt rows know the namespace by its digest: reads still check it.
        assert await s.put([key(200)], [page(2)], "other") == [True]
    report = inspect_store(root, verify=True)
    assert report["bad"] == [] and report["pages"] == N + 1
    assert any(label.startswith("digest:") for label in report["namespaces"])


async def test_rebuild_index_command(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    with open(slab_path(root, 0), "r+b") as f:  # damage page 2's payload: not indexed
        f.seek(2 * (PAGE + BLOCK) + 10)
        f.write(b"\xff\xfe\xfd")
    (root / INDEX_FILE).write_bytes(b"not a database" * 300)
    result = cli("inspect", "store", str(root))
    assert result.exit_code != 0 and "not a kvtier store index" in " ".join(result.output.split())
    result = cli("inspect", "store", str(root), "--rebuild-index", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rebuild"]["pages"] == N - 1 and data["rebuild"]["damaged_slots"] == 1
    assert data["rebuild"]["page_bytes"] == PAGE  # inferred from the page headers
    # The old index was unreadable, so no capacity survives: said so, not "0 pages".
    assert data["capacity_pages"] is None and data["fill"] is None
    text = " ".join(cli("inspect", "store", str(root)).output.split())
    assert "not recorded (the index was rebuilt without one" in text
    async with store(root) as s:
        assert await read_all(s) == [i != 2 for i in range(N)]


async def test_rebuild_refuses_slabs_of_another_page_size(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    (root / INDEX_FILE).unlink()
    other = NvmeStore(page_bytes=3 * BLOCK, capacity_pages=64, path=root, slab_bytes=SLAB)
    with pytest.raises(DamagedStoreError, match="page headers say pages of 8192 bytes, not 12288"):
        await other.open()
    async with store(root) as s:  # the right page size still rebuilds it
        assert await read_all(s) == [True] * N


# -- item 3: private files whatever the umask ---------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes_under(root: Path) -> dict[str, int]:
    out = {str(root): stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize(("group", "fmode", "dmode"), [(False, 0o600, 0o700), (True, 0o660, 0o770)])
async def test_nvme_files_are_private_whatever_the_umask(
    tmp_path: Path, group: bool, fmode: int, dmode: int
) -> None:
    root = tmp_path / "new" / "s"
    async with store(root, group_access=group) as s:
        await s.put([key(1)], [page(1)])
        modes = modes_under(root)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == dmode
    expect = {"slabs": dmode, str(root): dmode}
    for name, mode in modes.items():
        assert mode == expect.get(name, fmode), (name, oct(mode))
    assert {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "lock"} <= set(modes)
    assert any(n.startswith("slabs/slab-") for n in modes)


@pytest.mark.usefixtures("umask_022")
async def test_an_old_world_readable_store_is_made_private_at_open(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await filled(root)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    async with store(root) as s:
        assert await read_all(s) == [True] * N
    for name, mode in modes_under(root).items():
        assert mode in (0o600, 0o700), (name, oct(mode))


@pytest.mark.usefixtures("umask_022")
async def test_slab_files_are_made_private_at_open_before_any_page_io(tmp_path: Path) -> None:
    """A slab file kept its world-writable mode (0666) through an open and close that
    read and wrote nothing: slabs were opened (and their modes fixed) on first I/O."""
    root = tmp_path / "s"
    await filled(root)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    async with store(root):
        pass
    for name, mode in modes_under(root).items():
        assert mode in (0o600, 0o700), (name, oct(mode))


@pytest.mark.parametrize("entry", ["lock", "index.sqlite", "slabs/slab-00000.dat"])
async def test_a_hard_linked_store_file_is_refused_and_the_other_name_untouched(
    tmp_path: Path, entry: str
) -> None:
    """A store file with a second name (a hard link from outside the store) was written
    through and ``chmod``-ed: a slab hard-linked to an outside file grew it to 1 MiB, wrote
    pages into it and made it 0600. Now it is refused, like a symlink."""
    root = tmp_path / "s"
    await filled(root)
    outside = tmp_path / "victim"
    os.link(root / entry, outside)
    outside.chmod(0o644)
    before = outside.read_bytes()
    with pytest.raises(UnsafeStoreError, match=f"{entry}.*2 hard links"):
        await store(root).open()
    assert outside.read_bytes() == before
    assert outside.stat().st_mode & 0o777 == 0o644


def test_group_access_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="group_access' must be true or false"):
        store(tmp_path, group_access="yes")


# -- item 4: planted symlinks are refused, their targets untouched ---------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "lock",
        "index.sqlite",
        "index.sqlite-wal",
        "index.sqlite-journal",  # SQLite's rollback journal: "unable to open" before
        "slabs",
        "slabs/slab-00000.dat",
    ],
)
async def test_a_planted_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, entry: str
) -> None:
    root = tmp_path / "s"
    await filled(root)
    target = tmp_path / "victim"
    if entry == "slabs":
        target.mkdir()
        (target / "keep.txt").write_text("precious")
    else:
        target.write_bytes(b"precious" * 4096)
    before = {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    link = root / entry
    if link.is_dir():
        import shutil

        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    link.symlink_to(target)
    with pytest.raises(UnsafeStoreError, match=f"{entry}.*symlink"):
        await store(root).open()
    result = cli("inspect", "store", str(root), "--verify", "--json")
    assert result.exit_code == 1
    assert "symlink" in json.loads(result.stdout)["error"]["message"]
    after = {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    assert after == before
    assert link.is_symlink()


async def test_a_slab_swapped_for_a_symlink_while_open_fails_pages_not_the_target(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    async with store(root, engine="posix") as s:
        await s.put([key(1)], [page(1)])
        slab_path(root, 1).parent.joinpath("slab-00001.dat").symlink_to(target)
        # Slots 8.. live in slab 1: its creation meets the symlink and fails those pages.
        res = await s.put([key(i) for i in range(2, 12)], [page(i) for i in range(2, 12)])
        assert res == [True] * 7 + [False] * 3
    assert target.read_bytes() == b"precious"


async def test_a_rebuild_skips_the_holes_of_a_sparse_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the index lost, a slab made a sparse file of 64 GiB (no disk used) set the
    rebuilt layout, and the rebuild read every one of its 5.6 Mi slots: 8 us a slot,
    half an hour a TiB, while the cache's open waited. Holes are now skipped
    (SEEK_DATA)."""
    from kvtier.backends import nvme_rebuild

    root = tmp_path / "s"
    await filled(root)
    (root / INDEX_FILE).unlink()
    os.truncate(slab_path(root, 0), (64 << 30) // 12288 * 12288)  # whole 12 KiB slots
    reads = 0
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        nonlocal reads
        reads += 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(nvme_rebuild.os, "preadv", counted)
    result = rebuild_index(root, page_bytes=PAGE)
    assert result["pages"] == N
    assert reads < 1000  # the slots that hold data, not 5.6 Mi (51 s here before)
    async with store(root) as s:
        assert await read_all(s) == [True] * N
