"""One conformance case (:class:`Case`) and what it works with (:class:`CaseContext`):
fresh emptied backends from the caller's factory, random keys and pages, cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.backend import Backend
from kvtier.keys import PageKey
from kvtier.testing.kit import (
    DEFAULT_CASE_TIMEOUT_S,
    BackendFactory,
    CaseResult,
    CaseSkipped,
    ConformanceError,
    PageSource,
    build,
)

#: Cases that fill a backend skip it when it holds more pages than this.
MAX_FILL_PAGES = 4096
#: Holding the event loop this long in one stretch is tolerated (see loop_not_blocked).
LOOP_HOLD_FLOOR_S = 0.005


def expect(cond: object, what: str) -> None:
    """Fail the running case with ``what`` unless ``cond`` holds."""
    if not cond:
        raise ConformanceError(what)


async def cancel_after(call: Awaitable[object], turns: int) -> bool:
    """Run ``call`` as a task, cancel it after ``turns`` loop turns and wait for it to end;
    whether it ended cancelled (``False``: it finished first). Other exceptions raise."""
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


def empty_pages(b: Backend, n: int) -> list[np.ndarray]:
    """``n`` zeroed page buffers of ``b``'s page size (``get``'s ``out``)."""
    return [np.zeros(b.page_bytes, dtype=np.uint8) for _ in range(n)]


async def read_back(b: Backend, keys: Sequence[PageKey]) -> tuple[list[bool], list[np.ndarray]]:
    """``b.get(keys)`` into fresh buffers: the per-key hits and the buffers."""
    out = empty_pages(b, len(keys))
    return await b.get(keys, out), out


class CaseContext:
    """What a case works with: fresh backends, random pages and keys, and cleanup."""

    def __init__(
        self, factory: BackendFactory, *, persistent: bool, pages: PageSource | None = None
    ) -> None:
        self.factory = factory
        self.persistent = persistent
        self.rng = np.random.default_rng(20251129)
        self._open: list[Backend] = []
        self._source = pages

    async def backend(self, *, clear: bool = True) -> Backend:
        """A new backend from the factory, opened, and emptied unless ``clear=False``."""
        b = await build(self.factory)
        await b.open()
        self._open.append(b)
        if clear:
            old = await b.keys()
            answered = await b.delete(old) if old else []
            left = await b.keys()
            expect(
                left == [],
                f"emptying the backend before the case: delete() of the {len(old)} keys that "
                f"keys() listed answered {answered.count(True)} True, {answered.count(False)} "
                f"False, and keys() still lists {len(left)} (delete() must remove the pages "
                "it answers True for, and keys() list only committed pages)",
            )
        return b

    async def cleanup(self) -> None:
        """Close every backend the case opened (errors here are not the case's)."""
        for b in self._open:
            with contextlib.suppress(Exception):
                await b.close()
        self._open.clear()

    def keys(self, n: int) -> list[PageKey]:
        return [PageKey(self.rng.bytes(16)) for _ in range(n)]

    def pages(self, n: int, page_bytes: int) -> list[np.ndarray]:
        if self._source is not None:
            return self._source(self.rng, n, page_bytes)
        return [self.rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(n)]


@dataclass(frozen=True)
class Case:
    """One rule of the contract, checked against a fresh backend.

    Attributes:
        name: short identifier (used as the pytest id).
        rule: the rule checked, in one sentence.
        fn: the check; receives a :class:`~kvtier.testing.cases.CaseContext`.
    """

    name: str
    rule: str
    fn: Callable[..., Awaitable[None]]

    def __str__(self) -> str:
        return self.name

    async def run(
        self,
        factory: BackendFactory,
        *,
        persistent: bool = False,
        timeout_s: float = DEFAULT_CASE_TIMEOUT_S,
        pages: PageSource | None = None,
    ) -> CaseResult:
        """Run this case; raises :class:`ConformanceError` naming it when it fails.
        ``pages`` replaces the random pages the case stores (see :data:`PageSource`)."""
        start = time.perf_counter()
        ctx = CaseContext(factory, persistent=persistent, pages=pages)
        try:
            await asyncio.wait_for(self.fn(ctx), timeout_s)
        except CaseSkipped as exc:
            return CaseResult(self.name, True, str(exc), time.perf_counter() - start)
        except ConformanceError as exc:
            raise ConformanceError(f"{self.name}: {exc}") from exc
        except TimeoutError:
            raise ConformanceError(
                f"{self.name}: did not finish within {timeout_s:g} s (a hang?)"
            ) from None
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            raise ConformanceError(
                f"{self.name}: unexpected {exc!r}, raised in {where.name}() at "
                f"{where.filename}:{where.lineno} (a miss or a failed item is a False/None "
                "for that item, never an exception; only contains() raises, TierIOError, when "
                "it cannot tell; rule 1 of the backend guide)"
            ) from exc
        finally:
            await ctx.cleanup()
        return CaseResult(self.name, False, self.rule, time.perf_counter() - start)
