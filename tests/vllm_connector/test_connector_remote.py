"""Two vLLM engines alive at once share KV through kvtier's Redis-protocol tier (a real
Valkey server on 127.0.0.1): a prefill engine (``kv_producer``) stores, a decode engine
(``kv_consumer``) loads. Then the remote tier misbehaves under the consumer: pages
altered with valid checksums (negative control: the logits change, so loaded KV is really
used), pages with a flipped byte (recomputed, same tokens, counted), the server killed
(recomputed, same tokens, no hang)."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from vllm_engines import Engine, base_env, connector, llm_kwargs
from vllm_prompts import extra_prompts

from kvtier.testing.servers import RedisServer, unavailable_reason

HEADER = 64
BLOCK = 32


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def _new_keys(client: Any, seen: set[bytes], count: int, timeout: float = 60.0) -> list[bytes]:
    """Wait until ``count`` keys not in ``seen`` are in the server; returns them sorted."""
    deadline = time.monotonic() + timeout
    new: set[bytes] = set()
    while time.monotonic() < deadline:
        new = set(client.keys("*")) - seen
        if len(new) >= count:
            return sorted(new)
        time.sleep(0.2)
    raise AssertionError(f"the producer stored {len(new)} new pages, expected {count}")


def _reheader(payload: bytes, old_header: bytes) -> bytes:
    """A valid header for ``payload`` with the old header's key and namespace (the layout
    documented in kvtier/pageformat.py, written out independently here)."""
    magic, version, flags, _length, _csum, key, ns = struct.unpack("<4sHHQQ16s16s", old_header[:56])
    body = struct.pack(
        "<4sHHQQ16s16s",
        magic,
        version,
        flags,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        key,
        ns,
    )
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body)) + bytes(4)


def _scale_bf16(payload: bytes, factor: float) -> bytes:
    """bfloat16 values times ``factor`` (bf16 is the top half of a float32)."""
    raw = np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16
    scaled = (raw.view(np.float32) * np.float32(factor)).view(np.uint32) >> 16
    return scaled.astype("<u2").tobytes()


def _pages(prompt: list[int], generated: int = 1) -> int:
    return (len(prompt) + generated - 1) // BLOCK


def test_prefill_and_decode_engines_share_through_redis_and_survive_its_faults(  # type: ignore[no-untyped-def]
    tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path: Path
):
    reason = unavailable_reason("valkey")
    if reason:
        pytest.skip(reason)
    a, b, c, d = extra_prompts()
    n0 = len(tiny_prompts)
    ref = tiny_reference["tokens"][n0:]
    ref_lp = tiny_reference["logprobs"][n0:]
    with RedisServer("valkey") as server:
        client = _redis(server.url)
        remote = {
            "name": "remote",
            "backend": "redis",
            "capacity": "16MiB",
            "options": {"url": server.url, "op_timeout_s": 2.0},
        }
        producer_cfg = {"tiers": [remote], "log": {"level": "warning"}}
        consumer_cfg = {
            "tiers": [{"name": "dram", "backend": "dram", "capacity": "64KiB"}, remote],
            "log": {"level": "warning"},
        }
        env = base_env(runtime_dir)
        prod_llm = llm_kwargs(kv_transfer_config=connector(producer_cfg, role="kv_producer"))
        cons_llm = llm_kwargs(
            enable_prefix_caching=False,
            kv_transfer_config=connector(consumer_cfg, role="kv_consumer"),
        )
        with (
            Engine(tiny_model, prod_llm, env, tmp_path / "producer.log") as producer,
            Engine(tiny_model, cons_llm, env, tmp_path / "consumer.log") as consumer,
        ):
            # 1. hand-off: the producer prefills (one token, as a prefill node does)
            producer.generate([a], max_tokens=1)
            seen = set(_new_keys(client, set(), _pages(a)))
            out = consumer.generate([a], 8, logprobs=1)
            m1 = consumer.metrics()
            assert out["tokens"] == [ref[0]]
            assert out["cached"] == [((len(a) - 1) // BLOCK) * BLOCK]
            assert m1["loaded_pages"] == (len(a) - 1) // BLOCK
            assert m1.get("hit_tokens.remote", 0) > 0

            # 2. negative control: b's KV tripled behind kvtier's back, checksums valid
            producer.generate([b], max_tokens=1)
            keys_b = _new_keys(client, seen, _pages(b))
            seen |= set(keys_b)
            for k in keys_b:
                v = client.get(k)
                p = _scale_bf16(v[:-HEADER], 3.0)
                client.set(k, p + _reheader(p, v[-HEADER:]))
            out = consumer.generate([b], 8, logprobs=1)
            m2 = consumer.metrics()
            assert m2["loaded_pages"] > m1["loaded_pages"]  # the altered pages were loaded
            differs = out["tokens"][0] != ref[1] or any(
                abs(x - y) > 1e-2 for x, y in zip(out["logprobs"][0], ref_lp[1], strict=True)
            )
            assert differs, "KV altered in the remote tier did not change the output"

            # 3. damaged pages: c's pages each get a flipped byte (checksums now fail)
            producer.generate([c], max_tokens=1)
            keys_c = _new_keys(client, seen, _pages(c))
            seen |= set(keys_c)
            for k in keys_c:
                v = bytearray(client.get(k))
                v[10] ^= 0xFF
                client.set(k, bytes(v))
            out = consumer.generate([c], 8)
            m3 = consumer.metrics()
            assert out["tokens"] == [ref[2]]
            assert (
                m3.get("load_errors", 0) > m2.get("load_errors", 0)
                or m3["loaded_pages"] == m2["loaded_pages"]
            )  # caught when loading, or already when the lookup's prefetch verified them

            # 4. the remote server dies: the consumer recomputes, same tokens, no hang
            producer.generate([d], max_tokens=1)
            _new_keys(client, seen, _pages(d))
            server.kill()
            started = time.monotonic()
            out = consumer.generate([d], 8)
            assert out["tokens"] == [ref[3]]
            assert time.monotonic() - started < 60
