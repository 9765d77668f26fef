"""``kvtier inspect stats`` shows what-if sizing (issue 15 asks for it there, beside
``stats()`` and Prometheus): the ``kvtier_whatif_*`` gauges of a running cache, per tier
and capacity, with the measured rate. Before, the command read no what-if series."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.cache import KVCache
from kvtier.metrics_scrape import ScrapeError, cache_stats, parse_prometheus


def _played() -> tuple[str, dict[str, object]]:
    async def play() -> tuple[str, dict[str, object]]:
        config = {"model": {"preset": "tiny"},
                  "tiers": [{"name": "dram", "backend": "dram", "capacity": "8KiB"}]}  # fmt: skip
        async with KVCache(config, env={}, configure_log=False, whatif=True) as cache:
            rng = np.random.default_rng(3)
            for _ in range(40):
                tokens = np.repeat(rng.integers(0, 6, 3), 4)
                hit = await cache.lookup(tokens)
                rest = np.zeros((3 - len(hit.keys), cache.spec.page_bytes), np.uint8)
                parent = hit.keys[-1] if hit.keys else None
                if len(rest):
                    args = {"parent": parent} if parent is not None else {}
                    await cache.store(tokens[4 * len(hit.keys) :], rest, **args)
            stats = cache.stats()["whatif"]
            return cache.metrics.to_prometheus(), stats

    return asyncio.run(play())


@pytest.fixture
def endpoint() -> Iterator[tuple[str, dict[str, object]]]:
    text, stats = _played()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", stats
    finally:
        server.shutdown()
        server.server_close()


def test_inspect_stats_shows_what_if_sizing(endpoint: tuple[str, dict[str, object]]) -> None:
    url, stats = endpoint
    result = CliRunner().invoke(get_app(), ["inspect", "stats", "--url", url, "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["whatif"]["dram"]
    want = stats["tiers"]["dram"]  # type: ignore[index]
    assert list(got["estimates"]) == ["-50%", "-25%", "+0%", "+25%", "+50%", "+100%"]
    for label, value in want["hit_rate"].items():
        assert got["estimates"][label] == pytest.approx(value)
    assert got["measured"] == pytest.approx(want["measured_hit_rate"])
    text = CliRunner().invoke(get_app(), ["inspect", "stats", "--url", url]).stdout
    assert "what-if" in text and "+100%" in text


def test_a_cache_without_what_if_has_none_and_a_bad_rate_is_refused() -> None:
    plain = '# TYPE kvtier_used_pages gauge\nkvtier_used_pages{tier="dram"} 3\n'
    assert cache_stats(parse_prometheus(plain), "x")["whatif"] == {}
    bad = plain + 'kvtier_whatif_hit_rate{tier="dram",capacity="+0%"} 1.5\n'
    with pytest.raises(ScrapeError, match=r"kvtier_whatif_hit_rate.*1\.5.*in \[0, 1\]"):
        cache_stats(parse_prometheus(bad), "x")
