"""kvtier inside a real vLLM engine (CPU), on a tiny random Llama.

Every engine runs in its own process (``driver.py``), as a server would. What is checked:
greedy tokens with the connector equal vLLM alone (prefix caching on and off, prompt
lengths with and without whole blocks), reuse after vLLM evicted its own blocks, a fresh
engine loading what an earlier one stored on NVMe (also in single-process mode), damaged
pages and a full disk (recomputed, same tokens, counted), and a negative control (KV
altered behind kvtier's back, with valid checksums, changes the logits: loaded KV is
really used).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from vllm_engines import (
    Engine,
    base_env,
    connector,
    dram_over_nvme,
    flip_every_slot,
    llm_kwargs,
)
from vllm_prompts import extra_prompts, shared_prefix_prompts

from kvtier.testing.servers import free_port_for_later

BLOCK = 32
PAGE_BYTES = 2 * 2 * BLOCK * 64 * 2  # layers x heads x block x (K|V) x bf16 = 16 KiB


def hit_pages(prompt: list[int]) -> int:
    """Pages kvtier can give for a prompt: whole blocks, one token always computed."""
    return (len(prompt) - 1) // BLOCK


def saved_pages(prompt: list[int], generated: int) -> int:
    """Whole pages of KV a finished request leaves (the last token has no KV)."""
    return (len(prompt) + generated - 1) // BLOCK


def filler(n: int = 8, length: int = 250) -> list[list[int]]:
    return [[(900 + i * 37 + j * 11) % 512 for j in range(length)] for i in range(n)]


@pytest.fixture(scope="module")
def stored(tiny_model, tiny_prompts, runtime_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Engine B: connector on, vLLM prefix caching on and a block pool of 72 blocks; a cold
    round, filler prompts that push the first round out of vLLM's pool, a warm round. Its
    kvtier config switches on what-if sizing and the ``prefix`` predictor (``[observe]``),
    and kvtier's metrics are scraped at the end."""
    root = tmp_path_factory.mktemp("engine-b")
    store = root / "nvme"
    kv = {**dram_over_nvme(store), "observe": {"whatif": True, "predictor": "prefix"}}
    port = free_port_for_later()
    llm = llm_kwargs(
        num_gpu_blocks_override=72,
        kv_transfer_config=connector(kv, kvtier_metrics_port=port),
    )
    with Engine(tiny_model, llm, base_env(runtime_dir), root / "engine.log") as eng:
        cold = eng.generate(tiny_prompts, 8, logprobs=1)
        m_cold = eng.settled_metrics()
        eng.generate(filler(), 8)
        warm = eng.generate(tiny_prompts, 8, logprobs=1)
        m_warm = eng.settled_metrics()
        shared = eng.generate(shared_prefix_prompts(), 8)  # one batch, one shared prefix
        m_shared = eng.settled_metrics()
        # A lookup that finds pages in DRAM, whatever the timing: the second shared-prefix
        # prompt again (vLLM's prefix cache holds it, but kvtier is asked from page 0).
        # Its lookup covers 5 of the round's 6 saved pages, and the 4-page DRAM tier holds
        # 4 of the 6. Without it, a DRAM hit at lookup came only from a prefetch on lookup that
        # ended before the same request was looked up again: it missed in 1 of 7 runs.
        eng.generate(shared_prefix_prompts()[1:], 8)
        kvtier_metrics = _metrics_text(f"http://127.0.0.1:{port}/metrics")
    return {
        "kvtier_metrics": kvtier_metrics,
        "store": store,
        "cold": cold,
        "warm": warm,
        "shared": shared,
        "m_cold": m_cold,
        "m_warm": m_warm,
        "m_shared": m_shared,
    }


def test_cold_round_equals_vllm_alone_and_saves_every_full_page(
    stored, tiny_prompts, tiny_reference
):  # type: ignore[no-untyped-def]
    n = len(tiny_prompts)
    assert stored["cold"]["tokens"] == tiny_reference["tokens"][:n]
    assert stored["cold"]["cached"] == [0] * n
    expected = sum(saved_pages(p, 8) for p in tiny_prompts)
    assert (
        stored["m_cold"].get("saved_pages", 0) + stored["m_warm"].get("saved_pages", 0) >= expected
    )
    assert stored["m_cold"].get("loaded_pages", 0) == 0


