"""The backend conformance kit against the NVMe store, for each engine that can run here."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_engines import kvikio_unavailable_reason

from kvtier.testing.conformance import Case, conformance_cases

_KVIKIO = kvikio_unavailable_reason()


@pytest.mark.parametrize(
    "engine",
    [
        "posix",
        pytest.param(
            "kvikio",
            marks=pytest.mark.skipif(_KVIKIO is not None, reason=f"kvikio engine: {_KVIKIO}"),
        ),
    ],
)
@pytest.mark.parametrize("direct_io", ["auto", False])
@pytest.mark.parametrize("case", conformance_cases(), ids=str)
async def test_conformance(case: Case, engine: str, direct_io: object, tmp_path: Path) -> None:
    def factory() -> NvmeStore:
        # 5000 bytes: not a multiple of 4 KiB, so the body/tail split is covered.
        return NvmeStore(
            page_bytes=5000,
            capacity_pages=16,
            path=tmp_path / "store",
            engine=engine,
            direct_io=direct_io,  # type: ignore[arg-type]
            slab_bytes=4 * 12288,
        )

    result = await case.run(factory, persistent=True)
    if result.skipped:
        pytest.skip(result.detail)
