"""Policies: what should be where (eviction, admission, prefetch, write).

Importing this package registers every built-in eviction policy with
:func:`kvtier.policy.eviction.register_policy`, so config can name them.
"""

from kvtier.policy.arc import ARCPolicy
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy, register_policy
from kvtier.policy.prefix_aware import PrefixLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.session import SessionPolicy

for _cls in (ARCPolicy, S3FIFOPolicy, PrefixLRUPolicy, SessionPolicy):
    register_policy(_cls.name, _cls)

__all__ = [
    "EVICTION_POLICIES",
    "ARCPolicy",
    "PrefixLRUPolicy",
    "S3FIFOPolicy",
    "SessionPolicy",
    "make_policy",
    "register_policy",
]
