"""kvtier's KV events in a real vLLM engine (CPU, the tiny random Llama).

docs/integrations.md: with vLLM's ``kv_events_config``, kvtier publishes ``BlockStored`` /
``BlockRemoved`` for every page a kvtier tier gains or loses, the medium being the tier's
name and the block hash the 16-byte page key. Here a subscriber (pyzmq, the batches decoded
with msgspec as vLLM's own subscriber example does) listens while an engine with a DRAM
tier of four pages over an NVMe tier (write-through) runs a round of prompts, then one
prompt again (vLLM's prefix cache off: kvtier gives its pages back, the lookup promotes
pages from NVMe into DRAM). The page keys each tier must have gained are computed from
the prompts and the generated tokens with kvtier's own key function, in the namespace the
worker logged; the DRAM tier is too small for them, so it must also announce what it
evicted. Replaying the events must give what each tier holds when the cache closes (its
own count, logged). And pages a tier already holds when the engine starts (an NVMe store
of an earlier process) are announced too: a router must learn them from this engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from vllm_engines import Engine, base_env, connector, llm_kwargs

try:  # vLLM's environment; elsewhere conftest skips these tests, naming why
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
except ImportError:
    pass

from kvtier.cache import KVCache
from kvtier.keys import KEY_BYTES, Namespace, page_keys
from kvtier.testing.servers import free_port_for_later

BLOCK = 32
GENERATED = 8
PAGE_BYTES = 2 * 2 * BLOCK * 64 * 2  # layers x heads x block x (K|V) x bf16 = 16 KiB
DRAM_PAGES = 4
# Tier names that are not backend names: the medium must be the tier's name.
DRAM, NVME = "ram-top", "disk-below"
TOPIC = "kvtier-test"
#: how long the events of the last saves (and their write-through) may take to arrive
SETTLE_S = 30.0


def kv_config(store: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": DRAM, "backend": "dram", "capacity": f"{DRAM_PAGES * PAGE_BYTES // 1024}KiB"},
            {
                "name": NVME,
                "backend": "nvme",
                "capacity": "4MiB",
                "options": {"path": str(store), "preallocate": False},
            },
        ],
        # info, as JSON lines: the worker's "ready" line names its namespace
        "log": {"level": "info", "format": "json"},
    }


class Subscriber:
    """vLLM's subscriber example, in a test: a SUB socket for the live batches, bound on
    127.0.0.1 (the engine's publisher connects to it), and a replay request to the
    publisher's replay socket for the batches the live socket missed (a publisher that
    connects drops its first batches until the subscription reaches it). Each message
    ``(topic, seq, payload)`` is decoded with msgspec as a :class:`KVEventBatch`."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = free_port_for_later()
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}

    def config(self) -> dict[str, Any]:
        """The engine's ``kv_events_config``."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{self.port}",  # not a wildcard: it connects
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",  # it binds
            "topic": TOPIC,
        }

    def _add(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        assert topic == TOPIC.encode()
        self.batches.setdefault(int.from_bytes(seq, "big"), self.decoder.decode(payload))

    def sync(self) -> None:
        """Take the live batches, then replay every batch from the first one missing."""
        while self.sub.poll(100):
            self._add(*self.sub.recv_multipart())
        start = next(i for i in range(len(self.batches) + 1) if i not in self.batches)
        req = self.ctx.socket(zmq.DEALER)
        try:
            req.connect(f"tcp://127.0.0.1:{self.replay_port}")
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert req.poll(10_000), "the publisher did not answer a replay request"
                _, topic, seq, payload = req.recv_multipart()
                if seq == self.END_SEQ:
                    break
                self._add(topic, seq, payload)
        finally:
            req.close(linger=0)

    def events(self) -> list[Any]:
        """Every event so far, in publishing order (batches numbered 0, 1, ...)."""
        assert sorted(self.batches) == list(range(len(self.batches))), sorted(self.batches)
        return [e for seq in sorted(self.batches) for e in self.batches[seq].events]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def held(events: list[Any]) -> tuple[dict[str, set[bytes]], dict[str, list[bytes]]]:
    """Replay the events in order: the keys each medium holds at the end, and the keys
    each medium announced as removed."""
    now: dict[str, set[bytes]] = defaultdict(set)
    removed: dict[str, list[bytes]] = defaultdict(list)
    for ev in events:
        if isinstance(ev, BlockStored):
            now[str(ev.medium)].update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in now[str(ev.medium)], f"{ev.medium} removed {h!r} it never stored"
                now[str(ev.medium)].discard(h)
                removed[str(ev.medium)].append(h)
    return now, removed


def stored_keys(events: list[Any], medium: str) -> set[bytes]:
    return {h for e in events if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes}  # fmt: skip


def worker_namespace(log: Path) -> Namespace:
    """The namespace of the worker's pages, from its JSON "ready" log line."""
    for line in log.read_text(errors="replace").splitlines():
        if "kvtier connector worker ready" in line and line.startswith("{"):
            return Namespace.from_label(json.loads(line)["namespace"])
    raise AssertionError(f"no 'kvtier connector worker ready' line in {log}")


def closed_tiers(log: Path) -> dict[str, dict[str, int]]:
    """Each tier's counters when the worker closed its cache, from the JSON log line."""
    for line in log.read_text(errors="replace").splitlines():
        if "kvtier cache closed" in line and line.startswith("{"):
            return dict(json.loads(line)["metrics"])
    raise AssertionError(f"no 'kvtier cache closed' line in {log}")


