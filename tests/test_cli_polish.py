"""The CLI as a user meets it: --version, --json errors, help, widths, units, and
``kvtier inspect stats`` against a real cache's Prometheus endpoint (issue 12)."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import kvtier.cli.app
import numpy as np
import pytest
from kvtier.cli.app import get_app, source_revision, version
from kvtier.cli.output import fmt, size
from typer.testing import CliRunner

from kvtier.cache import KVCache
from kvtier.metrics_scrape import ScrapeError, cache_stats, parse_prometheus

KVTIER = Path(sys.executable).with_name("kvtier")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in a real process, its output piped (as a user's ``| less``)."""
    return subprocess.run([str(KVTIER), *args], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    """The version number, and from a checkout the commit it runs (the number alone said
    0.1.0 at every revision)."""
    done = run("--version")
    rev = source_revision()
    assert done.returncode == 0 and done.stdout.strip() == (
        f"kvtier {version()}" + (f" ({rev})" if rev else "")
    )
    assert version()[0].isdigit()
    git = ["git", "-C", str(Path(__file__).parent), "rev-parse"]
    top = subprocess.run([*git, "--show-toplevel"], capture_output=True, text=True, check=False)
    installed = Path(kvtier.cli.app.__file__).resolve()
    if top.returncode == 0 and installed.is_relative_to(top.stdout.strip()):  # editable
        head = subprocess.run([*git, "--short=12", "HEAD"], capture_output=True, text=True)
        assert rev is not None and rev.startswith(f"git {head.stdout.strip()}"), rev


@pytest.mark.parametrize("module", ["kvtier", "kvtier.cli.app"])
def test_python_dash_m_runs_every_command(module: str, tmp_path: Path) -> None:
    """``python -m kvtier`` (where the script is not on PATH) has every command. Run as
    ``__main__``, ``kvtier.cli.app`` once had none: its commands registered on the module
    imported under its own name."""
    done = subprocess.run(
        [sys.executable, "-m", module, "inspect", "backends", "--json"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dram" in {b["name"] for b in json.loads(done.stdout)["backends"]}


def test_python_dash_m_kvtier_runs_from_the_checkouts_root() -> None:
    """From the repository's root the source folder ``kvtier/`` shadows the installed
    package; ``kvtier.cli`` and ``kvtier.backends`` (the root's ``cli/`` and
    ``backends/``) are found all the same (it was ``No module named 'kvtier.cli'``)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "inspect", "backends", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dram" in {b["name"] for b in json.loads(done.stdout)["backends"]}


def test_flags_show_as_flags_in_help() -> None:
    result = CliRunner().invoke(get_app(), ["inspect", "config", "--help"])
    assert result.exit_code == 0
    assert "--json" in result.stdout and "<bool>" not in result.stdout
    assert "stats" in CliRunner().invoke(get_app(), ["inspect", "--help"]).stdout


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "sim", "--requests", "abc", "--json"],
        ["inspect", "store", "--json"],  # missing argument
        ["inspect", "config", "--no-such-option", "--json"],
    ],
)
def test_option_errors_print_a_json_error_with_json(args: list[str]) -> None:
    done = run(*args)
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["exit_code"] == 2 and error["message"]
    assert "Traceback" not in done.stderr


def test_errors_are_not_hard_wrapped_when_piped(tmp_path: Path) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / "missing.toml"
    done = run("inspect", "config", "--config", str(deep))
    assert done.returncode == 2
    assert str(deep) in done.stderr  # on one line, whole


def test_tables_keep_their_width_when_piped(tmp_path: Path) -> None:
    long_dir = tmp_path / ("x" * 120)
    cfg = tmp_path / "kv.toml"
    cfg.write_text(
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "512MiB"\n'
        f'[[tiers]]\nname = "file"\nbackend = "file"\ncapacity = "4GiB"\n'
        f'options = {{path = "{long_dir}"}}\n'
    )
    done = run("inspect", "config", "--config", str(cfg))
    assert done.returncode == 0, done.stderr
    assert str(long_dir) in done.stdout  # not cut or folded at 80 columns
    assert "512.0 MiB" in done.stdout and "536870912" not in done.stdout  # human units


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1100.0, "1,100"),
        (0.5, "0.5"),
        (3.14159, "3.14"),
        (9.6e-04, "0.00096"),
        (-1.234e-6, "-0.00000123"),
        (123456, "123,456"),
        (12, "12"),
        (None, "-"),
        (True, "yes"),
    ],
)
def test_cells_are_human(value: object, text: str) -> None:
    assert fmt(value) == text
    assert "e+" not in fmt(1.1e3) and "e-" not in fmt(2e-9)


def test_sizes_are_binary_units() -> None:
    assert size(536870912) == "512.0 MiB" and size(512) == "512 B"


# -- inspect stats ----------------------------------------------------------------------------


@pytest.fixture
def metrics_endpoint(tmp_path: Path) -> Iterator[tuple[str, dict[str, object]]]:
    """A real cache run, its metrics served on 127.0.0.1 by a small HTTP server."""

    async def play() -> tuple[str, dict[str, object]]:
        config = {
            "model": {"preset": "tiny"},
            "tiers": [
                {"name": "dram", "backend": "dram", "capacity": "8KiB"},
                {
                    "name": "file",
                    "backend": "file",
                    "capacity": "1MiB",
                    "options": {"path": str(tmp_path / "f")},
                },
            ],
        }
        async with KVCache(config, configure_log=False) as cache:
            tokens = np.arange(4 * 40)
            pages = np.zeros((40, cache.spec.page_bytes), np.uint8)
            await cache.store(tokens, pages)
            await cache.flush()
            hit = await cache.lookup(tokens)
            await cache.load(hit.keys[:4])
            cache.release(hit.keys[:4])
            return cache.metrics.to_prometheus(), cache.metrics.snapshot()

    text, snap = asyncio.run(play())

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode() if self.path == "/metrics" else b"hello"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", snap
    finally:
        server.shutdown()
        server.server_close()


def test_inspect_stats_reads_a_running_caches_endpoint(
    metrics_endpoint: tuple[str, dict[str, object]],
) -> None:
    base, snap = metrics_endpoint
    args = ["inspect", "stats", "--url", f"{base}/metrics", "--json"]
    result = CliRunner().invoke(get_app(), args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    tiers = snap["tiers"]
    assert isinstance(tiers, dict)
    for name, t in tiers.items():
        got = data["tiers"][name]
        assert got["used_pages"] == t["used_pages"] and got["hits"] == t["hits"]
        assert got["capacity_pages"] == t["capacity_pages"]
    assert data["tiers"]["dram"]["occupancy"] == pytest.approx(
        tiers["dram"]["used_pages"] / tiers["dram"]["capacity_pages"]
    )
    assert "dram->file" in data["links"] and data["links"]["dram->file"]["gb_per_s"] > 0
    # counts and byte sizes are JSON integers (docs/cli.md); before: "used_pages": 85.0
    for t in data["tiers"].values():
        counts = {k: v for k, v in t.items() if k not in ("occupancy", "hit_rate")}
        assert all(type(v) is int for v in counts.values()), t
    for link in data["links"].values():
        assert [type(link[k]) for k in ("pages", "bytes", "failed_pages")] == [int, int, int]
    assert type(data["fetch_latency_s"]["count"]) is int
    assert all(type(v) is int for v in data["queues"].values())
    table = CliRunner().invoke(get_app(), ["inspect", "stats", "--url", f"{base}/metrics"])
    assert table.exit_code == 0 and "hit rate" in table.stdout and "dram->file" in table.stdout


@pytest.mark.parametrize(
    ("url", "code", "needle"),
    [
        ("/metrics", 1, "no kvtier metrics"),
        ("ftp://x/metrics", 2, "must be an http(s) URL"),
        ("http://127.0.0.1:1/metrics", 1, "cannot read metrics"),
    ],
)
def test_inspect_stats_errors_are_named(
    metrics_endpoint: tuple[str, dict[str, object]], url: str, code: int, needle: str
) -> None:
    base, _ = metrics_endpoint
    full = base + "/other" if url == "/metrics" else url
    result = CliRunner().invoke(get_app(), ["inspect", "stats", "--url", full, "--json"])
    assert result.exit_code == code
    assert needle in json.loads(result.stdout)["error"]["message"]


def test_vllm_metrics_endpoint_is_named_with_where_the_cache_metrics_are() -> None:
    """A vLLM user points --url at vLLM's own /metrics, which holds the connector's
    vllm:kvtier_* counters but not the cache's: the error says where to look."""
    text = (
        "# TYPE vllm:kvtier_hit_tokens_total counter\n"
        'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="dram"} 128.0\n'
    )
    with pytest.raises(ScrapeError, match="kvtier_metrics_port"):
        cache_stats(parse_prometheus(text), "http://127.0.0.1:8000/metrics")


@pytest.mark.parametrize(
    ("written", "value"),
    [
        ('dr\\\\nam \\"x\\"', 'dr\\nam "x"'),
        ("a\\nb", "a\nb"),
        ("ends\\\\", "ends\\"),
        ("\\\\\\\\n", "\\\\n"),
        ("plain", "plain"),
    ],
)
def test_scraped_label_values_read_back_as_written(written: str, value: str) -> None:
    """Escaped label values (``\\\\``, ``\\"``, ``\\n``) read back in one left-to-right
    pass: a backslash before an ``n`` stays a backslash and an ``n``."""
    text = f'kvtier_pages{{tier="{written}"}} 3\n'
    assert parse_prometheus(text)["kvtier_pages"] == [({"tier": value}, 3.0)]


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ('kvtier_used_pages{tier="dram"} 11.5', True),
        ('kvtier_hits_total{tier="dram"} 3.25', True),
        ('kvtier_link_seconds_total{link="dram->nvme"} 0.125', False),
    ],
)
def test_a_fractional_count_is_refused_seconds_are_not(line: str, refused: bool) -> None:
    """``--json`` promises integer counts; a page count of 11.5 (which kvtier never
    exports) was passed through, and occupancy computed from it."""
    base = {
        "kvtier_used_pages": 'kvtier_used_pages{tier="dram"} 11',
        "kvtier_capacity_pages": 'kvtier_capacity_pages{tier="dram"} 16',
        "kvtier_hits_total": 'kvtier_hits_total{tier="dram"} 3',
    }
    base[line.split("{")[0]] = line
    series = parse_prometheus("\n".join(base.values()) + "\n")
    if refused:
        with pytest.raises(ScrapeError, match=r"has value \d+\.\d+.*as a whole number"):
            cache_stats(series, "http://127.0.0.1:1/metrics")
    else:
        assert cache_stats(series, "http://127.0.0.1:1/metrics")["tiers"]
