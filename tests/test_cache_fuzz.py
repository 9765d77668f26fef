"""A few seeds of the concurrent KVCache fuzz (tests/cache_fuzz.py): random hierarchies
(a Valkey tier in some, when valkey-server is here), policies and calls from several
tasks; no wrong byte, no unexpected error, no failed background task, no hang, and every
page found after a reopen reads back right. Longer runs:
``.venv/bin/python tests/cache_fuzz.py 0 800``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cache_crash_fuzz import crash_one
from cache_fuzz import run_one

from kvtier.testing.servers import RedisServer, unavailable_reason


@pytest.fixture(scope="module")
def valkey() -> Iterator[RedisServer | None]:
    """A Valkey server for the runs that draw a remote tier (None: no server here, and
    those runs keep their file stores)."""
    if unavailable_reason("valkey"):
        yield None
        return
    with RedisServer("valkey") as server:
        yield server


@pytest.mark.parametrize("seed", range(32))
async def test_concurrent_calls_on_a_random_hierarchy(
    seed: int, valkey: RedisServer | None
) -> None:
    seen = await run_one(seed, valkey.url if valkey else None)
    assert seen["store"] > 0 and seen["read"] + seen["load"] > 0


async def test_concurrent_calls_through_remote_outages(valkey: RedisServer | None) -> None:
    """Four runs with a remote tier whose server is restarted (its data lost) or frozen
    at random while the calls run: misses, never a wrong byte, an escaped error or a
    hang."""
    if valkey is None:
        pytest.skip(unavailable_reason("valkey") or "no valkey-server")
    runs = outages = 0
    for seed in range(1000, 1100):
        seen = await run_one(seed, valkey.url, 90.0, valkey)
        if seen["remote outages"]:
            runs += 1
            outages += seen["remote outages"]
        if runs == 4:
            break
    assert runs == 4 and outages >= 4


async def test_a_killed_cache_reopens_without_a_wrong_byte() -> None:
    """tests/cache_crash_fuzz.py, 4 seeds: calls from several tasks in a child process
    killed with SIGKILL; the reopened stores serve right bytes or misses, and take new
    pages."""
    found = sum([(await crash_one(seed))["pages after the kill"] for seed in range(4)], 0)
    assert found > 0  # the kills came after pages reached disk (each child flushed first)
