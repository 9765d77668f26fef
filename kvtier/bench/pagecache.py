"""Making disk reads hit the disk: flush and drop a directory's files from the page cache.

``/proc/sys/vm/drop_caches`` needs privileges a benchmark should not assume, so this uses
``fsync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every regular file under a path:
clean cached pages of those files are dropped, so the next read goes to the device.
"""

from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache(root: Path) -> int:
    """Flush and evict every regular file under ``root`` from the page cache.

    Returns how many files were dropped. Files that vanish or cannot be opened are skipped
    (a store may be rewriting them); a missing ``root`` drops nothing.
    """
    if not root.exists():
        return 0
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped
