"""Prefill/decode hand-off through the shared remote tier, with two real processes.

The prefill process (examples/pd_handoff/prefill.py) computes KV for prompts and stores
it to a Valkey server; it exits; a separately started decode process
(examples/pd_handoff/decode.py) finds the prompts' pages by prefix lookup and loads them.
The test checks the decoded side's pages byte for byte against the KV the toy model
computes here, and that a decode process against an empty server finds nothing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from kvtier.testing.servers import RedisServer, unavailable_reason

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pd_handoff"
PROMPTS = 4

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)


def toymodel() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pd_toymodel", EXAMPLE / "toymodel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, script, *args],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_decode_process_loads_what_prefill_process_stored(tmp_path: Path) -> None:
    tm = toymodel()
    model, prompts, page_tokens = tm.ToyModel(), tm.prompts(PROMPTS), tm.SPEC.page_tokens
    out = tmp_path / "decoded.npz"
    with RedisServer("valkey") as server:
        empty = run("decode.py", "--url", server.url, "--prompts", str(PROMPTS))
        assert empty["cached_tokens"] == [0] * PROMPTS  # nothing to find before prefill

        pre = run("prefill.py", "--url", server.url, "--prompts", str(PROMPTS))
        full_pages = [len(p) // page_tokens for p in prompts]
        assert pre["stored_pages"] == full_pages
        # the shared 3-page system prefix is stored once: keys are content addresses
        assert pre["remote_used_pages"] == sum(full_pages) - 3 * (PROMPTS - 1)

        dec = run("decode.py", "--url", server.url, "--prompts", str(PROMPTS), "--out", str(out))
    assert dec["cached_tokens"] == [n * page_tokens for n in full_pages]
    assert dec["loaded_pages"] == full_pages
    decoded = np.load(out)
    for i, tokens in enumerate(prompts):
        expected = model.prefill(tokens)
        got = decoded[f"prompt{i}"]
        assert got.shape == expected.shape
        assert got.tobytes() == expected.tobytes(), f"prompt {i}: decoded KV differs"