def test_reuse_after_vllm_evicted_its_own_blocks(stored, tiny_prompts, tiny_reference):  # type: ignore[no-untyped-def]
    n = len(tiny_prompts)
    assert stored["warm"]["tokens"] == tiny_reference["tokens"][:n]
    assert stored["warm"]["cached"] == [hit_pages(p) * BLOCK for p in tiny_prompts]
    assert stored["m_warm"].get("loaded_pages", 0) > 0  # the filler evicted vLLM's copies
    assert stored["m_warm"].get("load_errors", 0) == 0


def test_requests_sharing_a_prefix_in_one_batch(stored, tiny_reference):  # type: ignore[no-untyped-def]
    assert stored["shared"]["tokens"] == tiny_reference["tokens"][-2:]
    saved = stored["m_shared"]["saved_pages"] - stored["m_warm"]["saved_pages"]
    # 6 distinct pages: the 3 shared blocks, then 1 and 2 of each request's own; a shared
    # block saved by both requests in one step is saved once, in two steps twice at most
    assert 6 <= saved <= 9
    assert stored["m_shared"].get("save_failures", 0) == 0


def test_whatif_and_the_predictor_switched_on_in_the_kvtier_config_run_in_the_engine(  # type: ignore[no-untyped-def]
    stored,
):
    """``[observe]`` in the connector's kvtier config: the worker's cache estimates each
    tier's hit rate at other sizes and runs the live predictor, both in its metrics."""
    text = stored["kvtier_metrics"]
    for tier in ("dram", "nvme"):
        rates = {
            c: _sample(text, f'kvtier_whatif_hit_rate{{tier="{tier}",capacity="{c}"}}', None)
            for c in ("-50%", "-25%", "+0%", "+25%", "+50%", "+100%")
        }
        assert None not in rates.values(), (tier, text)
        assert all(0.0 <= r <= 1.0 for r in rates.values()), rates  # type: ignore[operator]
        assert rates["-50%"] <= rates["+100%"], rates  # type: ignore[operator]
        measured = _sample(text, f'kvtier_whatif_measured_hit_rate{{tier="{tier}"}}', None)
        assert measured is not None and 0.0 < measured <= 1.0, (tier, text)
    # the warm round looked up pages that had left the 4-page DRAM tier for NVMe
    issued = _sample(text, 'kvtier_predicted_prefetch_pages_total{outcome="issued"}', None)
    assert issued is not None and issued > 0, text


