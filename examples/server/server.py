"""An asyncio HTTP generation server (aiohttp) that embeds kvtier.

    python examples/server/server.py --model tiny --port 8080 --store .kvtier-server

One :class:`~kvtier.cache.KVCache` per process, opened at start-up and closed at shutdown
(SIGINT/SIGTERM): dirty pages are written down, the NVMe tier keeps them for the next
run. The model runs on one executor thread (never on the event loop); kvtier's metadata
stays on the loop, which the model thread reaches through a
:class:`~kvtier.integrations.transformers.KVTierBridge`.

Endpoints:

* ``POST /generate`` ``{"tokens": [ids], "max_new_tokens": n, "use_cache": true}`` ->
  ``{"tokens": [new ids], "prompt_tokens", "cached_tokens", "computed_tokens",
  "queue_seconds", "seconds"}``. With ``use_cache`` (default) the longest cached prefix
  of the prompt is loaded from kvtier (from any tier: its upward move starts as soon as
  the request arrives, while it waits for the model) and only the rest is prefilled;
  ``false`` computes everything with transformers' ``DynamicCache`` (the reference).
  Bad input answers 400 with ``{"error": ...}`` naming the problem.
* ``GET /metrics``: kvtier's metrics and the server's, Prometheus text format 0.0.4.
* ``GET /healthz``: ``{"ok": true, "model": ..., "tiers": [...]}``.

Prints one line ``listening on http://HOST:PORT`` once it accepts connections (``--port
0`` picks a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import build_model, kvtier_config

from kvtier.cache import KVCache
from kvtier.config import parse_size
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.integrations.transformers import KVTierBridge, PrefixLostError
from kvtier.metrics import Metrics

MAX_NEW_TOKENS = 512
PREFETCH_DEADLINE_S = 5.0

STATE = web.AppKey("state", dict)


class BadRequest(KVTierUsageError):
    """A request the server refuses (answered 400)."""


def parse_request(body: Any, vocab: int, max_positions: int) -> tuple[list[int], int, bool]:
    """Validate a /generate body; raises :class:`BadRequest` naming the problem."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(body) - {"tokens", "max_new_tokens", "use_cache"}
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest("'tokens' must be a non-empty list of token ids")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise BadRequest(f"tokens[{i}] = {t!r} is not a token id in [0, {vocab})")
    new = body.get("max_new_tokens", 16)
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= MAX_NEW_TOKENS:
        raise BadRequest(f"'max_new_tokens' must be an int in [1, {MAX_NEW_TOKENS}], got {new!r}")
    if len(tokens) + new > max_positions:
        raise BadRequest(
            f"prompt ({len(tokens)}) + max_new_tokens ({new}) exceeds the model's "
            f"{max_positions} positions"
        )
    use_cache = body.get("use_cache", True)
    if not isinstance(use_cache, bool):
        raise BadRequest(f"'use_cache' must be true or false, got {use_cache!r}")
    return tokens, new, use_cache


class Generator:
    """The model and how it generates (runs on the model thread only)."""

    def __init__(self, model: Any, bridge: KVTierBridge) -> None:
        self.model = model
        self.bridge = bridge

    @torch.inference_mode()
    def generate(self, tokens: list[int], new: int, use_cache: bool) -> dict[str, Any]:
        """Greedy tokens after ``tokens``. A cached prefix lost on the way (a failing
        tier, a page that fails its checksum: ``PrefixLostError``) is recomputed once
        without reuse; a prompt whose pages the top tier cannot hold pinned raises
        ``CapacityError`` (the handler answers 400)."""
        ids = torch.tensor([tokens], dtype=torch.long)
        recomputed = False
        if use_cache:
            try:
                out, cached, computed = self._with_kvtier(ids, new, reuse=True)
            except PrefixLostError:
                recomputed = True  # the lost pages are dropped: compute them again
                out, cached, computed = self._with_kvtier(ids, new, reuse=False)
        else:
            cached = 0
            dyn = DynamicCache(config=self.model.config)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=dyn,
                                      max_new_tokens=new, do_sample=False)  # fmt: skip
            computed = len(tokens) + new - 1
        return {
            "tokens": out[0, len(tokens) :].tolist(),
            "prompt_tokens": len(tokens),
            "cached_tokens": cached,
            "computed_tokens": computed,
            "recomputed": recomputed,
        }

    def _with_kvtier(self, ids: torch.Tensor, new: int, reuse: bool) -> tuple[Any, int, int]:
        with self.bridge.new_cache(self.model.config) as cache:
            cached = cache.load_prefix(ids) if reuse else 0
            # every token counts (a raw token list may hold the pad id): all ones
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                      max_new_tokens=new, do_sample=False)  # fmt: skip
            return out, cached, cache.stats.computed_tokens


