"""Write policies: when a page stored in a tier is also written to the tier below.

* ``write-through``: every page stored in the top tier is copied down at once (in the
  background), and down again from each tier it lands in;
* ``write-back``: pages go down only when evicted (and when the cache is flushed or closed);
* ``selective``: like write-through, but only pages the admission policy admits go down;
  the others are dropped when evicted.

:class:`WritePolicy` is a string enum, so ``WritePolicy.WRITE_BACK == "write-back"`` and
configurations keep their plain string values. The planner
(:mod:`kvtier.plan.planner`) asks it; it decides nothing about room or victims.
"""

from __future__ import annotations

from enum import StrEnum

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import AdmissionPolicy


class WritePolicy(StrEnum):
    """When pages are written down the hierarchy (see the module docstring)."""

    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"
    SELECTIVE = "selective"

    @classmethod
    def parse(cls, value: object, key: str = "pipeline.write_policy") -> WritePolicy:
        """``value`` as a write policy; :class:`ConfigError` naming ``key`` otherwise."""
        for policy in cls:
            if value == policy.value:
                return policy
        raise ConfigError(f"{key}: must be one of {', '.join(WRITE_POLICIES)}, got {value!r}")

    @property
    def copies_on_store(self) -> bool:
        """Whether freshly stored pages are copied down at once (write-through, selective)."""
        return self is not WritePolicy.WRITE_BACK

    def sends_down(self, key: PageKey, admission: AdmissionPolicy) -> bool:
        """Whether ``key`` may be written to a lower tier (always, except for a page the
        admission policy refuses under ``selective``)."""
        return self is not WritePolicy.SELECTIVE or admission.admit(key)


#: The write policies by config name.
WRITE_POLICIES: tuple[str, ...] = tuple(p.value for p in WritePolicy)
