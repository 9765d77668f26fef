"""asyncio helpers shared by backends and the transfer layer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


async def finish_before_raising(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every one of ``tasks`` is done, even when the caller is cancelled
    meanwhile (it is, typically: this runs before a CancelledError is re-raised). Used
    where work still running reads or writes a caller's buffers: the caller must not get
    control of them back (by the exception) while a thread still copies them. The tasks'
    own exceptions are retrieved, not raised."""
    pending = [t for t in tasks if not t.done()]
    if not pending:
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: the caller raises its own
        return
    done = asyncio.gather(*pending, return_exceptions=True)
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            continue  # cancelled again: the caller raises CancelledError anyway, after this
