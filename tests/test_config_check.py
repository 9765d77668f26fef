"""``kvtier inspect config --check`` never creates or modifies a store, on a real file
system: a missing store directory is reported as one that will be created, an existing
store is read without a byte or a timestamp changing, and a store of another page size
is judged by whether the configuration names its model (under vLLM the engine does)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.filestore import FileStore
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.cache import KVCache
from kvtier.keys import PageKey
from kvtier.spec import preset

TINY = preset("tiny").page_bytes  # 512
DEFAULT = preset("llama3-8b").page_bytes  # 2 MiB: the model of a file without [model]
OTHER = 3 * 4096  # a page size of some other model


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: type, mode, size, modification time, content hash."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(dirpath) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def _config(tmp_path: Path, nvme: Path, model: str | None, file_store: Path | None = None) -> Path:
    def tier(name: str, backend: str, capacity: str, path: Path | None = None) -> str:
        options = f'options = {{path = "{path}"}}\n' if path is not None else ""
        return (
            f'[[tiers]]\nname = "{name}"\nbackend = "{backend}"\ncapacity = "{capacity}"\n'
            + options
        )

    text = f'[model]\npreset = "{model}"\n' if model else ""
    text += tier("dram", "dram", "4MiB") + tier("nvme", "nvme", "8MiB", nvme)
    if file_store is not None:
        text += tier("f", "file", "8MiB", file_store)
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def _check(config: Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    """(exit code, the checks by tier, stderr) of ``inspect config -c config --check``."""
    result = CliRunner().invoke(
        get_app(), ["inspect", "config", "-c", str(config), "--check", "--json"], env=env or {}
    )
    assert "Traceback" not in result.output
    checks = {c["tier"]: c for c in json.loads(result.stdout)["checks"]}
    return result.exit_code, checks, " ".join(result.stderr.split())


def _nvme(path: Path, page_bytes: int, pages: int) -> None:
    """An NVMe store at ``path`` for ``page_bytes`` pages, holding ``pages`` of them."""

    async def make() -> None:
        store = NvmeStore(page_bytes=page_bytes, capacity_pages=8, path=path,
                          slab_bytes=4 * (page_bytes + 4096))  # fmt: skip
        async with store:
            keys = [PageKey(i.to_bytes(16, "little")) for i in range(pages)]
            data = [np.full(page_bytes, i, np.uint8) for i in range(pages)]
            assert await store.put(keys, data) == [True] * pages

    asyncio.run(make())


def test_missing_store_directories_are_reported_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: --check created .kvtier-cache/vllm with the CLI's page size, which a vLLM
    server then could not open (its tier skipped)."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, Path(".kvtier-cache/vllm"), None, Path("deep/er/fs"))
    code, checks, _ = _check(config)
    assert code == 0
    assert checks["nvme"]["ok"] and checks["f"]["ok"]
    assert checks["nvme"]["note"] == ".kvtier-cache/vllm will be created (. is writable)"
    assert checks["f"]["note"] == "deep/er/fs will be created (. is writable)"
    assert checks["dram"]["note"] is None  # opened and probed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtier.toml"]


def test_a_store_that_cannot_be_created_fails_and_names_why(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a directory")
    code, checks, err = _check(_config(tmp_path, tmp_path / "plain" / "nv", "tiny"))
    assert code == 1 and checks["nvme"]["step"] == "open"
    where = tmp_path / "plain"
    assert f"cannot create {where}/nv: {where} exists and is not a directory" in err


def test_a_new_store_whose_first_slab_cannot_fit_the_disk_fails(tmp_path: Path) -> None:
    """``--check`` passed an NVMe tier on a file system with 1 MiB free where its first
    64 MiB slab could never be allocated, so every write then failed (a probe, on a small
    tmpfs). A first slab larger than the free space now fails the check, naming both."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    huge = 1 << (free.bit_length() + 1)  # more than the file system has free
    config = tmp_path / "kvtier.toml"
    config.write_text(
        '[model]\npreset = "tiny"\n[[tiers]]\nname = "dram"\nbackend = "dram"\n'
        'capacity = "64KiB"\n[[tiers]]\nname = "nvme"\nbackend = "nvme"\n'
        f'capacity = {huge}\noptions = {{path = "{tmp_path / "nv"}", slab_bytes = {huge}}}\n'
    )
    code, checks, err = _check(config)
    assert code == 1 and checks["nvme"]["step"] == "open"
    assert "free and the first slab file needs" in err and "every write would fail" in err
    assert not (tmp_path / "nv").exists()


