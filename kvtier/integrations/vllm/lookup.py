"""How vLLM's scheduler learns what kvtier holds: a lookup service on a Unix socket.

vLLM runs the scheduler-side connector in the engine-core process and the worker-side
connector in each worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts both in one
process; the socket then serves them there all the same). Only the worker
owns a :class:`~kvtier.cache.KVCache` — its DRAM tier, its view of the NVMe tier and of
the shared remote tier — so the scheduler asks the workers: each worker serves
:class:`LookupServer` on a private Unix socket, and the scheduler's :class:`LookupClient`
sends the prompt's token ids and reads back how many leading pages kvtier can give (the
smallest answer over the ranks: every rank must hold its shard of a page). A second cache
in the scheduler process could not see the worker's DRAM tier, and an NVMe store has one
writer, which is why the answer comes from the owner.

The answer is a hint, not a lease: a page can leave every tier before the worker loads it.
The worker then reports the block as a load error and vLLM recomputes it (with
``kv_load_failure_policy = "recompute"``); wrong KV is never loaded.

Wire format (little-endian): request ``b"KVL1"``, token count (u32), flags (u32), scope
length (u32, at most :data:`~.scope.MAX_SCOPE_BYTES`), the scope (UTF-8: what extends the
namespace's model id for this request, :mod:`.scope`), then the token ids as u32;
response ``b"KVR1"``, JSON length (u32), JSON
``{"pages": int, "tiers": [[tier, pages], ...], "kinds": {tier: kind}}`` (``kinds``
lists the worker's tiers top first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.log import get_logger

from .scope import MAX_SCOPE_BYTES

_log = get_logger("kvtier.vllm.lookup")

REQUEST = struct.Struct("<4sIII")
RESPONSE = struct.Struct("<4sI")
REQUEST_MAGIC = b"KVL1"
RESPONSE_MAGIC = b"KVR1"
#: flags bit: start moving found pages toward the top tier
FLAG_PREFETCH = 1
#: the largest prompt a lookup accepts (tokens)
MAX_TOKENS = 1 << 24
_MAX_RESPONSE = 1 << 20


@dataclass
class LookupAnswer:
    """How many leading pages kvtier can give, and from which tiers (runs, in order)."""

    pages: int
    tiers: list[tuple[str, int]] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(
            {"pages": self.pages, "tiers": [list(t) for t in self.tiers], "kinds": self.kinds}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LookupAnswer:
        obj = json.loads(data)
        pages = obj.get("pages")
        if not isinstance(pages, int) or pages < 0:
            raise ValueError(f"bad lookup answer: pages={pages!r}")
        tiers = [(str(t), int(n)) for t, n in obj.get("tiers", [])]
        kinds = {str(k): str(v) for k, v in obj.get("kinds", {}).items()}
        return cls(pages, tiers, kinds)

    def tier_pages(self, first: int, count: int) -> dict[str, int]:
        """Pages per tier among pages ``[first, first + count)``."""
        out: dict[str, int] = {}
        pos = 0
        for tier, n in self.tiers:
            lo, hi = max(pos, first), min(pos + n, first + count)
            if hi > lo:
                out[tier] = out.get(tier, 0) + hi - lo
            pos += n
        return out

    def below_top(self, first: int, count: int) -> int:
        """Pages among ``[first, first + count)`` held below the top tier (``kinds``
        names the worker's tiers top first; an answer without them counts none)."""
        top = next(iter(self.kinds), None)
        if top is None:
            return 0
        return sum(n for t, n in self.tier_pages(first, count).items() if t != top)


def socket_path(directory: Path, engine_id: str, dp_rank: int, rank: int) -> Path:
    """The lookup socket of one worker (``rank`` = pp_rank * tp_size + tp_rank)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return directory / f"{safe}-dp{dp_rank}-r{rank}.sock"


Answerer = Callable[[np.ndarray, int, str], Awaitable[LookupAnswer]]


class LookupServer:
    """Serves lookups on a Unix socket from the worker's event loop.

    ``answer(tokens, flags, scope)`` runs on the loop for each request; an exception there
    answers ``pages = 0`` (a miss) and is logged."""

    def __init__(self, path: Path, answer: Answerer) -> None:
        self.path = path
        self._answer = answer
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._inode: int | None = None  # the socket file this server bound
        self.served = 0

    async def start(self) -> None:
        """Bind the socket (a stale socket file left by a dead process is replaced)."""
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_socket()):
            raise FileExistsError(f"{self.path} exists and is not a socket; not replacing it")
        if self.path.exists() and _socket_alive(self.path):
            raise FileExistsError(
                f"another kvtier worker is serving lookups on {self.path} (two engines with "
                f"one engine_id and runtime directory?): give each engine its own "
                f"kv_transfer_config.engine_id or kvtier_runtime_dir"
            )
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket of a dead process
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)
        self._inode = self.path.lstat().st_ino

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        try:
            while True:
                try:
                    head = await reader.readexactly(REQUEST.size)
                except asyncio.IncompleteReadError:
                    return
                magic, n, flags, scope_bytes = REQUEST.unpack(head)
                if magic != REQUEST_MAGIC or n > MAX_TOKENS or scope_bytes > MAX_SCOPE_BYTES:
                    _log.warning(
                        "bad lookup request; closing", magic=magic, tokens=n, scope=scope_bytes
                    )
                    return
                raw_scope = await reader.readexactly(scope_bytes)
                tokens = np.frombuffer(await reader.readexactly(4 * n), dtype="<u4")
                try:
                    scope = raw_scope.decode("utf-8", "surrogatepass")
                    ans = await self._answer(tokens, flags, scope)
                except Exception as exc:  # a lookup that fails is a miss
                    _log.warning("lookup failed; answering a miss", error=repr(exc))
                    ans = LookupAnswer(0)
                body = ans.to_json()
                writer.write(RESPONSE.pack(RESPONSE_MAGIC, len(body)) + body)
                await writer.drain()
                self.served += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return
        finally:
            if task is not None:
                self._clients.discard(task)
            writer.close()

    async def close(self) -> None:
        """Stop serving: the socket is removed, open connections are closed."""
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.wait(list(self._clients), timeout=5.0)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            if self._inode is not None and self.path.lstat().st_ino == self._inode:
                self.path.unlink()  # ours: never another server's socket at this path


class LookupClient:
    """Blocking lookups against every rank's socket (from the scheduler's thread).

    :meth:`lookup` answers the smallest page count over the ranks, or ``None`` when a
    rank cannot be asked (no socket yet, refused, timed out, bad answer): the caller
    treats that as a miss. Connections are kept and re-made after an error; errors are
    logged once per outage."""

    def __init__(self, paths: Sequence[Path], timeout_s: float) -> None:
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self._socks: list[socket.socket | None] = [None] * len(self.paths)
        self._failing = False
        self.errors = 0

    def _connect(self, i: int) -> socket.socket:
        sock = self._socks[i]
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.paths[i]))
            except OSError:
                sock.close()
                raise
            self._socks[i] = sock
        return sock

    def _drop(self, i: int) -> None:
        sock = self._socks[i]
        self._socks[i] = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _ask(self, i: int, request: bytes) -> LookupAnswer:
        sock = self._connect(i)
        sock.sendall(request)
        head = _recv_exact(sock, RESPONSE.size)
        magic, size = RESPONSE.unpack(head)
        if magic != RESPONSE_MAGIC or size > _MAX_RESPONSE:
            raise ValueError(f"bad lookup response header {magic!r}")
        return LookupAnswer.from_json(_recv_exact(sock, size))

    def lookup(
        self, tokens: Sequence[int] | np.ndarray, flags: int = 0, scope: str = ""
    ) -> LookupAnswer | None:
        """The workers' answer for ``tokens`` in the namespace extended by ``scope``
        (:mod:`.scope`); ``None`` when no worker answered."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
            raise ValueError("token ids must fit in 32 bits")
        head = scope.encode("utf-8", "surrogatepass")
        if len(head) > MAX_SCOPE_BYTES:
            raise ValueError(f"a lookup scope holds at most {MAX_SCOPE_BYTES} bytes")
        request = (
            REQUEST.pack(REQUEST_MAGIC, ids.size, flags, len(head))
            + head
            + ids.astype("<u4").tobytes()
        )
        best: LookupAnswer | None = None
        for i in range(len(self.paths)):
            deadline = time.monotonic() + self.timeout_s
            ans: LookupAnswer | None = None
            for attempt in range(2):  # one retry on a fresh connection (worker restarted)
                try:
                    ans = self._ask(i, request)
                    break
                except (OSError, ValueError) as exc:
                    self._drop(i)
                    if attempt or time.monotonic() >= deadline:
                        self.errors += 1
                        if not self._failing:
                            _log.warning(
                                "kvtier lookup failed; prompts are misses until it answers",
                                socket=str(self.paths[i]),
                                error=repr(exc),
                            )
                            self._failing = True
                        return None
            assert ans is not None
            if best is None or ans.pages < best.pages:
                best = ans
        if self._failing:
            _log.info("kvtier lookup answers again")
            self._failing = False
        return best

    def close(self) -> None:
        for i in range(len(self._socks)):
            self._drop(i)


def _socket_alive(path: Path) -> bool:
    """Whether a server accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("lookup socket closed")
        buf += chunk
    return bytes(buf)


def lookup_answer_runs(tiers: Sequence[str]) -> list[tuple[str, int]]:
    """Run-length form of a per-page tier list."""
    runs: list[tuple[str, int]] = []
    for t in tiers:
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1] + 1)
        else:
            runs.append((t, 1))
    return runs
