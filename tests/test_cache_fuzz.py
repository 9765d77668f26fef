"""A few seeds of the concurrent KVCache fuzz (tests/cache_fuzz.py): random hierarchies,
policies and calls from several tasks; no wrong byte, no unexpected error, no failed
background task, no hang, and every page found after a reopen reads back right.
Longer runs: ``.venv/bin/python tests/cache_fuzz.py 0 800``."""

from __future__ import annotations

import pytest
from cache_fuzz import run_one


@pytest.mark.parametrize("seed", range(32))
async def test_concurrent_calls_on_a_random_hierarchy(seed: int) -> None:
    seen = await run_one(seed)
    assert seen["store"] > 0 and seen["read"] + seen["load"] > 0