def expected_keys(ns: Namespace, prompts: list[list[int]], outs: list[list[int]]) -> set[bytes]:
    """The keys of the whole pages each finished request leaves (its last token has no
    KV), as the connector names them."""
    keys: set[bytes] = set()
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = prompt + out
        pages = (len(tokens) - 1) // BLOCK
        keys.update(page_keys(tokens[: pages * BLOCK], ns))
    return keys


def test_kv_events_name_kvtier_tiers_and_page_keys(
    tiny_model: Path, tiny_prompts: list[list[int]], runtime_dir: Path, tmp_path: Path
) -> None:
    sub = Subscriber()
    llm = llm_kwargs(
        enable_prefix_caching=False,  # a prompt run again is a kvtier hit; no GPU events
        kv_transfer_config=connector(kv_config(tmp_path / "nvme")),
        kv_events_config=sub.config(),
    )
    log = tmp_path / "engine.log"
    try:
        with Engine(tiny_model, llm, base_env(runtime_dir), log) as eng:
            out = eng.generate(tiny_prompts, GENERATED)["tokens"]
            want = expected_keys(worker_namespace(log), tiny_prompts, out)
            assert len(want) == sum((len(p) + GENERATED - 1) // BLOCK for p in tiny_prompts)
            # the last saves (and their copies down) land after the round's last step; the
            # worker reports their events with a later step: step until all have come
            deadline = time.monotonic() + SETTLE_S
            while True:
                sub.sync()
                now, _ = held(sub.events())
                if now[NVME] >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
                eng.generate([[1]], 1)  # one token: no page, one more engine step
            metrics = eng.settled_metrics()
            sub.sync()
            first_round = sub.events()
            longest = tiny_prompts[-1]  # 8 whole pages, most of them only on NVMe now
            again = eng.generate([longest], GENERATED)
            eng.settled_metrics()
            sub.sync()
    finally:
        sub.close()
    events = sub.events()
    media = {getattr(e, "medium", None) for e in events}
    assert media == {DRAM, NVME}, f"media of the events: {media}"
    for ev in events:
        assert all(isinstance(h, bytes) and len(h) == KEY_BYTES for h in ev.block_hashes), ev
        if isinstance(ev, BlockStored):
            assert ev.block_size == BLOCK and ev.parent_block_hash is None, ev
            assert ev.token_ids == [] and ev.lora_id is None, ev

    # the first round: every page the worker saved entered the DRAM tier and was written
    # through to NVMe, announced under its page key; nothing else was announced
    assert metrics.get("saved_pages") == len(want)
    assert stored_keys(first_round, DRAM) == want
    assert stored_keys(first_round, NVME) == want
    now, removed = held(first_round)
    assert now[NVME] == want and not removed[NVME]
    # the DRAM tier holds four pages: it announced the others' eviction
    assert len(now[DRAM]) <= DRAM_PAGES
    assert len(removed[DRAM]) >= len(want) - DRAM_PAGES
    assert now[DRAM] | set(removed[DRAM]) == want

    # the prompt again: its pages came from kvtier; the DRAM tier announced the pages
    # the lookup brought up from NVMe, and nothing new was stored on NVMe
    assert again["cached"] == [(len(longest) - 1) // BLOCK * BLOCK]
    later = events[len(first_round) :]
    assert stored_keys(later, NVME) == set()
    promoted = stored_keys(later, DRAM)
    assert promoted and promoted <= set(page_keys(longest, worker_namespace(log)))

    # replaying every event gives what each tier held when the cache closed
    now, removed = held(events)
    closed = closed_tiers(log)
    for tier in (DRAM, NVME):
        assert len(now[tier]) == closed[tier]["used_pages"], (tier, closed[tier])
        assert len(removed[tier]) == closed[tier]["evicted_pages"], (tier, closed[tier])


async def _earlier_process(store: Path, tokens: list[int]) -> list[bytes]:
    """Pages an earlier process left in the NVMe store (same page geometry as the tiny
    model's: 2 layers, 2 KV heads, head dim 32, bfloat16, 32 tokens); their keys."""
    cfg = {
        "model": {
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 32,
            "dtype": "bfloat16",
            "page_tokens": BLOCK,
        },
        "namespace": {"model_id": "an-earlier-process"},
        "tiers": [kv_config(store)["tiers"][1]],
        "log": {"level": "warning"},
    }
    async with KVCache(cfg) as cache:
        pages = np.zeros((len(tokens) // BLOCK, PAGE_BYTES), np.uint8)
        result = await cache.store(tokens, pages)
    assert all(result.stored)
    return list(result.keys)


def test_pages_held_at_start_are_announced(
    tiny_model: Path, runtime_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "nvme"
    keys = set(asyncio.run(_earlier_process(store, list(range(3 * BLOCK)))))
    sub = Subscriber()
    llm = llm_kwargs(
        enable_prefix_caching=False,
        kv_transfer_config=connector(kv_config(store)),
        kv_events_config=sub.config(),
    )
    try:
        with Engine(tiny_model, llm, base_env(runtime_dir), tmp_path / "engine.log") as eng:
            deadline = time.monotonic() + 5.0  # a few engine steps
            while time.monotonic() < deadline and not stored_keys(sub.events(), NVME) >= keys:
                eng.generate([[1]], 1)
                sub.sync()
    finally:
        sub.close()
    assert stored_keys(sub.events(), NVME) == keys