class ServerMetrics(Metrics):
    """The server's own series (exposed next to kvtier's on /metrics)."""

    def __init__(self) -> None:
        super().__init__(prefix="kvtier_server")
        self.requests = self.counter("requests_total", "Generation requests served", ["cache"])
        self.bad_requests = self.counter("bad_requests_total", "Requests refused with 400")
        self.prompt_tokens = self.counter(
            "prompt_tokens_total", "Prompt tokens received", ["cache"]
        )
        self.reused_tokens = self.counter(
            "reused_tokens_total", "Prompt tokens whose KV came from kvtier"
        )
        self.computed_tokens = self.counter(
            "computed_tokens_total", "Tokens the model computed KV for", ["cache"]
        )
        self.seconds = self.histogram(
            "request_seconds", "Wall time of a generation request", ["cache"]
        )
        self.queue_seconds = self.histogram(
            "queue_seconds", "Time a request waited for the model thread", ["cache"]
        )


async def handle_generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    metrics: ServerMetrics = state["metrics"]
    model = state["generator"].model
    try:
        body = await request.json()
    except ValueError:
        body = None
    try:
        tokens, new, use_cache = parse_request(
            body, model.config.vocab_size, model.config.max_position_embeddings
        )
    except BadRequest as exc:
        metrics.bad_requests.inc()
        return web.json_response({"error": str(exc)}, status=400)
    cache: KVCache = state["cache"]
    arrived = time.perf_counter()
    if use_cache:
        # start moving the cached prefix up now, while the request waits for the model
        hit = await cache.lookup(tokens[:-1], namespace=state["namespace"])
        if hit.keys:
            state["tasks"].add(asyncio.create_task(cache.prefetch(hit.keys, PREFETCH_DEADLINE_S)))
            state["tasks"] = {t for t in state["tasks"] if not t.done()}
    loop = asyncio.get_running_loop()
    async with state["lock"]:
        started = time.perf_counter()
        try:
            result = await loop.run_in_executor(
                state["executor"], state["generator"].generate, tokens, new, use_cache
            )
        except CapacityError as exc:  # the prompt's pages do not fit the DRAM tier pinned
            metrics.bad_requests.inc()
            return web.json_response({"error": f"'tokens': too long for this server: {exc}"},
                                     status=400)  # fmt: skip
    done = time.perf_counter()
    label = "kvtier" if use_cache else "none"
    metrics.requests.inc(label)
    metrics.prompt_tokens.inc(label, by=len(tokens))
    metrics.reused_tokens.inc(by=result["cached_tokens"])
    metrics.computed_tokens.inc(label, by=result["computed_tokens"])
    metrics.seconds.observe(done - arrived, label)
    metrics.queue_seconds.observe(started - arrived, label)
    result["queue_seconds"] = started - arrived
    result["seconds"] = done - arrived
    return web.json_response(result)


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = state["cache"].metrics.to_prometheus() + state["metrics"].to_prometheus()
    return web.Response(
        text=text,
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Prometheus-Format": "0.0.4"},
    )


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cache: KVCache = state["cache"]
    return web.json_response(
        {"ok": cache.is_open, "model": cache.spec.name, "tiers": [t.name for t in cache.tiers]}
    )


def make_app(args: argparse.Namespace) -> web.Application:
    """The aiohttp application; the cache opens at start-up and closes at clean-up."""
    app = web.Application()

    async def kvtier_lifecycle(app: web.Application) -> AsyncIterator[None]:
        model = build_model(args.model, max_positions=args.max_positions)
        config = kvtier_config(
            model,
            args.model,
            args.store,
            parse_size(args.dram, "--dram"),
            parse_size(args.disk, "--disk"),
            args.page_tokens,
            args.backend,
        )
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        async with KVCache(config, env={}) as cache:
            bridge = KVTierBridge(cache, asyncio.get_running_loop())
            app[STATE] = {
                "cache": cache,
                "namespace": bridge.namespace_for(model.config),  # the bridge's caches' keys
                "generator": Generator(model, bridge),
                "executor": executor,
                "lock": asyncio.Lock(),
                "metrics": ServerMetrics(),
                "tasks": set(),
            }
            try:
                yield
            finally:
                executor.shutdown(wait=True)  # no generation is left using the cache
                for t in app[STATE]["tasks"]:
                    t.cancel()
        # leaving 'async with' closed the cache: dirty pages written down, tiers closed

    app.cleanup_ctx.append(kvtier_lifecycle)
    app.router.add_post("/generate", handle_generate)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_health)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(make_app(args), handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"listening on http://{args.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
    print("stopped", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="kvtier example generation server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    ap.add_argument("--model", default="tiny", help="tiny | small | bench (random weights)")
    ap.add_argument("--store", default=".kvtier-server", help="directory of the disk tier")
    ap.add_argument("--backend", default="nvme", help="disk tier backend: nvme | file")
    ap.add_argument("--dram", default="64MiB", help="DRAM tier size")
    ap.add_argument("--disk", default="4GiB", help="disk tier size")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--max-positions", type=int, default=8192)
    return ap.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(serve(parse_args()))
