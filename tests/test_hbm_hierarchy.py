"""The whole hierarchy under an HBM top tier: ``kvtier bench run`` plays the chat workload
through hbm -> dram -> file and checks the bytes of every page it loads.

On a GPU machine this runs on CuPy and the GPU. Elsewhere it runs on the CuPy stand-in
(tests/cupy_standin.py), which proves nothing about CuPy but does check kvtier's own
pipeline over a top tier whose slots have no host view: promotion into it, eviction out
of it, and reading its pages back through copies rather than views.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cupy_standin import install_standin
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.cuda_streams import cupy_unavailable_reason

GPU_REASON = cupy_unavailable_reason()


@pytest.fixture
def cupy_or_standin(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """CuPy where a GPU is usable, else the stand-in (installed on first call)."""

    def install() -> Any:
        if GPU_REASON is None:
            import cupy

            return cupy
        return install_standin(monkeypatch)

    return install


def _config(tmp_path: Path, dram: bool = True) -> Path:
    # 'tiny' pages are 4 KiB: the HBM tier holds 64 of them and the DRAM tier 128, so a
    # run of 8 sessions x 4 turns spills down to the file tier and is fetched back up.
    cfg = tmp_path / "hbm.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n'
        '[[tiers]]\nname = "hbm"\nbackend = "hbm"\ncapacity = "256KiB"\n'
        "options = { copy_streams = 2 }\n"
        + ('[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "512KiB"\n' if dram else "")
        + '[[tiers]]\nname = "disk"\nbackend = "file"\ncapacity = "64MiB"\n'
        f'options = {{ path = "{tmp_path / "disk"}" }}\n'
    )
    return cfg


def _bench_run(cfg: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(get_app(), ["bench", "run", "--config", str(cfg), "--json", *args])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize(
    ("dram", "links"),
    [
        (True, {"hbm->dram", "dram->disk", "dram->hbm", "disk->hbm"}),
        # HBM right above a disk tier: pages go down through host staging buffers (this
        # raised before: the arena -> store link took the HBM slots' numpy views)
        (False, {"hbm->disk", "disk->hbm"}),
    ],
    ids=["hbm-dram-disk", "hbm-disk"],
)
def test_every_page_loaded_through_an_hbm_top_tier_has_its_bytes(
    tmp_path: Path, cupy_or_standin: Callable[[], Any], dram: bool, links: set[str]
) -> None:
    cupy_or_standin()
    code, data = _bench_run(_config(tmp_path, dram))
    assert code == 0, data
    assert data["mismatches"] == 0
    assert data["checked_pages"] == data["pages_loaded"] > 0
    # every tier served hits, and pages went down and came back up
    assert set(data["hits_by_tier"]) == ({"hbm", "dram", "disk"} if dram else {"hbm", "disk"})
    assert min(data["hits_by_tier"].values()) > 0
    assert links <= set(data["links"])


def test_block_tables_run_over_an_hbm_top_tier(
    tmp_path: Path, cupy_or_standin: Callable[[], Any]
) -> None:
    """The sequences API (working pages in the top tier, forks, speculative steps rolled
    back, stored pages faulted back in) over HBM: pages are published to the cache through
    one device-to-host copy (this raised before: publishing took the slots' numpy views)."""
    cupy_or_standin()
    code, data = _bench_run(_config(tmp_path), "--workload", "speculative", "--sessions", "4")
    assert code == 0, data
    assert data["mismatches"] == 0 and data["unverified_pages_stored"] == 0
    assert data["checked_pages"] > 0 and data["pages_loaded"] > 0


@pytest.mark.skipif(GPU_REASON is None, reason="corrupts the stand-in's copies, not a GPU's")
def test_a_wrong_byte_out_of_the_hbm_tier_is_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: a device-to-host copy that flips one byte is caught."""
    import cupy_standin

    install_standin(monkeypatch)
    copy = cupy_standin._StandInMemPtr.copy_to_host_async

    def flipping_copy(self: Any, ptr: Any, n: int, stream: Any) -> None:
        copy(self, ptr, n, stream)
        dst = self._host(ptr, n)
        stream.enqueue(lambda: np.bitwise_xor(dst[:1], 1, out=dst[:1]))

    monkeypatch.setattr(cupy_standin._StandInMemPtr, "copy_to_host_async", flipping_copy)
    code, data = _bench_run(_config(tmp_path))
    assert code == 1
    assert data["mismatches"] > 0


def test_bench_io_measures_the_hbm_tier_against_cuda_memcpy(
    tmp_path: Path, cupy_or_standin: Callable[[], Any]
) -> None:
    """``kvtier bench io --tier hbm`` checks every page it reads back and pairs kvtier's
    copies with raw per-page copies into the same device slots."""
    cupy_or_standin()
    args = ["bench", "io", "--tier", "hbm", "--page-size", "64KiB", "--pages", "16"]
    args += ["--repeats", "2", "--dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(get_app(), args)
    assert result.exit_code == 0, result.stderr
    (row,) = json.loads(result.stdout)["tiers"]
    assert row["tier"] == "hbm" and row["mismatches"] == 0
    assert row["verified_pages"] == 16 * 3  # the warm-up pass is checked too
    assert row["baseline_method"] == "cudaMemcpyAsync per page, one stream"
    assert row["read_ratio"] > 0 and row["write_ratio"] > 0
