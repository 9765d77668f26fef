"""Several sequence managers versioned together (a target model and its draft model)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kvtier.errors import KVTierUsageError
from kvtier.sequences.manager import SequenceManager


class VersionedGroup:
    """Several managers (e.g. ``{"target": ..., "draft": ...}``) versioned together.

    Sequence ids are the group's own; each maps to one sequence per manager. Every
    operation applies to all managers; a version covers all of them.

    Raises:
        KVTierUsageError: no managers, or two managers over one cache or one namespace:
            pages are keyed by content and namespace, so the second's pages would be
            the first's (a draft model would read the target's KV).
    """

    def __init__(self, managers: Mapping[str, SequenceManager]) -> None:
        if not isinstance(managers, Mapping) or not managers:
            raise KVTierUsageError(
                "VersionedGroup needs a mapping of at least one name to a SequenceManager, "
                f"got {managers!r}"[:200]
            )
        seen: dict[object, str] = {}
        for name, manager in managers.items():
            if not isinstance(manager, SequenceManager):
                raise KVTierUsageError(
                    f"VersionedGroup manager {name!r} must be a SequenceManager, got "
                    f"{type(manager).__name__}"
                )
            for what, thing in (("cache", id(manager.cache)), ("namespace", manager.namespace)):
                other = seen.setdefault((what, thing), name)
                if other != name:
                    raise KVTierUsageError(
                        f"VersionedGroup managers {other!r} and {name!r} share one {what}"
                        f"{f' ({manager.namespace.label})' if what == 'namespace' else ''}: "
                        "each model needs its own cache and namespace, or one model's "
                        "pages would be read as the other's"
                    )
        self.managers = dict(managers)
        self._seqs: dict[int, dict[str, int]] = {}
        self._versions: dict[tuple[int, int], dict[str, int]] = {}
        self._ids = itertools.count(1)

    def _members(self, seq_id: int) -> dict[str, int]:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KVTierUsageError(f"unknown sequence id {seq_id!r} in this group") from None

    def create(self) -> int:
        gid = next(self._ids)
        self._seqs[gid] = {name: m.create() for name, m in self.managers.items()}
        return gid

    def member(self, seq_id: int, name: str) -> int:
        """The id of ``seq_id`` in manager ``name``."""
        members = self._members(seq_id)
        if not isinstance(name, str) or name not in members:
            raise KVTierUsageError(f"no manager named {name!r} in this group: {sorted(members)}")
        return members[name]

    async def append(self, seq_id: int, tokens: Any, kv: Mapping[str, Any]) -> None:
        """Append ``tokens`` to every member, ``kv[name]`` being manager ``name``'s KV.

        All-or-nothing across managers: bad input or a full working pool in any of them
        raises before any changes (every manager's lock is held from check to write)."""
        members = self._members(seq_id)
        if not isinstance(kv, Mapping):
            raise KVTierUsageError(
                f"kv must map each manager's name to its KV, got {type(kv).__name__}"
            )
        if set(kv) != set(members):
            raise KVTierUsageError(f"kv must be given for {sorted(members)}, got {sorted(kv)}")
        work = [(self.managers[name], s, kv[name]) for name, s in members.items()]
        async with self._all_locked():
            ready = [(m, s, *m._prepare_append(s, tokens, k)) for m, s, k in work]
            for m, s, ids, t in ready:
                m._write_append(s, ids, t)
            for m, s, _, _ in ready:
                await m._publish(s)

    def fork(self, seq_id: int) -> int:
        members = self._members(seq_id)
        gid = next(self._ids)
        self._seqs[gid] = {name: self.managers[name].fork(s) for name, s in members.items()}
        for (g, v), per in list(self._versions.items()):
            if g == seq_id:
                self._versions[(gid, v)] = dict(per)
        return gid

    def snapshot(self, seq_id: int) -> int:
        members = self._members(seq_id)
        per = {name: self.managers[name].snapshot(s) for name, s in members.items()}
        vid = next(self._ids)
        self._versions[(seq_id, vid)] = per
        return vid

    @contextlib.asynccontextmanager
    async def _all_locked(self) -> AsyncIterator[None]:
        """Hold every manager's lock, so that checks and changes across managers are not
        interleaved with other operations (all-or-nothing group operations)."""
        locks = {id(m): m._lock for m in self.managers.values()}
        async with contextlib.AsyncExitStack() as stack:
            for key in sorted(locks):  # one global order: no deadlock between groups
                await stack.enter_async_context(locks[key])
            yield

    def _version(self, seq_id: int, version: int) -> dict[str, int]:
        per = self._versions.get((seq_id, version))
        if per is None:
            raise KVTierUsageError(
                f"version {version!r} of sequence {seq_id} is not live (already committed "
                "or rolled back, or never taken)"
            )
        return per

    def _take(self, seq_id: int, version: int) -> dict[str, int]:
        per = self._version(seq_id, version)
        # consuming a version consumes every newer one of the same sequence
        for g, v in [k for k in self._versions if k[0] == seq_id and k[1] >= version]:
            del self._versions[(g, v)]
        return per

    async def rollback(self, seq_id: int, version: int) -> int:
        """Roll every manager back to the version, with no await in between (a group
        snapshot never sees some managers rolled back and others not)."""
        members = self._members(seq_id)
        async with self._all_locked():
            per = self._take(seq_id, version)
            return sum(
                self.managers[name]._rollback_tables(s, per[name]) for name, s in members.items()
            )

    async def commit(self, seq_id: int, version: int, keep: int | None = None) -> int:
        """Commit the version in every manager. All-or-nothing: what any manager would
        raise (a bad ``keep``, no working slot for a copy) is raised before any commits,
        and every table is committed before the first store is awaited (a group snapshot
        never sees some managers committed and others not)."""
        members = self._members(seq_id)
        async with self._all_locked():
            per = self._version(seq_id, version)
            for name, s in members.items():
                self.managers[name].tables.check_commit(s, per[name], keep)
            self._take(seq_id, version)
            freed = sum(
                self.managers[name]._commit_tables(s, per[name], keep)
                for name, s in members.items()
            )
            for name, s in members.items():
                await self.managers[name]._publish(s)
        return freed

    async def free(self, seq_id: int) -> int:
        members = self._members(seq_id)
        del self._seqs[seq_id]
        for key in [k for k in self._versions if k[0] == seq_id]:
            del self._versions[key]
        freed = 0
        for name, s in members.items():
            freed += await self.managers[name].free(s)
        return freed
