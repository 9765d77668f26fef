"""Moved: the CUDA stream helpers live in :mod:`kvtier.cuda_streams` (the machine layer,
below both the backends and the transfer layer). This module re-exports them so that
``from kvtier.transfer.cuda_streams import ...`` keeps working."""

from kvtier.cuda_streams import (
    CopyStreams,
    EventLike,
    EventPoller,
    SlotOrdering,
    cupy_unavailable_reason,
    default_poller,
    pinned_host_array,
    require_cupy,
    unpin_host_array,
)

__all__ = [
    "CopyStreams",
    "EventLike",
    "EventPoller",
    "SlotOrdering",
    "cupy_unavailable_reason",
    "default_poller",
    "pinned_host_array",
    "require_cupy",
    "unpin_host_array",
]
