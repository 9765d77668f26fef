"""kvtier.testing.freeze: a frozen process does nothing more once freeze() returns."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.freeze import freeze, thaw, thread_states

#: A child with four threads that each append to a file as fast as they can.
_BUSY = """
import sys, threading
out = open(sys.argv[1], "ab", buffering=0)
def spin():
    while True:
        out.write(b"x")
threads = [threading.Thread(target=spin, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    out = tmp_path / "out"
    out.touch()
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(out)])
    try:
        deadline = time.monotonic() + 10
        while out.stat().st_size == 0:  # running
            assert time.monotonic() < deadline, "the busy child never wrote"
            time.sleep(0.01)
        yield proc, out
    finally:
        thaw(proc.pid)
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_nothing_happens_after_freeze_returns(
    busy: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, out = busy
    for _ in range(5):
        freeze(proc.pid)
        size = out.stat().st_size
        time.sleep(0.1)
        assert out.stat().st_size == size  # no thread wrote after freeze() returned
        thaw(proc.pid)
        deadline = time.monotonic() + 10
        while out.stat().st_size == size:  # and thaw() lets them go on
            assert time.monotonic() < deadline, "the child did not resume"
            time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_process_that_never_stops_is_named(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while thread_states(proc.pid) != ["Z"]:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        # exited, not reaped: the pid stays ours, and a zombie never reaches "stopped"
        with pytest.raises(TimeoutError, match=rf"process {proc.pid} .*\(thread states: Z\)"):
            freeze(proc.pid, timeout_s=0.2)
    finally:
        proc.wait()


@pytest.mark.skipif(not Path("/proc/sys/kernel/pid_max").exists(), reason="needs Linux /proc")
def test_a_pid_that_cannot_exist_raises_process_lookup_error() -> None:
    beyond = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a process's pid
    with pytest.raises(ProcessLookupError):
        freeze(beyond)
