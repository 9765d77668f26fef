"""Backend discovery: built-ins through entry points, a plugin distribution installed in
the test, ``module:Class`` paths, unavailable and unknown backends."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.backends.dram import DramArena
from kvtier.backends.filestore import FileStore

import kvtier.testing
from kvtier import registry
from kvtier.backend import Backend
from kvtier.cache import KVCache
from kvtier.config import load_config
from kvtier.errors import (
    BackendUnavailableError,
    ConfigError,
    KVTierUsageError,
    UnknownBackendError,
)
from kvtier.tier_check import create_backend

PLUGIN_SRC = Path(__file__).resolve().parent.parent / "plugins" / "kvtier-example"


def _on_path(directory: Path) -> Iterator[None]:
    """Put ``directory`` first on sys.path for the duration; forget its modules after."""
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(directory))
        for name in [m for m in sys.modules if m.split(".")[0] == "kvtier_example"]:
            del sys.modules[name]
        importlib.invalidate_caches()


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """plugins/kvtier-example built and installed with pip into a private directory."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    shutil.copytree(PLUGIN_SRC, src)  # builds write into the source tree: use a copy
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    yield target


@pytest.fixture
def plugin_installed(plugin_dir: Path) -> Iterator[None]:
    yield from _on_path(plugin_dir)


@pytest.fixture
def broken_plugin(tmp_path: Path) -> Iterator[None]:
    """A hand-written distribution whose entry points name a missing module and a class
    that is not a backend."""
    info = tmp_path / "kvtier_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvtier.backends]\n"
        "broken-missing = kvtier_no_such_module:Store\n"
        "broken-notabackend = os.path:join\n"
    )
    yield from _on_path(tmp_path)


def _by_name() -> dict[str, registry.BackendInfo]:
    return {info.name: info for info in registry.discover()}


def test_builtins_are_found_through_entry_points() -> None:
    infos = _by_name()
    for name, cls, kind in (("dram", DramArena, "arena"), ("file", FileStore, "store")):
        info = infos[name]
        assert info.available and info.reason is None
        assert info.kind == kind
        assert info.origin.startswith("entry point (kvtier ")
        assert registry.resolve(name) is cls


def test_discovery_is_sorted_and_serialisable() -> None:
    infos = registry.discover()
    assert [i.name for i in infos] == sorted(i.name for i in infos)
    assert all(set(i.to_dict()) >= {"name", "kind", "available", "reason"} for i in infos)


def test_unavailable_builtins_are_listed_with_a_reason() -> None:
    """Every registered built-in is listed; one that cannot run here says why (e.g. hbm
    without a GPU, or a module not written yet) and resolving it says so too."""
    infos = _by_name()
    for name in ("dram", "file", "nvme", "redis", "hbm"):
        assert name in infos
    for info in infos.values():
        if not info.available:
            assert info.reason
            with pytest.raises(BackendUnavailableError, match=info.name):
                registry.resolve(info.name)


def test_hbm_without_a_gpu_is_unavailable_with_a_reason() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: hbm may be available here")
    hbm = _by_name()["hbm"]
    assert not hbm.available and hbm.reason
    assert hbm.origin.startswith("entry point (kvtier ")


@pytest.mark.usefixtures("broken_plugin")
def test_a_broken_plugin_does_not_break_discovery() -> None:
    infos = _by_name()
    missing = infos["broken-missing"]
    assert not missing.available and missing.kind is None
    assert "kvtier_no_such_module" in (missing.reason or "")
    assert missing.origin == "entry point (kvtier-broken 1.0)"
    assert not infos["broken-notabackend"].available
    assert infos["dram"].available  # everything else still there
    with pytest.raises(BackendUnavailableError, match="broken-missing"):
        registry.resolve("broken-missing")
    with pytest.raises(UnknownBackendError, match="not a kvtier Backend"):
        registry.resolve("broken-notabackend")


@pytest.mark.usefixtures("plugin_installed")
async def test_plugin_from_a_distribution_is_found_and_conforms() -> None:
    info = _by_name()["example-mem"]
    assert info.available and info.kind == "store"
    assert info.origin == "entry point (kvtier-example 0.1.0)"
    assert info.target == "kvtier_example.memstore:MemoryStore"
    cls = registry.resolve("example-mem")
    assert cls.__module__ == "kvtier_example.memstore"
    backend = registry.create("example-mem", page_bytes=4096, capacity_pages=8)
    assert isinstance(backend, cls)
    report = await kvtier.testing.check_backend(
        lambda: registry.create("example-mem", page_bytes=4096, capacity_pages=8)
    )
    assert "round_trip" in report.passed and "survives_reopen" in report.skipped


