"""Policies: what should be where (eviction, admission, prefetch, write).

Importing this package (or any module in it) registers every built-in eviction policy
with :func:`kvtier.policy.eviction.register_policy`, so config can name them
(``eviction = "session"``). Admission policies for selective write-through are
registered in :mod:`kvtier.policy.admission` (``admission = "reuse"``).
"""

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.admission import (
    FrequencyAdmission,
    ReusePredictor,
    make_admission,
    register_admission,
)
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.density import HitDensityPolicy
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy, register_policy
from kvtier.policy.hinted import HintedPolicy
from kvtier.policy.interval import IntervalPolicy
from kvtier.policy.prefix_aware import PrefixLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.session import SessionPolicy
from kvtier.policy.twoclass import TwoClassPolicy

for _cls in (
    ARCPolicy,
    S3FIFOPolicy,
    PrefixLRUPolicy,
    SessionPolicy,
    HitDensityPolicy,
    AdaptivePolicy,
    TwoClassPolicy,
    HintedPolicy,
    IntervalPolicy,
):
    register_policy(_cls.name, _cls)

__all__ = [
    "EVICTION_POLICIES",
    "ARCPolicy",
    "AdaptivePolicy",
    "FrequencyAdmission",
    "HintedPolicy",
    "HitDensityPolicy",
    "IntervalPolicy",
    "PrefixLRUPolicy",
    "ReusePredictor",
    "S3FIFOPolicy",
    "SessionPolicy",
    "TwoClassPolicy",
    "make_admission",
    "make_policy",
    "register_admission",
    "register_policy",
]
