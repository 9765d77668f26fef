"""Bad input and damaged tiers, from the library (issue 12): a clear error naming the
problem, never a bare exception; a tier that cannot open degrades, the cache serves."""

from __future__ import annotations

import asyncio
import math
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.filestore import FileStore
from kvtier.backends.remote import RedisStore
from kvtier.backends.store_files import StorePathError, UnsafeStoreError
from structlog.testing import capture_logs

from kvtier.cache import KVCache
from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierUsageError, TierOpenError
from kvtier.keys import PageKey

PAGE = 512  # the tiny preset


def config(tmp_path: Path, **disk: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "8KiB"},
            {
                "name": "disk",
                "backend": "nvme",
                "capacity": "64KiB",
                "options": {"path": str(tmp_path / "nvme")},
                **disk,
            },
        ],
    }


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int) -> np.ndarray:
    return np.full(PAGE, i % 256, np.uint8)


def filestore(path: Any, **opts: Any) -> FileStore:
    return FileStore(page_bytes=PAGE, capacity_pages=16, path=path, **opts)


# -- file backend paths ------------------------------------------------------------------------


def _a_file(t: Path) -> Path:
    (t / "f").write_text("x")
    return t / "f"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_a_file, "is not a directory"),
        (lambda t: _a_file(t) / "sub", "exists and is not a directory"),
        (lambda t: t / ("n" * 300), "file name too long"),
    ],
    ids=["existing file", "parent is a file", "name too long"],
)
async def test_unusable_file_store_paths_are_named(tmp_path: Path, make: Any, needle: str) -> None:
    path = make(tmp_path)
    with pytest.raises(StorePathError, match=needle) as info:
        await filestore(path).open()
    assert str(path) in str(info.value) or str(path.parent) in str(info.value)


def test_a_nul_byte_in_a_path_is_named() -> None:
    with pytest.raises(StorePathError, match="NUL byte"):
        filestore("/tmp/a\x00b")
    from kvtier.backends.nvme import NvmeStore

    with pytest.raises(StorePathError, match="NUL byte"):
        NvmeStore(page_bytes=PAGE, capacity_pages=4, path="/tmp/a\x00b")


async def test_missing_parents_are_created_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c"
    async with filestore(path):
        pass
    for p in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700