@pytest.mark.usefixtures("plugin_installed")
async def test_plugin_options_are_parsed_and_named_from_a_config() -> None:
    """The example store declares ``latency_s`` with kvtier.options: a config (or the
    environment) gives it as a TOML literal or a string, and bad values name the backend
    and the option."""
    tiers = [{"name": "mem", "backend": "example-mem", "capacity": 8 * 512}]
    cfg = {"model": {"preset": "tiny"}, "tiers": tiers}
    env = {"KVTIER_TIERS__MEM__OPTIONS__LATENCY_S": "0.002"}
    async with KVCache(cfg, env=env, configure_log=False) as cache:
        (tier,) = cache.tiers
        assert tier.backend.options.latency_s == 0.002
        tokens = np.arange(8)
        pages = np.ones((2, 512), np.uint8)
        assert all((await cache.store(tokens, pages)).stored)
    for bad, why in [("-1", r"must be in \[0, 10\], got -1"), ('"soon"', "must be a number")]:
        env = {"KVTIER_TIERS__MEM__OPTIONS__LATENCY_S": bad}
        with pytest.raises(ConfigError, match=rf"example-mem option 'latency_s' {why}"):
            await KVCache(cfg, env=env, configure_log=False).start()
    unknown = r"example-mem: unknown option\(s\) path; known: latency_s"
    with pytest.raises(ConfigError, match=unknown):
        registry.create("example-mem", page_bytes=512, capacity_pages=8, path="/tmp")


@pytest.mark.usefixtures("plugin_installed")
async def test_plugin_bench_io_uses_its_profile(tmp_path: Path) -> None:
    """The example plugin ships its ``kvtier bench io`` profile (no options, a memcpy
    baseline); a store benchmarked without a profile gets an error that says so."""
    from kvtier.bench.io import IOBenchParams, bench_io

    params = IOBenchParams(page_bytes=1 << 16, pages=8, repeats=1, workdir=tmp_path)
    (result,) = await bench_io(["example-mem"], params)
    assert result.mismatches == 0 and "memcpy" in result.baseline_method  # not fio
    with pytest.raises(ConfigError, match=r"unknown option.*path.*no bench profile.*"
                       r"kvtier\.bench_io_profiles"):  # fmt: skip
        await bench_io(["kvtier_example.memstore:MemoryStore"], params)


def test_plugin_is_not_there_without_its_distribution() -> None:
    assert "example-mem" not in _by_name()
    with pytest.raises(UnknownBackendError, match="example-mem"):
        registry.resolve("example-mem")


def test_module_class_paths_resolve() -> None:
    assert registry.resolve("kvtier.backends.dram:DramArena") is DramArena
    info = registry.describe("kvtier.backends.filestore:FileStore")
    assert info.origin == "path" and info.available and info.kind == "store"
    assert registry.describe("dram").origin.startswith("entry point")


@pytest.mark.parametrize(
    "path",
    ["kvtier.backends.dram", "kvtier.backends.dram:", ":DramArena", "os:getcwd", "kvtier:errors"],
)
def test_bad_paths_raise_unknown_backend(path: str) -> None:
    with pytest.raises(UnknownBackendError):
        registry.resolve(path)


def test_path_to_a_missing_module_or_class_is_unknown() -> None:
    with pytest.raises(UnknownBackendError, match="kvtier_nope"):
        registry.resolve("kvtier_nope.mod:Store")
    with pytest.raises(UnknownBackendError, match="NoSuchClass"):
        registry.resolve("kvtier.backends.dram:NoSuchClass")
    info = registry.describe("kvtier_nope.mod:Store")
    assert not info.available and "kvtier_nope" in (info.reason or "")


def test_path_whose_dependency_is_missing_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "kvtier_depfail.py").write_text("import kvtier_missing_dependency\n")
    for _ in _on_path(tmp_path):
        with pytest.raises(BackendUnavailableError, match="kvtier_missing_dependency"):
            registry.resolve("kvtier_depfail:Store")
    sys.modules.pop("kvtier_depfail", None)


def test_an_availability_check_that_raises_is_the_plugins_fault(tmp_path: Path) -> None:
    """A plugin whose ``unavailable_reason()`` raises is unavailable, the error naming the
    backend and the method (not reported as a kvtier bug)."""
    (tmp_path / "kvtier_raising_check.py").write_text(
        "from kvtier.backends.dram import DramArena\n\n"
        "class Store(DramArena):\n"
        "    @classmethod\n"
        "    def unavailable_reason(cls):\n"
        "        raise RuntimeError('boom')\n"
    )
    for _ in _on_path(tmp_path):
        with pytest.raises(
            BackendUnavailableError,
            match=r"'kvtier_raising_check:Store'.*unavailable_reason\(\) raised RuntimeError",
        ):
            registry.resolve("kvtier_raising_check:Store")
    sys.modules.pop("kvtier_raising_check", None)