def test_existing_stores_are_read_without_a_change(tmp_path: Path) -> None:
    _nvme(tmp_path / "nv", TINY, 3)

    async def file_page() -> None:
        async with FileStore(page_bytes=TINY, capacity_pages=4, path=tmp_path / "fs") as fs:
            assert await fs.put([PageKey(bytes(16))], [np.zeros(TINY, np.uint8)]) == [True]

    asyncio.run(file_page())
    config = _config(tmp_path, tmp_path / "nv", "tiny", tmp_path / "fs")
    before = _snapshot(tmp_path)
    code, checks, _ = _check(config)
    assert code == 0, checks
    assert checks["nvme"]["note"] == f"holds 3 pages of {TINY} bytes"
    assert checks["f"]["note"] == f"{tmp_path / 'fs'} exists (opening indexes the pages in it)"
    assert _snapshot(tmp_path) == before  # no -wal/-shm file, no mode, no timestamp


def test_a_store_of_another_page_size_is_a_note_when_the_model_comes_from_the_engine(
    tmp_path: Path,
) -> None:
    """The file has no [model] (as for vLLM, which supplies the page size): a store that
    vLLM filled with its pages is not a failure of the file; the note says why and how to
    check for a model. Before: "failed at open: ... holds pages of 2949120 bytes"."""
    _nvme(tmp_path / "nv", OTHER, 2)
    code, checks, _ = _check(_config(tmp_path, tmp_path / "nv", None))
    assert code == 0 and checks["nvme"]["ok"]
    note = checks["nvme"]["note"]
    assert note.startswith(f"holds 2 pages of {OTHER} bytes, not {DEFAULT} as with the default "
                           "model (llama3-8b): the page size comes from the model")  # fmt: skip
    assert "[model] section or KVTIER_MODEL__* variables" in note


@pytest.mark.parametrize("how", ["file", "env"])
def test_a_store_of_another_page_size_fails_for_a_named_model(tmp_path: Path, how: str) -> None:
    _nvme(tmp_path / "nv", OTHER, 2)
    config = _config(tmp_path, tmp_path / "nv", "tiny" if how == "file" else None)
    env = {"KVTIER_MODEL__PRESET": "tiny"} if how == "env" else None
    code, checks, err = _check(config, env)
    assert code == 1 and checks["nvme"]["step"] == "open"
    assert (f"nvme (nvme) failed at open: ConfigError: NVMe store {tmp_path / 'nv'} holds "
            f"pages of {OTHER} bytes, not {TINY}: use another directory") in err  # fmt: skip


def test_an_empty_store_of_another_page_size_is_taken_over(tmp_path: Path) -> None:
    """An empty store made for 2 MiB pages (what --check used to create) is reported, and
    a cache of another model then runs with its NVMe tier instead of skipping it."""
    _nvme(tmp_path / "nv", DEFAULT, 0)
    config = _config(tmp_path, tmp_path / "nv", "tiny")
    code, checks, _ = _check(config)
    assert code == 0
    assert checks["nvme"]["note"] == (
        f"holds no pages (made for pages of {DEFAULT} bytes): opening re-initialises it "
        f"for pages of {TINY} bytes"
    )

    async def start() -> dict[str, str]:
        async with KVCache(config, env={}, configure_log=False) as cache:
            return dict(cache.skipped_tiers)

    assert asyncio.run(start()) == {}
    assert inspect_store(tmp_path / "nv")["page_bytes"] == TINY


