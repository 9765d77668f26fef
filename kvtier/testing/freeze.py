"""Freeze and thaw a test server process, waiting until the freeze has taken hold.

``os.kill(pid, SIGSTOP)`` only queues the signal: each thread of the target stops the next
time it passes from the kernel back to user space. A thread that is already running (on a
loaded machine, one the scheduler has not got round to stopping yet) can still answer a
request sent just after ``os.kill`` returned, and a test that expects "the server answers
nothing" then fails now and then. :func:`freeze` returns only once every thread of the
process reports the stopped state in ``/proc/<pid>/task/*/stat``.

Nothing here is imported by the library itself.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

#: Thread states (field 3 of ``/proc/<pid>/task/<tid>/stat``) that mean "stopped".
_STOPPED = {"T", "t"}


def thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid``; empty when ``/proc`` cannot tell."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread exited meanwhile
            continue
        # the command name (field 2) is in parentheses and may hold spaces
        states.append(text[text.rindex(")") + 2])
    return states


def freeze(pid: int, timeout_s: float = 5.0) -> None:
    """Send SIGSTOP to ``pid`` and wait until all its threads are stopped.

    If they are not all stopped within ``timeout_s`` (a process that has exited and not
    been reaped never stops), it sends SIGCONT, so the process is not left half frozen, and
    raises :class:`TimeoutError` naming the process and its threads' states. Where
    ``/proc`` is not available (not Linux) it returns after sending the signal, as
    ``os.kill`` does; a ``pid`` that does not exist raises :class:`ProcessLookupError`.
    """
    os.kill(pid, signal.SIGSTOP)
    if not Path(f"/proc/{pid}/task").is_dir():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(s in _STOPPED for s in states):
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGCONT)
            raise TimeoutError(
                f"process {pid} was sent SIGSTOP but not all of its threads stopped within "
                f"{timeout_s:g} s (thread states: {''.join(sorted(states))})"
            )
        time.sleep(0.001)


def thaw(pid: int) -> None:
    """Undo :func:`freeze` (SIGCONT)."""
    os.kill(pid, signal.SIGCONT)