def test_a_plugin_class_that_is_abstract_or_whose_constructor_raises_is_named(
    tmp_path: Path,
) -> None:
    """An abstract class is named with its missing methods (not blamed on the tier's
    options), and a constructor that raises something of its own (a plugin connecting in
    ``__init__``) becomes a BackendUnavailableError naming the class, also through a
    configuration, where the tier is named too."""
    (tmp_path / "kvtier_plugin_faults.py").write_text(
        "from kvtier.backend import StoreBackend\n"
        "from kvtier.backends.dram import DramArena\n\n"
        "class Half(StoreBackend):\n"
        "    async def get(self, keys, out):\n"
        "        return []\n\n"
        "class Connects(DramArena):\n"
        "    def __init__(self, **kw):\n"
        "        raise OSError('cannot reach fancyd at 127.0.0.1:1')\n"
    )
    for _ in _on_path(tmp_path):
        with pytest.raises(UnknownBackendError, match=r"Half' is an abstract class: it does not "
                           r"implement abort, commit, .*write \(a bug of the package"):  # fmt: skip
            registry.resolve("kvtier_plugin_faults:Half")
        info = registry.describe("kvtier_plugin_faults:Half")
        assert not info.available and "abstract class" in (info.reason or "")
        with pytest.raises(
            BackendUnavailableError,
            match=r"kvtier_plugin_faults:Connects could not be created: its constructor "
            r"raised OSError\('cannot reach fancyd",
        ):
            registry.create("kvtier_plugin_faults:Connects", page_bytes=4096, capacity_pages=2)
        raw = {
            "model": {"preset": "tiny"},
            "tiers": [
                {"name": "dram", "backend": "dram", "capacity": "64KiB"},
                {"name": "far", "backend": "kvtier_plugin_faults:Connects", "capacity": "1MiB"},
            ],
        }
        with pytest.raises(BackendUnavailableError, match=r"^tiers\[1\] \(far, backend "):
            create_backend(load_config(raw, env={}).config, 1)
    sys.modules.pop("kvtier_plugin_faults", None)


def test_unknown_name_lists_registered_backends() -> None:
    with pytest.raises(UnknownBackendError, match=r"'nosuch'.*dram.*file"):
        registry.resolve("nosuch")
    assert registry.describe("nosuch").available is False


def test_create_checks_options() -> None:
    backend = registry.create("dram", page_bytes=4096, capacity_pages=2)
    assert isinstance(backend, Backend) and backend.capacity_pages == 2
    with pytest.raises(ConfigError, match="bogus"):
        registry.create("dram", page_bytes=4096, capacity_pages=2, bogus=1)
    with pytest.raises(KVTierUsageError, match="at least one page"):
        registry.create("dram", page_bytes=4096, capacity_pages=0)
    with pytest.raises(ConfigError, match="path"):
        registry.create("file", page_bytes=4096, capacity_pages=2)


@pytest.fixture
def shadowing_plugin(tmp_path: Path) -> Iterator[None]:
    """A distribution that registers the built-in names ``nvme`` and ``dram`` (installed
    on sys.path as a real dist-info, found by discovery like any plugin)."""
    info = tmp_path / "aaa_shadow-1.0.dist-info"  # sorts before "kvtier"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aaa-shadow\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvtier.backends]\n"
        "nvme = kvtier.backends.filestore:FileStore\n"
        "dram = kvtier.backends.filestore:FileStore\n"
        "[kvtier.codecs]\n"
        "zstd = kvtier.codec.lossless:Lz4Codec\n"
    )
    registry._warned.clear()
    yield from _on_path(tmp_path)
    registry._warned.clear()


@pytest.mark.usefixtures("shadowing_plugin")
def test_a_plugin_cannot_silently_shadow_a_builtin(caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.backends.nvme import NvmeStore

    with caplog.at_level("WARNING", logger="kvtier.registry"):
        assert registry.resolve("nvme") is NvmeStore  # the built-in wins
        assert registry.resolve("dram") is DramArena
        infos = _by_name()
    assert infos["nvme"].target == "kvtier.backends.nvme:NvmeStore"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for name in ("nvme", "dram"):
        hits = [w for w in warnings if f"backend name {name!r} is registered more than once" in w]
        assert len(hits) == 1, warnings  # once per name and process
        assert "aaa-shadow" in hits[0] and "kvtier.backends.filestore:FileStore" in hits[0]


@pytest.mark.usefixtures("shadowing_plugin")
def test_a_plugin_cannot_silently_shadow_a_builtin_codec(caplog: pytest.LogCaptureFixture) -> None:
    """A plugin's ``zstd`` codec took the place of kvtier's (entry points were sorted by
    name only, the first kept), with no warning: a tier configured with zstd served the
    plugin's decoding. kvtier's own now wins, as for backends, with one warning."""
    from kvtier.codec import registry as codecs
    from kvtier.codec.lossless import ZstdCodec

    with caplog.at_level("WARNING", logger="kvtier.registry"):
        assert codecs.resolve("zstd") is ZstdCodec
        infos = {i.name: i for i in codecs.discover()}
    assert infos["zstd"].target == "kvtier.codec.lossless:ZstdCodec"
    warnings = [r.getMessage() for r in caplog.records if "codec name 'zstd'" in r.getMessage()]
    assert len(warnings) == 1 and "aaa-shadow" in warnings[0], warnings
