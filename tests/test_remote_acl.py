"""An ACL user the server denies kvtier's key prefix is named, with the fix: the tier
fails with ``NOPERM`` and the prefix to allow. Before, every reservation answered "no
room" and every write "refused", so the tier looked healthy and full: stores went
nowhere below, the log said only "flush could not write every dirty page down" and
``inspect config --check`` guessed "(full, unreachable?)" (a docs-only probe)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis
from kvtier.backends.remote import RedisStore

from kvtier.errors import TierIOError
from kvtier.keys import Namespace, page_keys
from kvtier.testing.servers import RedisServer, unavailable_reason

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)


async def test_a_key_prefix_the_acl_denies_is_named() -> None:
    keys = page_keys(np.arange(4 * 16), Namespace("acl-test", page_tokens=16))
    pages = [np.zeros(512, np.uint8)] * 4
    with RedisServer("valkey") as server:
        redis.Redis.from_url(server.url).execute_command(
            "ACL", "SETUSER", "other", "on", ">opw", "~zzz:*", "+@all"
        )
        prefix = f"t-{uuid.uuid4().hex[:8]}"
        store = RedisStore(
            page_bytes=512,
            capacity_pages=8,
            url=server.url,
            key_prefix=prefix,
            username="other",
            password="opw",
            op_timeout_s=2.0,
        )
        await store.open()
        try:
            for call in (lambda: store.reserve(keys), lambda: store.put(keys, pages)):
                with pytest.raises(TierIOError, match=f"NOPERM.*'~{prefix}:\\*'.*key_prefix"):
                    await call()
        finally:
            await store.close()
