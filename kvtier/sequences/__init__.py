"""The sequence manager an inference engine drives: block tables on top of a KVCache.

One :class:`SequenceManager` serves one namespace (one model's KV). It owns a *working
pool*: slots of the cache's top tier (an arena) reserved at open under private keys,
never committed, so the directory counts them as used but no lookup, eviction or
write-down ever sees them. Running sequences write their KV there. A page is stored in
the cache (published: visible to lookups, free to move down the hierarchy) only once it
is full and verified, and its working slot then goes back to the pool. Hence the
speculative-decoding guarantee: unverified tokens never leave the working pool, and a
rollback frees them by giving their slots back.

Operations (all checked; bad input raises a :class:`~kvtier.errors.KVTierUsageError`
subclass naming the problem):

* :meth:`create`, :meth:`adopt_prefix` (start from the longest cached prefix),
  :meth:`append` (tokens + their KV; chunked prefill is a series of
  appends: every full verified page is stored right away, so it may move down while
  later chunks run), :meth:`fork` (copy-on-write), :meth:`free`;
* :meth:`snapshot` / :meth:`rollback` / :meth:`commit` (see
  :mod:`kvtier.index.block_table`);
* :meth:`ensure_resident`: one batched load of every stored page the sequences need into
  the top tier, pinned until :meth:`release`; returns the packed int32 table. A page no
  tier can give back raises :class:`PageFaultError` naming it (nothing stays pinned, no
  partial table is returned); no room for the pages (all pinned) raises
  :class:`~kvtier.errors.CapacityError`.

:class:`VersionedGroup` keeps several managers (a target model and its draft model, each
with its own cache and namespace) in step: one snapshot, rollback or commit covers all.
"""

from kvtier.sequences.group import VersionedGroup
from kvtier.sequences.manager import SequenceManager
from kvtier.sequences.types import (
    WORKING_KEYS,
    WORKING_NAMESPACE,
    PageCache,
    PageFaultError,
    ResidentBatch,
    SequenceStats,
)

__all__ = [
    "WORKING_KEYS",
    "WORKING_NAMESPACE",
    "PageCache",
    "PageFaultError",
    "ResidentBatch",
    "SequenceManager",
    "SequenceStats",
    "VersionedGroup",
]
