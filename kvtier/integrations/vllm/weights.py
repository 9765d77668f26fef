"""The fingerprint of a local checkpoint: what tells two checkpoints at one path apart.

A vLLM engine serving a local directory gets, as its namespace's revision,
:func:`weights_fingerprint`: a hash of the config files (whole) and of **every byte** of
each weight file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``, ``.gguf``), with their
names and sizes. Any change to the weights, even one tensor, gives another fingerprint,
so an engine never loads KV computed by other weights (a sampled hash missed a checkpoint
whose ``k_proj`` weights alone were retrained, and served wrong tokens). Equal files give
equal fingerprints on any machine, so servers with their own copies of one checkpoint
share pages.

Hashing reads the weights once (xxh3-128, streamed in 8 MiB blocks). A file's digest is
remembered in ``cache`` (a JSON file, written atomically) under its path with its device,
inode, size, modification and change times (``st_ctime_ns`` moves on every write to the
file and cannot be set back): a later start whose files have not changed reads no weight
byte. A cache that cannot be read or written is ignored (the digests are computed).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import xxhash

from kvtier.log import get_logger

_log = get_logger("kvtier.vllm.weights")

#: The files hashed as weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_BLOCK = 8 << 20
#: Bumped when the digest of a file changes meaning (old cache entries are then unused).
_DIGEST_VERSION = 1


def _identity(st: os.stat_result) -> list[int]:
    return [_DIGEST_VERSION, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digest(path: Path) -> str:
    """xxh3-128 of every byte of ``path`` (hex)."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _read_cache(cache: Path | None) -> dict[str, Any]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: Path, entries: dict[str, Any]) -> None:
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)
    except OSError as exc:
        _log.warning("weight digests not remembered", cache=str(cache), error=str(exc))
        with contextlib.suppress(OSError):
            tmp.unlink()


def weights_fingerprint(directory: Path, cache: Path | None = None) -> str | None:
    """A short fingerprint of the checkpoint in ``directory`` (``None`` if it is not a
    directory or holds no weight file): its config files whole and every weight file's
    full digest (see the module docstring), remembered in ``cache`` when given."""
    if not directory.is_dir():
        return None
    remembered = _read_cache(cache)
    entries = dict(remembered)
    h = xxhash.xxh3_128()
    weights = 0
    hashed_bytes = 0
    start = time.perf_counter()
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        name = path.name
        if name.endswith(".json"):
            h.update(name.encode() + b"\0" + path.read_bytes())
        elif name.endswith(WEIGHT_SUFFIXES):
            st = path.stat()
            key = str(path.resolve())
            entry = remembered.get(key)
            if isinstance(entry, dict) and entry.get("identity") == _identity(st):
                digest = str(entry.get("digest"))
            else:
                digest = file_digest(path)
                after = path.stat()
                if _identity(after) == _identity(st):  # not changed while it was read
                    entries[key] = {"identity": _identity(st), "digest": digest}
                hashed_bytes += st.st_size
            h.update(f"{name}\0{st.st_size}\0{digest}\0".encode())
            weights += 1
    if hashed_bytes:
        _log.info(
            "hashed the weights for the namespace's revision",
            directory=str(directory),
            bytes=hashed_bytes,
            seconds=round(time.perf_counter() - start, 3),
            remembered_in=str(cache) if cache is not None else None,
        )
        if cache is not None:
            _write_cache(cache, entries)
    return f"weights-{h.hexdigest()[:16]}" if weights else None
