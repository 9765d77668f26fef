"""Storage and configuration fixes: refused store directories keep their modes, the
creatable check tells the truth, NVMe slabs stay within the capacity, tier names every
environment variable can reach, config errors that name their key and source, one size
grammar."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from kvtier.backends.filestore import FileStore
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_index import NotAStoreError, check_store_dir
from kvtier.backends.nvme_preflight import preflight_store
from kvtier.backends.store_files import StorePathError, UnsafeStoreError, check_creatable

from kvtier.config import load_config, parse_size
from kvtier.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- 1. a refused directory keeps its modes ------------------------------------------------


def test_nvme_refusing_a_foreign_directory_leaves_its_mode(tmp_path: Path) -> None:
    d = tmp_path / "t2"
    d.mkdir()
    (d / "junk").write_text("x")
    d.chmod(0o755)
    with pytest.raises(NotAStoreError, match="junk"):
        check_store_dir(d, create=True)
    assert _mode(d) == 0o755


async def test_nvme_open_of_a_foreign_directory_leaves_its_mode(tmp_path: Path) -> None:
    d = tmp_path / "t2"
    d.mkdir()
    (d / "junk").write_text("x")
    d.chmod(0o755)
    store = NvmeStore(page_bytes=512, capacity_pages=8, path=d, engine="posix")
    with pytest.raises(NotAStoreError):
        await store.open()
    assert _mode(d) == 0o755 and sorted(os.listdir(d)) == ["junk"]


async def test_file_store_refusing_a_symlinked_lock_leaves_the_mode(tmp_path: Path) -> None:
    d = tmp_path / "fs"
    d.mkdir()
    d.chmod(0o755)
    (d / ".lock").symlink_to(tmp_path / "elsewhere")
    store = FileStore(page_bytes=512, capacity_pages=8, path=d)
    with pytest.raises(UnsafeStoreError):
        await store.open()
    assert _mode(d) == 0o755


# -- 2. the creatable check makes a directory for real ----------------------------------


@pytest.mark.parametrize("parent", ["/sys", "/proc"])
def test_creatable_check_refuses_a_parent_that_refuses_mkdir(parent: str) -> None:
    if not os.path.isdir(parent):
        pytest.skip(f"no {parent} here")
    with pytest.raises(StorePathError, match=f"{parent} is not writable"):
        check_creatable(Path(parent) / "kvtier-store-x", "NVMe store")
    assert not os.path.exists(Path(parent) / "kvtier-store-x")


# -- 3. NVMe capacity counted in on-disk slots, slabs within it -------------------------


@pytest.mark.parametrize("make", ["file", "devnull"])
def test_nvme_preflight_of_a_file_says_not_a_directory(tmp_path: Path, make: str) -> None:
    path = Path("/dev/null") if make == "devnull" else tmp_path / "afile"
    if make == "file":
        path.write_text("x")
    with pytest.raises(NotAStoreError, match="exists and is not a directory"):
        preflight_store(path, 512)


# -- 5, 6, 8. configuration errors name the key and the source --------------------------


def _two_tiers(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    base = {"backend": "dram", "capacity": "1MiB"}
    return {"model": {"preset": "tiny"}, "tiers": [{**base, **first}, {**base, **second}]}


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        ({"name": "A"}, {"name": "a"}, r"tiers\[1\]\.name: duplicate tier name 'a'.*in more"),
        ({"name": "1"}, {"name": "0"}, r"tiers\[0\]\.name: '1' is only digits"),
        ({"name": "x"}, {"name": "a__b"}, r"tiers\[1\]\.name: 'a__b' holds '__'"),
        ({"name": "x"}, {"name": "b_"}, r"tiers\[1\]\.name: 'b_'"),
        # before: accepted, and link series of 'a'/'b->c' merged with those of 'a->b'/'c'
        ({"name": "x"}, {"name": "y->x"}, r"tiers\[1\]\.name: 'y->x' holds '->'"),
        ({}, {}, r"tiers\[1\]\.name: duplicate tier name 'dram': no name is given.*give each"),
        ({}, {"name": "m", "eviction": "lru", "eviction_params": {"bogus": 1}},
         r"tiers\[1\]\.eviction_params: unknown parameter 'bogus' for eviction policy 'lru'; "
         r"it takes: no parameters \(from python\)"),
        ({}, {"name": "m", "codec_params": {"level": 3}},
         r"tiers\[1\]\.codec_params: parameters given without a codec.*\(from python\)"),
    ],
)  # fmt: skip
def test_bad_tiers_are_named(first: dict[str, Any], second: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(_two_tiers(first, second), env={})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KVTIER_NAMESPACE__RANK": "2147483648"},
         r"^namespace\.rank: .*\(from env:KVTIER_NAMESPACE__RANK\)$"),
        ({"KVTIER_LOG__LEVEL": "verbose"}, r"^log\.level: .*\(from env:KVTIER_LOG__LEVEL\)$"),
        ({"KVTIER_MODEL__PAGE_TOKENS": "100000000"},
         r"^model\.page_tokens: .*65536.*\(from env:KVTIER_MODEL__PAGE_TOKENS\)$"),
        ({"KVTIER_TIERS": "3"}, r"^KVTIER_TIERS: a section is not set as a whole"),
        ({"KVTIER_LOG": "x"}, r"^KVTIER_LOG: a section is not set as a whole.*KVTIER_LOG__<key>"),
    ],
)  # fmt: skip
def test_bad_environment_is_named_with_its_source(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, env=env)


def test_empty_config_path_is_named() -> None:
    with pytest.raises(ConfigError, match="an empty path"):
        load_config("", env={})
    with pytest.raises(ConfigError, match=r"'\.' is a directory.*empty path"):
        load_config(Path(""), env={})


# -- 7. one size grammar: exponents, based integers; no fraction of a byte ---------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1e9", 10**9), ("1e3MiB", 1000 << 20), ("0x10", 16), ("0b101", 5), ("2.5e3", 2500),
     ("1.3GiB", 1395864371), ("0.1KiB", 102), ("1.0000001GiB", 1073741931)],
)  # fmt: skip
def test_size_grammar_accepts(value: Any, expected: int) -> None:
    assert parse_size(value, "k") == expected


@pytest.mark.parametrize("value", ["4194304.7", 4194304.7, "1e-3", "0.5"])
def test_size_that_is_not_whole_bytes_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: .*not a whole number of bytes"):
        parse_size(value, "tiers[0].capacity")
