"""Pages the pipeline did not put there: indexing what stores already hold.

A persistent store (NVMe, file) keeps its pages across restarts, and a shared store (a
remote pool) receives pages other processes commit. :func:`recover` indexes what every
store holds when the cache opens; :func:`index_shared` indexes the leading run of a
lookup's keys that shared tiers hold but this process does not know. Either way a page is
*adopted*: committed in the directory (so the prefix tree sees it) and told to the tier's
eviction policy through the planner, exactly as a page the pipeline moved there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.transfer.mover import Mover
from kvtier.transfer.tier import Tier, backend_failure


def adopt(
    mover: Mover, tier: Tier, key: PageKey, namespace: str = "", parent: PageKey | None = None
) -> bool:
    """Index ``key``, which ``tier``'s backend holds, as committed there; ``False`` (and no
    change) when the directory already knows it in that tier."""
    d = mover.directory
    if d.state(key, tier.name) is not None:
        return False
    d.reserve(key, tier.name, namespace, parent)
    d.commit(key, tier.name)
    mover.planner.landed(tier.index, key, parent)
    return True


async def recover(mover: Mover) -> int:
    """Index the pages every store already holds (e.g. after a restart); a store that
    fails to list them is recorded failing and skipped. Returns the pages indexed."""
    total = 0
    for tier in mover.tiers:
        if tier.is_arena:
            continue
        try:
            keys = await tier.backend.keys()
        except Exception as exc:
            tier.record_failure("recover", 0, exc)
            continue
        total += sum(adopt(mover, tier, k) for k in keys)
        mover.changed(tier)
    return total


async def index_shared(
    mover: Mover, keys: Sequence[PageKey], parent: PageKey, namespace: str
) -> int:
    """Index the leading run of ``keys`` that shared tiers hold but the directory does not
    know (committed there by another process); ``parent`` is the page before the first
    key. Returns how many were indexed; a tier that fails to answer is skipped (a miss,
    as always)."""
    shared = [t for t in mover.tiers if t.backend.shared]
    if not shared:
        return 0
    holder: list[Tier | None] = [None] * len(keys)
    for tier in shared:
        try:
            hits = await tier.backend.contains(list(keys))
        except BaseException as exc:
            if not backend_failure(exc) and not isinstance(exc, KVTierUsageError):
                raise
            tier.record_failure("lookup", len(keys), exc)
            continue
        for i, hit in enumerate(hits):
            if hit and holder[i] is None:
                holder[i] = tier
    added = 0
    prev = parent
    for k, owner in zip(keys, holder, strict=True):
        if owner is None:
            break
        added += adopt(mover, owner, k, namespace, prev)  # may have changed meanwhile
        prev = k
    if added:
        mover.changed(*shared)
    return added