def test_fresh_engine_loads_from_nvme_single_process_no_prefix_cache(  # type: ignore[no-untyped-def]
    stored, tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path
):
    """A new process (vLLM in single-process mode, its prefix cache off) finds every whole
    page the first engine stored, on the NVMe tier, and gives the same tokens."""
    copy = tmp_path / "nvme"
    shutil.copytree(stored["store"], copy)
    llm = llm_kwargs(
        enable_prefix_caching=False, kv_transfer_config=connector(dram_over_nvme(copy))
    )
    env = base_env(runtime_dir, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with Engine(tiny_model, llm, env, tmp_path / "engine.log") as eng:
        out = eng.generate(tiny_prompts, 8, logprobs=1)
        again = eng.generate(tiny_prompts, 8)
        m = eng.metrics()
    n = len(tiny_prompts)
    pages = [hit_pages(p) for p in tiny_prompts]
    assert out["tokens"] == tiny_reference["tokens"][:n]
    assert again["tokens"] == tiny_reference["tokens"][:n]
    assert out["cached"] == [p * BLOCK for p in pages]
    assert m["loaded_pages"] == 2 * sum(pages)
    assert m.get("hit_tokens.nvme", 0) > 0
    assert m.get("load_errors", 0) == 0
    for got, want in zip(out["logprobs"], tiny_reference["logprobs"][:n], strict=True):
        assert got == pytest.approx(want, abs=1e-2)


def test_asynchronous_loads_give_the_same_tokens_while_their_requests_wait(  # type: ignore[no-untyped-def]
    stored, tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path
):
    """``kvtier_load_async = "always"``: every hit loads across engine steps (vLLM keeps
    the request in ``WAITING_FOR_REMOTE_KVS`` until the worker reports the load done),
    and the tokens are those of vLLM alone, with every whole page loaded."""
    copy = tmp_path / "nvme"
    shutil.copytree(stored["store"], copy)
    llm = llm_kwargs(
        enable_prefix_caching=False,
        kv_transfer_config=connector(dram_over_nvme(copy), kvtier_load_async="always"),
    )
    with Engine(tiny_model, llm, base_env(runtime_dir), tmp_path / "engine.log") as eng:
        out = eng.generate(tiny_prompts, 8, logprobs=1)
        m = eng.metrics()
        again = eng.generate(tiny_prompts, 8)
        m2 = eng.metrics()
    n = len(tiny_prompts)
    pages = [hit_pages(p) for p in tiny_prompts]
    assert out["tokens"] == tiny_reference["tokens"][:n]
    assert again["tokens"] == tiny_reference["tokens"][:n]
    assert out["cached"] == [p * BLOCK for p in pages]
    assert m["async_loads"] == sum(1 for p in pages if p) and m["loaded_pages"] == sum(pages)
    assert m2["async_loads"] == 2 * m["async_loads"] and m2["loaded_pages"] == 2 * sum(pages)
    assert m2.get("load_errors", 0) == 0
    for got, want in zip(out["logprobs"], tiny_reference["logprobs"][:n], strict=True):
        assert got == pytest.approx(want, abs=1e-2)


def test_asynchronous_loads_of_damaged_pages_recompute_and_below_top_hits_only(  # type: ignore[no-untyped-def]
    stored, tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path
):
    """``kvtier_load_async = "below-top"``: the first round's hits are on NVMe, so they
    load asynchronously, and every page is damaged: each block is a load error reported
    with the finished load, vLLM recomputes it, the tokens are vLLM's. Pages recomputed
    after a failed load are not saved from that request (a probe saw such pages serve
    wrong tokens later), so later rounds may meet damaged pages again (a page not read
    while the tier was marked failing stays in the store until a read finds it bad; a
    fresh-clone run saw 11 more load errors in the second round): every round must still
    give vLLM's tokens."""
    copy = tmp_path / "nvme"
    shutil.copytree(stored["store"], copy)
    assert flip_every_slot(copy) > 0
    llm = llm_kwargs(
        enable_prefix_caching=False,
        kv_transfer_config=connector(
            dram_over_nvme(copy, dram="4MiB"), kvtier_load_async="below-top"
        ),
    )
    with Engine(tiny_model, llm, base_env(runtime_dir), tmp_path / "engine.log") as eng:
        out = eng.generate(tiny_prompts, 8)
        m = eng.settled_metrics()
        again = eng.generate(tiny_prompts, 8)
        third = eng.generate(tiny_prompts, 8)
    n = len(tiny_prompts)
    hits = sum(1 for p in tiny_prompts if hit_pages(p))
    assert out["tokens"] == tiny_reference["tokens"][:n]
    assert again["tokens"] == tiny_reference["tokens"][:n]
    assert third["tokens"] == tiny_reference["tokens"][:n]
    assert m["async_loads"] == hits
    assert m.get("loaded_pages", 0) == 0 and m["load_errors"] == sum(map(hit_pages, tiny_prompts))


def _tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")


def test_damaged_pages_and_a_full_disk_recompute_the_same_tokens(  # type: ignore[no-untyped-def]
    stored, tiny_model, tiny_prompts, tiny_reference, runtime_dir, tmp_path
):
    """Every stored page has a flipped byte and the disk is full: the engine loads
    nothing wrong, recomputes, gives the same tokens; the metrics say what happened."""
    mnt = tmp_path / "mnt"
    _tmpfs(mnt, "16m")
    try:
        store = mnt / "nvme"
        # keep the slabs sparse (the store does not preallocate them here)
        subprocess.run(
            ["cp", "-a", "--sparse=always", str(stored["store"]), str(store)], check=True
        )
        assert flip_every_slot(store) > 0
        port = free_port_for_later()
        port_cfg = {"kvtier_metrics_port": port}
        llm = llm_kwargs(
            enable_prefix_caching=False,
            kv_transfer_config=connector(dram_over_nvme(store, dram="32KiB"), **port_cfg),
        )
        with Engine(tiny_model, llm, base_env(runtime_dir), tmp_path / "engine.log") as eng:
            _fill(mnt / "filler")  # the disk fills up while the engine runs
            out = eng.generate(tiny_prompts, 8)
            new = eng.generate(extra_prompts(), 8)
            m = eng.metrics()
            kvtier_metrics = _metrics_text(f"http://127.0.0.1:{port}/metrics")
        n = len(tiny_prompts)
        assert out["tokens"] == tiny_reference["tokens"][:n]
        assert new["tokens"] == tiny_reference["tokens"][n : n + len(extra_prompts())]
        assert m.get("load_errors", 0) > 0
        assert m.get("loaded_pages", 0) == 0  # no damaged page was served
        failed = _sample(kvtier_metrics, 'kvtier_failed_pages_total{tier="nvme"}')
        assert failed > 0, kvtier_metrics  # the full disk failed writes, counted per tier
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _sample(text: str, name: str, absent: float | None = 0.0) -> float | None:
    """The value of one Prometheus sample (``absent`` when there is none)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return absent
