"""``kvtier inspect stats`` against endpoints serving values kvtier never exports: each is
refused by series and value (exit 1, as for any bad endpoint), never a traceback, a
``kvtier bug`` message, or a report showing a figure the cache never had."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.metrics_scrape import ScrapeError, cache_stats, parse_prometheus

GOOD = (
    'kvtier_used_pages{tier="dram"} 3\n'
    'kvtier_capacity_pages{tier="dram"} 8\n'
    'kvtier_hits_total{tier="dram"} 5\n'
    'kvtier_misses_total{tier="dram"} 2\n'
    'kvtier_link_bytes_total{link="dram->file"} 4096\n'
    'kvtier_link_seconds_total{link="dram->file"} 0.5\n'
)


@pytest.fixture
def serve() -> Iterator[Callable[[str], str]]:
    """``serve(text)``: the URL of an endpoint on 127.0.0.1 answering ``text``."""
    body = {"text": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body["text"].encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def url(text: str) -> str:
        body["text"] = text
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # before: OverflowError reported as a kvtier bug (table), "bytes": null (JSON)
        (
            'kvtier_link_bytes_total{link="a->b"} +Inf\n',
            'kvtier_link_bytes_total{link="a->b"} has value inf',
        ),
        (
            'kvtier_link_bytes_total{link="a->b"} 1e400\n',
            'kvtier_link_bytes_total{link="a->b"} has value inf',
        ),
        # before: misses -3, hit rate 175 %
        (
            'kvtier_hits_total{tier="dram"} 5\nkvtier_misses_total{tier="dram"} -3\n',
            'kvtier_misses_total{tier="dram"} has value -3',
        ),
        # before: the last of the two kept silently
        (
            'kvtier_hits_total{tier="dram"} 5\nkvtier_hits_total{tier="dram"} 7\n',
            'kvtier_hits_total{tier="dram"} is given twice',
        ),
        # before: an unparsable value read as 0
        (
            'kvtier_hits_total{tier="dram"} 5\nkvtier_misses_total{tier="dram"} abc\n',
            "kvtier_misses_total{tier=\"dram\"} has value 'abc'",
        ),
        # before: null in JSON, nan / nan% in the table
        (
            'kvtier_misses_total{tier="dram"} NaN\n',
            'kvtier_misses_total{tier="dram"} has value nan',
        ),
        # before: a 300-digit number
        ("kvtier_used_pages 1e300\n", "kvtier_used_pages has value 1e+300"),
        # before: read as 1000 (Python's float() takes it; the text format does not)
        ('kvtier_used_pages{tier="a"} 1_000\n', "has value '1_000'"),
        # before: the series with a label kvtier never adds overwrote the real one
        (
            'kvtier_used_pages{tier="a"} 1\nkvtier_used_pages{tier="a",x="y"} 3\n',
            "kvtier_used_pages has two series for tier='a'",
        ),
    ],
)
@pytest.mark.parametrize("as_json", [True, False])
def test_inspect_stats_refuses_values_kvtier_never_exports(
    serve: Callable[[str], str], text: str, needle: str, as_json: bool
) -> None:
    url = serve(text)
    args = ["inspect", "stats", "--url", url, *(["--json"] if as_json else [])]
    result = CliRunner().invoke(get_app(), args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "kvtier bug" not in result.output
    message = " ".join(result.stderr.split())
    assert needle in message and url in message
    if as_json:
        error = json.loads(result.stdout)["error"]
        assert error["type"] == "ScrapeError" and needle in error["message"]
    else:
        assert result.stdout == ""  # no half-printed table before the error


def test_kvtiers_rules_hold_for_kvtiers_series_only() -> None:
    """A duplicate is found whatever the order of its labels. Another exporter's NaN
    gauge, unparsable line or repeated series on the same endpoint is not kvtier's to
    refuse, and a kvtier gauge ``inspect stats`` does not read (an observer's) is not
    checked."""
    with pytest.raises(ScrapeError, match="given twice"):
        parse_prometheus('kvtier_x{a="1",b="2"} 1\nkvtier_x{b="2",a="1"} 1\n')
    text = GOOD + "other_ratio NaN\nother_thing abc\nother_x 1\nother_x 2\nkvtier_skew -4\n"
    stats = cache_stats(parse_prometheus(text), "src")
    assert stats["tiers"]["dram"]["hits"] == 5


def test_a_server_that_trickles_its_answer_is_given_up_on_at_the_timeout() -> None:
    """``--timeout`` bounded each socket read, not the request: a server sending one byte
    every 0.2 s held ``inspect stats --timeout 2`` for as long as it liked."""
    import socket
    import time

    from kvtier.metrics_scrape import scrape

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            while not stop.is_set():
                try:
                    conn.sendall(b"#")
                except OSError:
                    return
                time.sleep(0.2)

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    started = time.monotonic()
    try:
        with pytest.raises(ScrapeError, match=r"no whole answer within --timeout 1 s"):
            scrape(f"http://127.0.0.1:{listener.getsockname()[1]}/metrics", timeout_s=1)
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        server.join(5)
        listener.close()
