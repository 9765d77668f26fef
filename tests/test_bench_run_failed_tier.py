"""``kvtier bench run`` with a tier that is unreachable for the whole run.

docs/cli.md (Conventions, ``--json``): a failure found in a finished report (``bench run``
with failed tiers) prints the report and exits 1. Before, such a run printed only
``{"error": ...}`` (no report), and its message said "(0 pages failed)" while the close
logged ``flush could not write every dirty page down ... failed=269``: it counted failed
page operations, and a store that refuses every reservation fails none. Now the report
comes out with the failure in ``failed_tiers``, the message counts the pages that could
not be written down to the tier (and the store's failed batches), and the exit code is 1.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

RUN = ["--sessions", "2", "--turns", "2", "--dram-capacity", "256KiB"]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A DRAM tier over a Redis tier on a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "down.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "64KiB"\n'
        '[[tiers]]\nname = "remote"\nbackend = "redis"\ncapacity = "1MiB"\n'
        f'options = {{url = "redis://127.0.0.1:{port}/0", op_timeout_s = 0.2, '
        "connect_timeout_s = 0.2}\n"
    )
    return cfg


def test_json_prints_the_report_with_the_failed_tier_and_exits_1(config: Path) -> None:
    result = CliRunner().invoke(get_app(), ["bench", "run", "-c", str(config), *RUN, "--json"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    data = json.loads(result.stdout)  # one object: the finished report
    assert "error" not in data
    assert data["turns"] == 4 and data["mismatches"] == 0 and data["pages_stored"] > 0
    [failed] = data["failed_tiers"]
    assert failed["tier"] == "remote"
    assert "Connect" in failed["reason"]
    # Nothing reached the server: every page the run left in DRAM was one to write down.
    dram = data["metrics"]["tiers"]["dram"]["used_pages"]
    assert dram > 0 and failed["unwritten_pages"] == dram
    assert failed["failed_batches"] > 0
    message = failed["error"]
    assert message.startswith("tier 'remote' was unreachable for the whole run")
    assert f"({dram} pages could not be written down to it, " in message
    assert "0 pages failed" not in message
    assert f"error: {message}" in " ".join(result.stderr.split())


def test_text_output_shows_the_report_and_the_failure_and_exits_1(config: Path) -> None:
    result = CliRunner().invoke(get_app(), ["bench", "run", "-c", str(config), *RUN])
    assert result.exit_code == 1, result.output
    out = " ".join(result.stdout.split())
    assert "prompt pages found, by tier" in out and "mismatches 0" in out
    assert "failed: tier 'remote' was unreachable for the whole run" in out
    assert "error: tier 'remote' was unreachable for the whole run" in result.stderr


def test_a_tier_that_stored_pages_or_never_failed_is_not_reported() -> None:
    from kvtier.bench.live import failed_tiers

    health = {
        "dram": {"healthy": True},
        "remote": {"healthy": False, "down": True, "down_reason": "timed out",
                   "failed_batches": 3, "unwritten_pages": 0},
    }  # fmt: skip
    tiers = ["dram", "remote"]
    stored = {"tiers": {"remote": {"stored_pages": 5, "failed_pages": 2}}}
    assert failed_tiers(stored, tiers, health) == []
    assert failed_tiers({"tiers": {"remote": {}}}, tiers, {"remote": {"healthy": True}}) == []
    [entry] = failed_tiers({"tiers": {"remote": {"failed_pages": 2}}}, tiers, health)
    assert entry["error"] == (
        "tier 'remote' was unreachable for the whole run: no page was stored there "
        "(2 page operations failed, 3 batches failed): timed out"
    )