@pytest.mark.parametrize("backend", ["nvme", "file"])
def test_a_store_open_in_another_process_fails(tmp_path: Path, backend: str) -> None:
    root = tmp_path / "store"
    if backend == "nvme":
        _nvme(root, TINY, 1)
        lock = root / "lock"
        config = _config(tmp_path, root, "tiny")
    else:
        root.mkdir()
        lock = root / ".lock"
        config = _config(tmp_path, tmp_path / "nv", "tiny", root)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a store open elsewhere holds
        os.pwrite(fd, b"4242\n", 0)
        code, checks, err = _check(config)
    finally:
        os.close(fd)
    assert code == 1
    if backend == "nvme":
        assert "is open in another process (holder pid 4242)" in err
    else:
        assert checks["f"]["step"] == "open" and "is already open in another process" in err


@pytest.mark.parametrize("damage", ["index deleted", "meta record deleted"])
def test_a_store_whose_index_open_rebuilds_is_reported_so(tmp_path: Path, damage: str) -> None:
    """The check says what opening will do (rebuild the index from the slabs), changing
    nothing; opening then does it."""
    root = tmp_path / "nv"
    _nvme(root, TINY, 2)
    if damage == "index deleted":
        (root / "index.sqlite").unlink()
        want = f"{root} has slab files but no index: opening rebuilds it"
    else:
        with contextlib.closing(sqlite3.connect(root / "index.sqlite")) as db, db:
            db.execute("DELETE FROM meta")
        want = "its index lost its records: opening rebuilds it from the slab files"
    store = NvmeStore(page_bytes=TINY, capacity_pages=8, path=root)
    before = _snapshot(tmp_path)
    assert store.preflight().note == want
    assert _snapshot(tmp_path) == before

    async def reopen() -> bool:
        async with store:
            return bool(store.stats()["index_rebuilt_at_open"])

    assert asyncio.run(reopen())


def test_inspect_config_masks_passwords(tmp_path: Path) -> None:
    """``inspect config`` printed a remote tier's password in clear, as an option and
    in the URL, in the table and in the JSON (output that is pasted into bug reports);
    ``stats()`` and the logs already masked it."""
    config = tmp_path / "kvtier.toml"
    config.write_text(
        '[model]\npreset = "tiny"\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "1MiB"\n'
        '[[tiers]]\nname = "remote"\nbackend = "redis"\ncapacity = "1MiB"\n'
        '[tiers.options]\nurl = "redis://alice:S3CRETpw@127.0.0.1:1/0"\n'
        'password = "PWoption9"\n'
    )
    for args in (["--json"], []):
        result = CliRunner().invoke(
            get_app(), ["inspect", "config", "--config", str(config), *args]
        )
        assert result.exit_code == 0, result.output
        assert "S3CRETpw" not in result.output and "PWoption9" not in result.output
        assert "redis://alice:***@127.0.0.1:1/0" in result.output
    options = json.loads(
        CliRunner()
        .invoke(get_app(), ["inspect", "config", "--config", str(config), "--json"])
        .stdout
    )["config"]["tiers"][1]["options"]
    assert options["password"] == "***"


async def test_check_gives_up_on_a_tier_that_never_answers() -> None:
    """Before: ``inspect config --check`` waited for good on a backend whose calls hang."""
    from kvtier.config import load_config
    from kvtier.tier_check import check_tiers

    cfg = {"model": {"preset": "tiny"},
           "tiers": [{"name": "dram", "backend": "dram", "capacity": "64KiB"},
                     {"name": "stuck", "backend": "fault_stores:HangingPutArena",
                      "capacity": "64KiB"}]}  # fmt: skip
    checks = await check_tiers(load_config(cfg, env={}).config, timeout_s=5.0)
    assert checks[0].ok and checks[0].step is None
    assert not checks[1].ok and checks[1].step == "write"
    assert "no answer within 5 s (a hang?" in str(checks[1].error)
