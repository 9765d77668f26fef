"""A file store whose reads take ``delay_s`` longer: a stand-in for a slow tier (a remote
pool across a busy network, a loaded disk) in ``benchmarks/vllm_async_loads.py``.

Config: ``backend = "vllm_slow_store:SlowFileStore"`` with ``benchmarks/`` on
``PYTHONPATH`` and ``options = {path = "...", delay_s = 0.5}``. A benchmark aid, not a
backend to deploy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

from kvtier.backends.filestore import FileStore

from kvtier.errors import ConfigError
from kvtier.keys import PageKey


class SlowFileStore(FileStore):
    """:class:`FileStore`, each ``get`` delayed by ``delay_s`` seconds before it reads."""

    # the delay is a sleep before the read starts: a cancelled get still writes nothing
    get_finishes_before_raising: ClassVar[bool] = True

    def __init__(self, *, delay_s: float = 0.5, **options: Any) -> None:
        if isinstance(delay_s, bool) or not isinstance(delay_s, int | float) or delay_s < 0:
            raise ConfigError(f"SlowFileStore: delay_s must be a number >= 0, got {delay_s!r}")
        super().__init__(**options)
        self.delay_s = float(delay_s)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        await asyncio.sleep(self.delay_s)
        return await super().get(keys, out)
