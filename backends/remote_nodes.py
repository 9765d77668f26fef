"""Cluster nodes that failed moments ago: their pages miss at once instead of each batch
waiting on the same dead node.

A cluster store splits every batch by the node owning each key. When one master is down,
every batch of a call touches it; without this record each batch would try it again
(a refused connection is quick, a host that does not answer costs a deadline per batch).
A node that failed within ``window`` seconds and has not answered since is not asked
again: its items get the failure as their reply. Owned by the event-loop thread.
"""

from __future__ import annotations

import time

from .remote_datapath import Address


class NodeFailure(ConnectionError):
    """The reply of every item of one cluster node that failed (the other nodes of the
    batch may have answered): a miss for those items, and an outage of the store, but not
    a failed batch (the rest of the call goes on to the live nodes)."""

    def __init__(self, address: Address, message: str) -> None:
        super().__init__(f"node {address[0]}:{address[1]}: {message}")
        self.address = address


class DownNodes:
    """Per node, when it last failed and why, until it answers again."""

    def __init__(self) -> None:
        self._failed: dict[Address, tuple[float, NodeFailure]] = {}

    def failed(self, failure: NodeFailure) -> None:
        """Record ``failure`` of its node now."""
        self._failed[failure.address] = (time.monotonic(), failure)

    def answered(self, address: Address) -> None:
        """The node at ``address`` answered: ask it again from now on."""
        self._failed.pop(address, None)

    def recent(self, address: Address, window: float) -> NodeFailure | None:
        """The failure of the node at ``address`` when it is under ``window`` seconds old
        and the node has not answered since; else ``None`` (ask the node)."""
        seen = self._failed.get(address)
        if seen is None or time.monotonic() - seen[0] >= window:
            return None
        return seen[1]
