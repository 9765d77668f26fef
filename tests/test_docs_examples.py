"""The examples of the README and docs/integrations.md run as written.

A reader copies them: the embedding example and the transformers snippet are run from the
documents' own text, in a fresh process, and must print what the documents say; the vLLM
commands must name a configuration file that exists and passes ``inspect config --check``
(the vLLM run itself is in tests/vllm_connector, which also runs scripts/smollm2-model).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INTEGRATIONS = ROOT / "docs" / "integrations.md"


def blocks(path: Path, lang: str) -> list[str]:
    """The fenced ``lang`` code blocks of ``path``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in ``cwd``; its ``tempfile.mkdtemp()`` stores land there too.

    The snippets make their NVMe store with ``tempfile.mkdtemp()`` (a 1 GiB one for the
    transformers snippet) and leave it, as a reader's script would; with ``TMPDIR`` in
    the test's own directory pytest removes them with it instead of /tmp filling up.
    """
    env = {**os.environ, "TMPDIR": str(cwd)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_readme_embedding_example_prints_what_it_says(tmp_path: Path) -> None:
    example = next(b for b in blocks(README, "python") if "async def main" in b)
    said = re.search(r"It prints `(.*?)`", README.read_text())
    assert said is not None, "the README no longer says what the example prints"
    done = run_python(example, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == said.group(1)


def test_transformers_snippet_prints_what_it_says(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    snippet = next(b for b in blocks(INTEGRATIONS, "python") if "KVTierBridge.start" in b)
    done = run_python(snippet, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 2, done.stdout
    (first, tokens1), (second, tokens2) = (line.split(" ", 1) for line in lines)
    said = re.search(r"It prints `0 \[\.\.\.\]` then `(\d+) \[\.\.\.\]`", INTEGRATIONS.read_text())
    assert said is not None, "docs/integrations.md no longer says what the snippet prints"
    assert (first, second) == ("0", said.group(1))
    assert tokens1 == tokens2 and len(json.loads(tokens1)) == 8


def _vllm_configs() -> list[tuple[str, str]]:
    """(document, kvtier_config) of every ``vllm serve`` command shown to be run as is."""
    found = []
    for doc in (README, INTEGRATIONS):
        for block in blocks(doc, "bash"):
            if "vllm serve" not in block or "MODEL=" not in block:
                continue
            words = shlex.split(block.split("vllm serve", 1)[1], comments=False)
            kv = json.loads(words[words.index("--kv-transfer-config") + 1])
            found.append((doc.name, kv["kv_connector_extra_config"]["kvtier_config"]))
    return found


def test_every_vllm_serve_command_listens_on_loopback() -> None:
    """What kvtier's docs start listens on 127.0.0.1 unless told otherwise; vLLM listens
    on every interface without --host (the README's command had none)."""
    found = 0
    for doc in (README, INTEGRATIONS):
        for block in blocks(doc, "bash"):
            for command in block.split("vllm serve")[1:]:
                words = shlex.split(command, comments=False)
                assert words[words.index("--host") + 1] == "127.0.0.1", (doc.name, command)
                found += 1
    assert found >= 3


def test_the_vllm_commands_name_a_configuration_that_works(tmp_path: Path) -> None:
    configs = _vllm_configs()
    assert {doc for doc, _ in configs} == {"README.md", "integrations.md"}
    for doc, name in configs:
        path = ROOT / name
        assert path.is_file(), f"{doc}: {name} does not exist"
        # run it from a scratch directory, where the relative NVMe path of the example
        # points (vLLM resolves it from where it starts)
        text = path.read_text()
        (tmp_path / "kvtier.toml").write_text(text)
        done = subprocess.run(
            [str(Path(sys.executable).with_name("kvtier")), "inspect", "config", "-c",
             "kvtier.toml", "--check", "--json"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (doc, done.stdout[-2000:], done.stderr[-2000:])
        # the check creates no store: vLLM later makes it for its own page size
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtier.toml"]
