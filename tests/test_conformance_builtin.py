"""Every built-in backend that can run here passes the conformance kit, one test per case;
and the kit itself catches backends that break each rule."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.backends.dram import DramArena
from kvtier.backends.filestore import FileStore

from kvtier import registry
from kvtier.backend import Backend, Reservation
from kvtier.errors import CapacityError
from kvtier.keys import PageKey
from kvtier.testing import (
    Case,
    ConformanceError,
    check_backend,
    conformance_cases,
)

PAGE = 4096
CAPACITY = 16

#: Options each built-in needs besides page size and capacity (``tmp`` is a scratch dir).
#: A new built-in that needs options fails here until it is added.
OPTIONS: dict[str, Any] = {
    "file": lambda tmp: {"path": tmp / "store"},
    "nvme": lambda tmp: {"path": tmp / "nvme"},
}
#: Built-ins whose committed pages survive close and reopen.
PERSISTENT = {"file", "nvme"}
#: Built-ins covered by their own conformance tests (they need a server).
ELSEWHERE = {"redis": "needs a server: see tests/test_remote_conformance.py"}

BUILTINS = [i for i in registry.discover() if i.origin.startswith("entry point (kvtier ")]
CASES = conformance_cases()


def _factory(name: str, tmp: Path) -> Any:
    options = OPTIONS.get(name, lambda _tmp: {})(tmp)
    return lambda: registry.create(name, page_bytes=PAGE, capacity_pages=CAPACITY, **options)


def test_builtins_were_discovered() -> None:
    assert {"dram", "file"} <= {i.name for i in BUILTINS}


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("info", BUILTINS, ids=lambda i: i.name)
async def test_builtin_conformance(info: registry.BackendInfo, case: Case, tmp_path: Path) -> None:
    if not info.available:
        pytest.skip(f"{info.name} unavailable here: {info.reason}")
    if info.name in ELSEWHERE:
        pytest.skip(ELSEWHERE[info.name])
    result = await case.run(_factory(info.name, tmp_path), persistent=info.name in PERSISTENT)
    if result.skipped:
        pytest.skip(f"{case.name} does not apply to {info.name}: {result.detail}")


async def test_one_call_runs_the_whole_suite(tmp_path: Path) -> None:
    start = time.perf_counter()
    report = await check_backend(lambda: FileStore(page_bytes=PAGE, capacity_pages=8,
                                                   path=tmp_path), persistent=True)  # fmt: skip
    assert report.backend == "FileStore"
    assert set(report.passed) == {c.name for c in CASES} - {"arena_zero_copy"}
    assert set(report.skipped) == {"arena_zero_copy"}
    assert report.seconds <= time.perf_counter() - start


async def test_factory_may_be_async() -> None:
    async def make() -> Backend:
        return DramArena(page_bytes=PAGE, capacity_pages=8)

    report = await check_backend(make)
    assert "arena_zero_copy" in report.passed and "survives_reopen" in report.skipped


async def test_factory_must_return_a_backend() -> None:
    with pytest.raises(ConformanceError, match="not a kvtier Backend"):
        await check_backend(lambda: object())  # type: ignore[arg-type, return-value]


def test_conformance_error_is_an_assertion_error() -> None:
    assert issubclass(ConformanceError, AssertionError)


# -- the kit catches broken backends -----------------------------------------------------


class VisibleReservations(DramArena):
    """Breaks two-phase put: reserved keys show up in contains()."""

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        reserved = set(self._reserved.values())
        return [k in self._committed or k in reserved for k in keys]


class BlockingArena(DramArena):
    """Copies on the event loop thread, slowly (after yielding once, so only the length
    of the hold gives it away)."""

    async def _copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        await asyncio.sleep(0)
        time.sleep(0.03)
        for dst, src in pairs:
            dst[:] = src


class RaisingWhenFull(DramArena):
    """Raises instead of answering None when full."""

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        out = await super().reserve(keys, namespace)
        if any(r is None for r in out):
            raise CapacityError("full")
        return out


class Overwriting(DramArena):
    """Overwrites a committed key on put instead of keeping the first bytes."""

    async def put(
        self, keys: Sequence[PageKey], data: Sequence[Any], namespace: str = ""
    ) -> list[bool]:
        present = [k for k in keys if k in self._committed]
        await self.delete(present)
        return await super().put(keys, data, namespace)


class KeepsReference(DramArena):
    """Keeps the caller's buffer from write() and serves its current content."""

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        ok = await super().write(reservations, data)
        kept = self.__dict__.setdefault("kept", {})
        for r, d in zip(reservations, data, strict=True):
            kept[r.key] = d
        return ok

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        ok = await super().get(keys, out)
        kept = self.__dict__.get("kept", {})
        for k, o, hit in zip(keys, out, ok, strict=True):
            if hit and k in kept:
                o[:] = np.frombuffer(kept[k], np.uint8)
        return ok