async def test_read_only_location_is_named(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(StorePathError, match="ermission denied"):
                await filestore(ro / "s").open()
        finally:
            ro.chmod(0o700)
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(StorePathError, match="read-only file system"):
            await filestore(mnt / "s").open()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- file store: private files, no symlinks ---------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask_022")
async def test_file_store_files_are_private(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    async with filestore(root) as s:
        assert await s.put([key(1)], [page(1)]) == [True]
    entries = [root, *root.rglob("*")]
    assert {p.name for p in entries} >= {"fs", ".lock", ".tmp"}
    assert sum(p.is_file() and len(p.name) == 32 for p in entries) == 1  # the page
    for p in entries:
        assert stat.S_IMODE(p.lstat().st_mode) == (0o700 if p.is_dir() else 0o600), p


@pytest.mark.usefixtures("umask_022")
async def test_the_default_cache_directory_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config({"model": {"preset": "tiny"}}, env={}).config.to_dict()
    cfg["tiers"][0]["capacity"] = "8KiB"
    cfg["tiers"][1]["capacity"] = "64KiB"
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        await cache.store(np.arange(8), np.zeros((2, PAGE), np.uint8))
        await cache.flush()
    for p in [tmp_path / ".kvtier-cache", *(tmp_path / ".kvtier-cache").rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


@pytest.mark.parametrize("entry", [".lock", ".tmp", "ab", "ab/" + "ab" * 16])
async def test_file_store_refuses_planted_symlinks(tmp_path: Path, entry: str) -> None:
    root = tmp_path / "fs"
    async with filestore(root):
        pass
    target = tmp_path / "victim"
    if entry in (".tmp", "ab"):
        target.mkdir()
        (target / "keep").write_text("precious")
    else:
        target.write_text("precious")
    link = root / entry
    link.parent.mkdir(exist_ok=True)
    if link.is_dir() and not link.is_symlink():
        link.rmdir()
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    with pytest.raises(UnsafeStoreError, match="symlink"):
        await filestore(root).open()
    assert (
        (target / "keep").read_text() == "precious"
        if target.is_dir()
        else (target.read_text() == "precious")
    )


@pytest.mark.parametrize("entry", [".lock", "page"])
async def test_file_store_refuses_a_hard_linked_file(tmp_path: Path, entry: str) -> None:
    """A page file or the lock hard-linked to a file outside the store: the outside file
    was ``chmod``-ed to 0600 at open. Now the store refuses it, as it refuses a symlink."""
    root = tmp_path / "fs"
    async with filestore(root) as s:
        assert await s.put([key(1)], [page(1)]) == [True]
        path = root / ".lock" if entry == ".lock" else s.page_path(key(1))
    outside = tmp_path / "victim"
    os.link(path, outside)
    outside.chmod(0o644)
    with pytest.raises(UnsafeStoreError, match="2 hard links"):
        await filestore(root).open()
    assert outside.stat().st_mode & 0o777 == 0o644


async def test_a_page_swapped_for_a_symlink_while_open_is_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    target = tmp_path / "victim"
    async with filestore(root) as s:
        assert await s.put([key(1)], [page(1)]) == [True]
        path = s.page_path(key(1))
        target.write_bytes(path.read_bytes())  # even bytes that would verify
        path.unlink()
        path.symlink_to(target)
        out = [np.empty(PAGE, np.uint8)]
        assert await s.get([key(1)], out) == [False]
        assert await s.contains([key(1)]) == [False]
    assert target.exists() and not path.exists()


# -- tiers that cannot open degrade -----------------------------------------------------------


async def test_a_damaged_disk_tier_is_skipped_and_the_cache_serves(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "index.sqlite").write_bytes(b"garbage" * 100)
    with capture_logs() as logs:
        async with KVCache(config(tmp_path), configure_log=False) as cache:
            assert [t.name for t in cache.tiers] == ["dram"]
            assert "not a kvtier store index" in cache.skipped_tiers["disk"]
            res = await cache.store(np.arange(16), np.stack([page(i) for i in range(4)]))
            assert all(res.stored)
            out = np.empty((4, PAGE), np.uint8)
            assert await cache.read(res.keys, out) == [True] * 4
            assert cache.stats()["skipped_tiers"] == cache.skipped_tiers
    errors = [e for e in logs if e["log_level"] == "error" and e.get("tier") == "disk"]
    assert errors and "cannot open" in errors[0]["event"]


async def test_a_tier_that_must_open_names_itself(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "index.sqlite").write_bytes(b"garbage" * 100)
    cache = KVCache(config(tmp_path, on_open_error="fail"), configure_log=False)
    with pytest.raises(TierOpenError, match=r"tier 'disk' \(backend 'nvme'\) cannot open"):
        await cache.start()


def test_the_top_tier_cannot_be_skipped(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["tiers"][0]["on_open_error"] = "skip"
    with pytest.raises(ConfigError, match="top tier cannot be skipped"):
        load_config(cfg, env={})
    cfg["tiers"][0]["on_open_error"] = "fail"
    cfg["tiers"][1]["on_open_error"] = "maybe"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.on_open_error: must be skip or fail"):
        load_config(cfg, env={})


# -- DRAM capacity ---------------------------------------------------------------------------


def test_an_absurd_capacity_is_a_config_error(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["tiers"][0]["capacity"] = "99999999TiB"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity.*too large"):
        load_config(cfg, env={})


async def test_a_dram_tier_larger_than_memory_names_the_tier_and_what_is_available(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path)
    cfg["tiers"][0]["capacity"] = "64TiB"
    with pytest.raises(TierOpenError, match=r"tier 'dram'.*64\.0 TiB.*GiB of memory is available"):
        await KVCache(cfg, configure_log=False).start()


# -- config files that are not text -----------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 4, "[pipeline]\nbatch_pages = 4\n".encode("utf-16")],
    ids=["binary", "utf-16"],
)
def test_a_config_file_that_is_not_utf8_text_is_named(
    tmp_path: Path, content: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kv.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(None, env={"KVTIER_CONFIG": str(path)})
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        KVCache(path)


def test_a_config_path_with_a_nul_byte_is_named() -> None:
    with pytest.raises(ConfigError, match="NUL byte"):
        load_config("kv\x00.toml", env={})


# -- values that are meaningless --------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"op_timeout_s": math.inf}, "op_timeout_s"),
        ({"op_timeout_s": "inf"}, "op_timeout_s"),
        ({"op_timeout_s": math.nan}, "op_timeout_s"),
        ({"connect_timeout_s": 1e30}, "connect_timeout_s"),
        ({"retry_interval_s": math.inf}, "retry_interval_s"),
        ({"ttl_s": math.inf}, "ttl_s"),
        ({"batch_pages": 2**70}, "batch_pages"),
        ({"max_inflight": 10**9}, "max_inflight"),
        ({"io_threads": "abc"}, "io_threads must be an integer"),
        ({"io_threads": 2.5}, "io_threads must be an integer"),
    ],
)
def test_remote_options_out_of_range_are_named(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        RedisStore(page_bytes=PAGE, capacity_pages=4, **options)


@pytest.mark.parametrize("backend", ["dram", "file", "nvme"])
def test_io_threads_of_the_wrong_type_is_named(tmp_path: Path, backend: str) -> None:
    cfg = config(tmp_path)
    cfg["tiers"][1]["backend"] = backend
    cfg["tiers"][1]["options"] = {"io_threads": "abc"} | (
        {} if backend == "dram" else {"path": str(tmp_path / backend)}
    )
    with pytest.raises(
        ConfigError,
        match=r"tiers\[1\]\.options \(disk\).*io_threads must be an "
        r"integer >= 1.*'abc'",
    ) as info:
        asyncio.run(KVCache(cfg, configure_log=False).start())
    assert "not supported" not in str(info.value)


@pytest.mark.parametrize(
    ("section", "values", "needle"),
    [
        ("namespace", {"rank": 2**70}, r"namespace\.rank: must be an integer in \[0, 2147483647\]"),
        ("pipeline", {"batch_pages": 2**70}, r"batch_pages: must be an integer in \[1, "),
        ("pipeline", {"max_inflight_per_link": 10**9}, "max_inflight_per_link: must be"),
    ],
)
def test_config_integers_out_of_range_are_named(
    tmp_path: Path, section: str, values: dict[str, Any], needle: str
) -> None:
    cfg = config(tmp_path)
    cfg[section] = values
    with pytest.raises(ConfigError, match=needle):
        load_config(cfg, env={})


async def test_start_twice_is_refused(tmp_path: Path) -> None:
    cache = KVCache(config(tmp_path), configure_log=False)
    await cache.start()
    try:
        with pytest.raises(KVTierUsageError, match="already open; create a new one"):
            await cache.start()
    finally:
        await cache.close()


@pytest.mark.parametrize("bad", [None, 5, 3.5, object(), b"x" * 16, "abc"])
async def test_key_arguments_of_the_wrong_type_are_named(tmp_path: Path, bad: Any) -> None:
    async with KVCache(config(tmp_path), configure_log=False) as cache:
        out = np.empty((1, PAGE), np.uint8)
        calls = [
            lambda: cache.read(bad, out),
            lambda: cache.load(bad),
            lambda: cache.prefetch(bad, 1.0),
            lambda: cache.delete(bad),
            lambda: cache.store_pages(bad, out),
        ]
        for call in calls:
            with pytest.raises(KVTierUsageError, match="keys"):
                await call()
        with pytest.raises(KVTierUsageError, match="keys"):
            cache.release(bad)


async def test_a_page_swapped_for_a_fifo_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    """A FIFO planted in place of a page file blocked the store's open(): read() never
    returned, and wait_for could not end it (the executor thread sat in the open). Now
    the open does not wait, and the page is a miss."""
    import os

    async with filestore(tmp_path / "fs") as s:
        assert await s.put([key(1), key(2)], [page(1), page(2)]) == [True, True]
        path = s.page_path(key(1))
        path.unlink()
        os.mkfifo(path)
        out = [np.empty(PAGE, np.uint8), np.empty(PAGE, np.uint8)]
        got = await asyncio.wait_for(s.get([key(1), key(2)], out), 10)
        assert got == [False, True]
        assert np.array_equal(out[1], page(2))


def test_a_nul_byte_in_a_tier_path_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    """The check that two tiers do not share a directory resolved the path first and
    raised a bare ``ValueError: embedded null byte`` (the CLI: "unexpected ValueError ...
    a kvtier bug", exit 1) instead of naming the setting."""
    cfg = {
        "model": {"preset": "tiny"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": "8KiB"},
            {"name": "disk", "backend": "file", "capacity": "64KiB",
             "options": {"path": str(tmp_path / "a\x00b")}},
        ],
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.options\.path: .*NUL byte"):
        KVCache(cfg, env={}, configure_log=False)


async def test_a_removed_store_directory_logs_a_line_per_kind_of_error_not_per_page(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With its directory removed, a file store logged one line per page it failed to
    write, commit or read (a docs-only probe: 31,969 lines in 12 s). Now each kind of
    error is logged at most once a minute per store, the next line counting those held
    back; the pages still fail one by one."""
    import logging
    import shutil

    root = tmp_path / "fs"
    async with filestore(root) as s:
        assert await s.put([key(1)], [page(1)]) == [True]
        shutil.rmtree(root)
        with caplog.at_level(logging.WARNING, logger="kvtier.backends.filestore"):
            for i in range(2, 40):
                assert await s.put([key(i)], [page(i)]) == [False]
            out = [np.empty(PAGE, np.uint8)]
            for _ in range(30):
                assert await s.get([key(1)], out) == [False]
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.backends.filestore"]
        kinds = {m.split(" of ")[0].split(" failed")[0][:40] for m in lines}
        assert 1 <= len(lines) <= 4, lines  # one per kind of error (write, vanished, ...)
        assert len(kinds) == len(lines)


async def test_a_store_directory_made_again_takes_pages_again(tmp_path: Path) -> None:
    """A file store whose directory was removed, then made again by an operator, failed
    every write until reopened (its ``.tmp`` was gone), so its tier never recovered. Now
    ``.tmp`` is made again; while the directory is gone, writes still fail."""
    import shutil

    root = tmp_path / "fs"
    async with filestore(root) as s:
        assert await s.put([key(1)], [page(1)]) == [True]
        shutil.rmtree(root)
        assert await s.put([key(2)], [page(2)]) == [False]  # gone: not made again
        assert not root.exists()
        root.mkdir()
        assert await s.put([key(3)], [page(3)]) == [True]
        out = [np.empty(PAGE, np.uint8)]
        assert await s.get([key(3)], out) == [True]
        assert np.array_equal(out[0], page(3))
        assert await s.get([key(1)], out) == [False]  # removed with the directory
