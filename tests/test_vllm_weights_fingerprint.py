"""The checkpoint fingerprint behind a vLLM engine's namespace revision
(:mod:`kvtier.integrations.vllm.weights`): every weight byte counts, equal copies agree,
and a remembered digest is reused only while the file is unchanged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier.integrations.vllm import weights
from kvtier.integrations.vllm.weights import weights_fingerprint

SIZE = 4 << 20


def _checkpoint(root: Path, seed: int = 0) -> Path:
    d = root / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"hidden_size": 64}')
    data = bytearray(os.urandom(16)) * (SIZE // 16)
    data[:8] = seed.to_bytes(8, "little")
    (d / "model-00001-of-00002.safetensors").write_bytes(data)
    (d / "model-00002-of-00002.safetensors").write_bytes(data[: SIZE // 2])
    return d


def _flip(path: Path, offset: int, length: int) -> None:
    """Change ``length`` bytes at ``offset`` in place (same size, same inode)."""
    with path.open("r+b") as f:
        f.seek(offset)
        old = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


@pytest.mark.parametrize("offset", [150 << 10, SIZE // 2 + 12345, SIZE - 1])
def test_any_changed_weight_byte_changes_the_fingerprint(tmp_path: Path, offset: int) -> None:
    # 150 KiB lies between the first two of the 16 samples of 64 KiB the fingerprint once
    # read: a tensor stored there (k_proj in SmolLM2) was never hashed, and a checkpoint
    # retrained in it loaded the old KV and gave wrong tokens.
    d = _checkpoint(tmp_path)
    before = weights_fingerprint(d)
    assert before is not None and before.startswith("weights-")
    _flip(d / "model-00001-of-00002.safetensors", offset, 1)
    assert weights_fingerprint(d) != before


def test_copies_of_one_checkpoint_agree_and_configs_count(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "b" / "model"
    shutil.copytree(a, b)
    assert weights_fingerprint(a) == weights_fingerprint(b)  # servers with their own copy
    (b / "config.json").write_text('{"hidden_size": 65}')
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(tmp_path / "missing") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert weights_fingerprint(empty) is None  # no weight file: the caller says "main"


def test_a_remembered_digest_is_used_only_while_the_file_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _checkpoint(tmp_path)
    cache = tmp_path / "run" / "weight-digests.json"
    cache.parent.mkdir()
    hashed: list[str] = []
    real = weights.file_digest

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(weights, "file_digest", counting)
    first = weights_fingerprint(d, cache)
    assert len(hashed) == 2 and cache.is_file() and cache.stat().st_mode & 0o777 == 0o600
    assert weights_fingerprint(d, cache) == first and len(hashed) == 2  # nothing read again
    # Rewritten in place with its old modification time put back: the change time moved.
    shard = d / "model-00002-of-00002.safetensors"
    st = shard.stat()
    _flip(shard, 1000, 4)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = weights_fingerprint(d, cache)
    assert changed != first and hashed[2:] == [shard.name]
    assert changed == weights_fingerprint(d)  # what a computation without the cache gives
    # A damaged cache is ignored, and rewritten.
    cache.write_text("{not json")
    assert weights_fingerprint(d, cache) == changed and len(hashed) == 7
    assert weights_fingerprint(d, cache) == changed and len(hashed) == 7