class LeakyRacingCommits(DramArena):
    """Keeps the space of a reservation whose key was committed meanwhile."""

    leaked = 0

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self.leaked += sum(1 for r in reservations if r.key in self._committed)
        return await super().commit(reservations)

    def used_pages(self) -> int:
        return super().used_pages() + self.leaked


class DeleteAnswersTrue(DramArena):
    """Answers True for every key it is asked to delete, committed or not (as a store that
    reports "no error" instead of "removed" would)."""

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        await super().delete(keys)
        return [True] * len(keys)


class LaxWrite(DramArena):
    """Accepts buffers of any size in write() (truncating or padding them)."""

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        fixed = [np.resize(np.asarray(d, dtype=np.uint8), self.page_bytes) for d in data]
        return await super().write(reservations, fixed)


class ReopenForgets(DramArena):
    """A second open() reallocates the arena, losing committed pages."""

    async def open(self) -> None:
        if self._opened:
            await self.close()
        await super().open()


class ForgetfulStore(FileStore):
    """Claims persistence but forgets its index on reopen."""

    async def open(self) -> None:
        await super().open()
        self._index.clear()


def _arena(cls: type[DramArena]) -> Any:
    return lambda: cls(page_bytes=PAGE, capacity_pages=8)


@pytest.mark.parametrize(
    ("broken", "case"),
    [
        (VisibleReservations, "uncommitted_invisible"),
        (BlockingArena, "loop_not_blocked"),
        (RaisingWhenFull, "capacity_honoured"),
        (RaisingWhenFull, "abort_frees_space"),
        (Overwriting, "put_existing_is_noop"),
        (LaxWrite, "bad_buffers_rejected"),
        (KeepsReference, "write_keeps_no_reference"),
        (LeakyRacingCommits, "racing_commits_keep_one_page"),
        (DeleteAnswersTrue, "delete_spares_reservations"),
        (ReopenForgets, "open_close_idempotent"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
async def test_kit_catches_a_broken_rule(broken: type[DramArena], case: str) -> None:
    (selected,) = [c for c in CASES if c.name == case]
    with pytest.raises(ConformanceError, match=rf"^{case}: "):
        await selected.run(_arena(broken))
    # the healthy arena passes the same case
    assert not (await selected.run(_arena(DramArena))).skipped


async def test_kit_catches_lost_persistence(tmp_path: Path) -> None:
    def factory() -> FileStore:
        return ForgetfulStore(page_bytes=PAGE, capacity_pages=8, path=tmp_path)

    with pytest.raises(ConformanceError, match="survives_reopen: keys\\(\\) after reopen"):
        await check_backend(factory, persistent=True)


async def test_full_run_lists_every_failed_case() -> None:
    with pytest.raises(ConformanceError) as caught:
        await check_backend(_arena(RaisingWhenFull))
    message = str(caught.value)
    assert "RaisingWhenFull failed 2 conformance case(s)" in message
    assert "capacity_honoured:" in message and "abort_frees_space:" in message
    assert "round_trip" not in message


class DeleteKeepsStore(FileStore):
    """delete() answers True for a committed key but keeps the page."""

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        present = await self.contains(keys)
        return present


async def test_a_delete_that_keeps_pages_is_named_when_emptying(tmp_path: Path) -> None:
    """A persistent store holding a page from an earlier run is emptied before each case;
    when its delete() answers True but keeps the page, the failure says so (not just
    that keys() is not empty)."""
    async with FileStore(page_bytes=PAGE, capacity_pages=8, path=tmp_path) as first:
        key = PageKey(bytes(range(16)))
        assert await first.put([key], [np.zeros(PAGE, np.uint8)]) == [True]
    (case,) = [c for c in CASES if c.name == "round_trip"]
    with pytest.raises(ConformanceError, match=r"delete\(\) of the 1 keys.*1 True, 0 False.*"
                       r"still lists 1"):  # fmt: skip
        await case.run(
            lambda: DeleteKeepsStore(page_bytes=PAGE, capacity_pages=8, path=tmp_path),
            persistent=True,
        )


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (None, r"the factory must be a callable taking no arguments .* got NoneType"),
        (DramArena, r"argument: 'page_bytes'\): pass e\.g\. lambda: DramArena\("),
        (lambda size: DramArena(page_bytes=size, capacity_pages=8), r"callable with no arguments"),
        (lambda: "arena", r"factory returned str, not a kvtier Backend"),
    ],
    ids=["none", "the-class", "takes-an-argument", "not-a-backend"],
)
async def test_a_factory_that_is_not_one_is_named(factory: Any, message: str) -> None:
    """The usual mistakes of a first kit run (the class itself, a factory taking the page
    size) are named with the fix, not a TypeError from inside the kit."""
    with pytest.raises(ConformanceError, match=message):
        await check_backend(factory)
