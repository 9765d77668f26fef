"""Room for the file descriptors a store keeps open.

The NVMe store keeps one descriptor per slab file open for as long as it runs. A store of
a thousand 1 GiB slabs meets the common soft limit of 1,024 open files, and then every
read of a later slab fails with ``EMFILE`` (pages kept, but misses forever). At open,
:func:`make_fd_room` raises the process's soft ``RLIMIT_NOFILE`` towards its hard limit
when the store will need more than is left (logged), and warns, naming the limit, when
even the hard limit is too low.
"""

from __future__ import annotations

import os
import resource
from typing import Any

#: Descriptors kept free for everything else the process opens (sockets, other files).
HEADROOM = 256


def open_descriptors() -> int:
    """Descriptors this process has open now (0 where ``/proc`` cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def make_fd_room(needed: int, what: str, log: Any) -> None:
    """Make sure ``needed`` more descriptors can be opened (plus :data:`HEADROOM`): raise
    the soft limit up to the hard one when it is short (an info line), else log a warning
    naming the limit and ``what`` needs them. Never lowers a limit, never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_descriptors() + needed + HEADROOM
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (OSError, ValueError):
            new = soft
        else:
            log.info("raised the open-file limit", what=what, soft_before=soft, soft=new)
    if new < want:
        log.warning(
            f"{what} needs about {needed} open files but the open-file limit is {new} "
            f"(hard limit {hard}): reads and writes past it fail with 'too many open files'; "
            "raise the limit (ulimit -n) or use larger slab_bytes"
        )
