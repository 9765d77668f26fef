"""The example server (examples/server) as a real process on 127.0.0.1: two multi-turn
conversations hit the cache from the second turn on and answer exactly what uncached
generation answers; /metrics speaks Prometheus; bad input is a 400; SIGTERM stops it
cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("aiohttp", reason="aiohttp is not installed")

ROOT = Path(__file__).resolve().parent.parent
SERVER_DIR = ROOT / "examples" / "server"
#: The header and first 60 rows of the Azure conversation trace (see tests/data/README.md).
TRACE = ROOT / "tests" / "data" / "azure_llm_2023_conv_head60.csv"
sys.path.insert(0, str(SERVER_DIR))
import load_client  # noqa: E402


class Server:
    """The server subprocess and the URL it printed."""

    def __init__(self, store: Path, dram: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(SERVER_DIR / "server.py"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--model",
                "tiny",
                "--store",
                str(store),
                "--dram",
                dram,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    found.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(90):
            self.proc.kill()
            raise AssertionError("server did not start:\n" + "".join(self.lines))

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def post(self, path: str, body: object) -> tuple[int, dict[str, object]]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.reader.join(5)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    # 16 pages of 16 tokens of DRAM: conversations outgrow it, pages go to NVMe and back
    s = Server(tmp_path / "store", dram=str(16 * 12288))
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_conversations_hit_the_cache_and_match_uncached(server: Server) -> None:
    plans = load_client.plan(
        conversations=2,
        turns=3,
        trace=None,
        time_scale=0.0,
        token_scale=1,
        max_user=48,
        max_answer=16,
        seed=5,
    )
    results = asyncio.run(load_client.play(server.url, plans, vocab=256, verify=True, seed=5))
    summary = load_client.summarize(results)
    assert summary["turns"] == 6
    assert summary["verified"] is True, summary  # every answer equals uncached generation
    later = [r for r in results if r.turn > 0]
    assert later and all(r.cached_tokens > 0 for r in later), summary["per_turn"]
    for r in later:
        # the previous turn's prompt and (all but the last) answer tokens were cached
        assert r.computed_tokens < r.prompt_tokens
        assert r.cached_tokens + r.computed_tokens == r.prompt_tokens + len(r.answer) - 1

    status, text = server.get("/metrics")
    assert status == 200
    assert "# TYPE kvtier_hits_total counter" in text
    assert metric(text, "kvtier_server_reused_tokens_total") == summary["cached_tokens"]
    assert metric(text, 'kvtier_server_requests_total{cache="kvtier"}') == 6
    assert metric(text, "kvtier_stored_pages_total") > 0
    assert metric(text, "kvtier_evicted_pages_total") > 0  # the small DRAM tier spilled

    status, body = server.post("/generate", {"tokens": [1, 2, 999], "max_new_tokens": 2})
    assert status == 400 and "tokens[2]" in str(body["error"])
    status, body = server.post("/generate", {"tokens": [1, 2], "max_new_tokens": 0})
    assert status == 400 and "max_new_tokens" in str(body["error"])
    status, body = server.post("/generate", {"tokens": [1], "temperature": 1})
    assert status == 400 and "temperature" in str(body["error"])
    # the prefix prefetch looks pages up in the namespace the bridge's caches store in
    assert metric(text, "kvtier_prefetch_pages_total") > 0
    # a reused prefix of more pages than the 16-page DRAM tier holds pinned (the first
    # time, the prompt is computed and stored; the second, its pages must be loaded): a
    # 400 naming the field, not a 500
    long_prompt = {"tokens": [(i * 7) % 256 for i in range(300)], "max_new_tokens": 1}
    assert server.post("/generate", long_prompt)[0] == 200
    status, body = server.post("/generate", long_prompt)
    assert status == 400 and "'tokens': too long for this server" in str(body["error"])
    status, body = server.post("/generate", {"tokens": [1, 2, 3], "max_new_tokens": 1})
    assert status == 200  # and it still serves

    assert server.stop() == 0
    out = "".join(server.lines)
    assert "kvtier cache closed" in out and "stopped" in out


def test_plan_follows_the_azure_trace() -> None:
    rows = load_client.read_trace(TRACE, 6)
    plans = load_client.plan(2, 3, TRACE, 0.5, 16, 48, 16, 0)
    for c in range(2):
        for t in range(3):
            at, ctx, gen = rows[c + t * 2]
            tp = plans[c][t]
            assert tp.at_s == pytest.approx(at * 0.5)
            assert tp.user_tokens == max(4, min(48, ctx // 16))
            assert tp.answer_tokens == max(2, min(16, gen // 16))
    times = [tp.at_s for conv in plans for tp in conv]
    assert min(times) == 0.0 and max(times) > 0.0


def test_plan_rejects_bad_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="expected columns"):
        load_client.read_trace(bad, 1)


def test_a_damaged_cached_prefix_is_recomputed_not_a_500(tmp_path: Path) -> None:
    """Every page of the NVMe store damaged between two runs: the reused prefix fails its
    checksums on the way up (PrefixLostError), and the server answers by recomputing it
    (``"recomputed": true``), with the uncached answer. Before: a bare 500, though the
    same request succeeded when sent again."""
    store = tmp_path / "store"
    prompt = {"tokens": [(i * 11) % 256 for i in range(70)], "max_new_tokens": 4}
    first = Server(store, dram=str(64 * 12288))
    try:
        status, body = first.post("/generate", prompt)
        assert status == 200
        assert first.stop() == 0  # closing writes the DRAM pages down to NVMe
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    slabs = sorted((store / "slabs").glob("slab-*.dat"))
    assert slabs
    for slab in slabs:
        with open(slab, "r+b") as f:
            data = bytearray(f.read(1 << 20))
            for off in range(200, len(data), 4096):
                data[off] ^= 0xFF
            f.seek(0)
            f.write(data)
    again = Server(store, dram=str(64 * 12288))
    try:
        status, hit = again.post("/generate", prompt)
        assert status == 200, hit
        assert hit["recomputed"] is True and hit["cached_tokens"] == 0
        assert hit["tokens"] == body["tokens"]
        status, plain = again.post("/generate", {**prompt, "use_cache": False})
        assert status == 200 and plain["tokens"] == body["tokens"]
        assert again.stop() == 0
    finally:
        if again.proc.poll() is None:
            again.proc.kill()
