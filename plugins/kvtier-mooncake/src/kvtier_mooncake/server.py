"""A Mooncake Store deployment on 127.0.0.1 for tests and benchmarks.

:class:`MooncakeCluster` starts

* ``mooncake_master`` (the binary shipped in the ``mooncake`` wheel) with its RPC and
  metrics listeners on 127.0.0.1 (both default to ``0.0.0.0``, every interface);
* an HTTP metadata server on 127.0.0.1. By default this is Mooncake's Python one
  (``mooncake.http_metadata_server --host 127.0.0.1``) because the master's *built-in*
  metadata server (``--enable_http_metadata_server``) binds ``0.0.0.0`` whatever
  ``--http_metadata_server_host`` says (measured with mooncake-transfer-engine-non-cuda
  0.3.13.post1), exposing an unauthenticated metadata store to the network.
  ``metadata="builtin"`` uses the built-in one anyway;
* one *pool* process (``python -m kvtier_mooncake.pool``) that mounts ``pool_bytes`` of
  memory into the store, so that pages outlive the clients that put them (a client's own
  segment disappears when it closes).

Clients' transfer engines (the pool's and every store's) listen on all interfaces on
ports of their choosing (an RPC listener and the TCP transport's): Mooncake 0.3.13 has no
setting to bind them to one address (``MC_RDMA_BIND_ADDRESS`` covers RDMA only,
``MC_TCP_BIND_ADDRESS`` does not move the listeners, ``MC_LEGACY_RPC_PORT_BINDING=1``
breaks the TCP handshake). Everything else this deployment starts listens on 127.0.0.1.

Leaving the ``with`` block stops both (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Literal, Self

from kvtier.testing.freeze import freeze, thaw


def master_binary() -> str:
    """Path of ``mooncake_master``; raises :class:`RuntimeError` naming what is missing."""
    try:
        import mooncake
    except ImportError as exc:
        raise RuntimeError(
            "the mooncake package is not installed "
            "(pip install 'kvtier-mooncake[tcp]' for mooncake-transfer-engine-non-cuda)"
        ) from exc
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        found = shutil.which("mooncake_master")
        if found is None:
            raise RuntimeError(f"mooncake_master not found next to {mooncake.__file__}")
        return found
    return str(path)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (each socket is held until all are
    chosen: one at a time, the kernel could hand out one port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MooncakeCluster:
    """``mooncake_master`` + one memory pool process, all on 127.0.0.1.

    Args:
        pool_bytes: memory the pool process contributes to the store.
        lease_ms: the master's ``default_kv_lease_ttl``: how long a read protects an
            object from removal (Mooncake's default is 10 s; removals inside it fail). It
            must outlast the slowest batch transfer: a read still running when its lease
            ends fails (``LEASE_EXPIRED``, -707).
    """

    def __init__(
        self,
        pool_bytes: int = 256 << 20,
        lease_ms: int = 200,
        metadata: Literal["python", "builtin"] = "python",
    ) -> None:
        if metadata not in ("python", "builtin"):
            raise ValueError(f"metadata must be 'python' or 'builtin', got {metadata!r}")
        self.metadata = metadata
        self.binary = master_binary()
        self.pool_bytes = pool_bytes
        self.lease_ms = lease_ms
        self.rpc_port, self.http_port, self.metrics_port = _free_ports(3)
        self._started = False
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
        self._master: subprocess.Popen[bytes] | None = None
        self._pool: subprocess.Popen[bytes] | None = None
        self._meta: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def options(self) -> dict[str, str]:
        """Backend options pointing a :class:`~kvtier_mooncake.store.MooncakeStore` here."""
        return {"master": self.master_address, "metadata_server": self.metadata_server}

    def start_master(self) -> None:
        """Start the metadata server and ``mooncake_master``; wait until both answer. A
        first start that finds one of its ports taken meanwhile (another process bound it
        after it was chosen) is tried again, twice, on new ports; a restart keeps them."""
        for attempt in range(3):
            try:
                self._start_master()
            except RuntimeError as exc:
                if self._started or attempt == 2 or "Address already in use" not in str(exc):
                    raise
                self._stop(self._master)
                self._stop(self._meta)
                self._master = self._meta = None
                (self._dir / "master.log").unlink(missing_ok=True)
                self.rpc_port, self.http_port, self.metrics_port = _free_ports(3)
            else:
                self._started = True
                return

    def _start_master(self) -> None:
        log = open(self._dir / "master.log", "ab")  # noqa: SIM115 - owned by the process
        args = [
            self.binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]
        if self.metadata == "builtin":
            args += [
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]
        elif self._meta is None or self._meta.poll() is not None:
            self._meta = subprocess.Popen(
                [sys.executable, "-m", "mooncake.http_metadata_server",
                 "--host", "127.0.0.1", "--port", str(self.http_port), "--log-level", "ERROR"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self._master = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self._dir
        )
        log.close()
        self._wait(lambda: _port_open(self.rpc_port) and self._http_up(), "mooncake_master")

    def _http_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.metadata_server}?key=probe", timeout=0.5):
                return True
        except urllib.error.HTTPError:
            return True  # 404 for an unknown key: the server answers
        except OSError:
            return False

    def start_pool(self) -> None:
        ready = self._dir / "pool.ready"
        log = open(self._dir / "pool.log", "ab")  # noqa: SIM115 - owned by the process
        env = dict(os.environ, GLOG_minloglevel="2")
        self._pool = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier_mooncake.pool",
                "--master",
                self.master_address,
                "--metadata-server",
                self.metadata_server,
                "--bytes",
                str(self.pool_bytes),
                "--ready-file",
                str(ready),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()
        self._wait(ready.exists, "mooncake pool")

    def _wait(self, ok: object, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in (self._master, self._pool, self._meta):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with {proc.returncode}: {self.logs()}")
            if ok():  # type: ignore[operator]
                return
            time.sleep(0.05)
        raise TimeoutError(f"{what} did not start within {timeout:g} s: {self.logs()}")

    def logs(self) -> str:
        return "".join(
            p.read_text(errors="replace")[-1500:]
            for p in (self._dir / "master.log", self._dir / "pool.log")
            if p.exists()
        )

    @property
    def pool_pid(self) -> int | None:
        """Process id of the pool process, ``None`` when it is not running."""
        return self._pool.pid if self._pool is not None and self._pool.poll() is None else None

    def pause_pool(self) -> None:
        """Freeze the pool process (SIGSTOP): transfers from its memory stall unanswered.

        Returns once every thread of the pool is stopped (see :func:`kvtier.testing.freeze.freeze`).
        """
        if self._pool is not None:
            freeze(self._pool.pid)

    def resume_pool(self) -> None:
        """Undo :meth:`pause_pool`."""
        if self._pool is not None:
            thaw(self._pool.pid)

    def stop_master(self) -> None:
        """Stop ``mooncake_master`` only (the metadata server and pool stay)."""
        self._stop(self._master)
        self._master = None

    def close(self) -> None:
        try:
            self._stop(self._pool)
            self._stop(self._master)
            self._stop(self._meta)
        finally:
            self._pool = self._master = self._meta = None
            shutil.rmtree(self._dir, ignore_errors=True)

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            thaw(proc.pid)  # a paused process cannot handle SIGTERM
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Self:
        try:
            self.start_master()
            self.start_pool()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
