"""Running the backend conformance suite: one call, or one pytest case per rule.

The cases themselves live in :mod:`kvtier.testing.cases`; each checks one rule of the
contract in :mod:`kvtier.backend` against a fresh backend built by the caller's factory.

One call::

    report = await check_backend(lambda: MyStore(page_bytes=4096, capacity_pages=16,
                                                 path=tmp), persistent=True)

raises :class:`ConformanceError` listing every failed case, or returns a
:class:`ConformanceReport`. The pytest form (one test per case)::

    @pytest.mark.parametrize("case", conformance_cases(), ids=str)
    async def test_conformance(case, tmp_path):
        result = await case.run(lambda: MyStore(page_bytes=4096, capacity_pages=16,
                                                path=tmp_path), persistent=True)
        if result.skipped:
            pytest.skip(result.detail)

The factory takes no arguments and returns a backend that is not yet opened (or an
awaitable of one); it is called once per case, and again within a case to reopen a
persistent backend. Give it small pages (a few KiB) and ``capacity_pages`` >= 8. **Every
case starts by deleting every key the backend holds**: point it at scratch space.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.backend import Backend

#: A zero-argument callable returning an unopened backend (or an awaitable of one).
BackendFactory = Callable[[], Backend | Awaitable[Backend]]
#: Makes the pages the cases store: ``(rng, count, page_bytes) -> count uint8 pages``.
#: The default is random bytes; a backend that only keeps certain pages byte for byte (a
#: lossy codec keeps its own decoded pages exactly) passes pages it keeps.
PageSource = Callable[[np.random.Generator, int, int], list[np.ndarray]]

#: Seconds one case may take before it counts as a hang.
DEFAULT_CASE_TIMEOUT_S = 30.0


class ConformanceError(AssertionError):
    """A backend broke a rule of the contract; the message names the case(s) and why."""


class CaseSkipped(Exception):
    """Raised inside a case that does not apply to the backend (with the reason)."""


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case that did not fail."""

    name: str
    skipped: bool
    detail: str
    seconds: float


@dataclass(frozen=True)
class ConformanceReport:
    """What :func:`check_backend` ran: passed and skipped cases, and the time it took."""

    backend: str
    passed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def cases_run(self) -> int:
        return len(self.passed)


async def build(factory: BackendFactory) -> Backend:
    """Call the factory and check it gave an unopened backend."""
    made = factory()
    backend = await made if inspect.isawaitable(made) else made
    if not isinstance(backend, Backend):
        raise ConformanceError(f"factory returned {type(backend).__name__}, not a kvtier Backend")
    return backend


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
        from kvtier.testing.cases import CaseContext

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
            raise ConformanceError(f"{self.name}: unexpected {exc!r}") from exc
        finally:
            await ctx.cleanup()
        return CaseResult(self.name, False, self.rule, time.perf_counter() - start)


def conformance_cases() -> list[Case]:
    """Every case of the suite, in order (arena-only and persistence cases skip
    themselves where they do not apply)."""
    from kvtier.testing.cases import CASES

    return list(CASES)


async def check_backend(
    factory: BackendFactory,
    *,
    persistent: bool = False,
    cases: Sequence[Case] | None = None,
    timeout_s: float = DEFAULT_CASE_TIMEOUT_S,
    pages: PageSource | None = None,
) -> ConformanceReport:
    """Run the whole suite (or ``cases``) against backends from ``factory``.

    ``persistent=True`` adds the check that committed pages survive close and reopen;
    ``pages`` replaces the random pages the cases store (see :data:`PageSource`).
    Returns the report when every case passed or skipped; otherwise raises
    :class:`ConformanceError` listing each failed case with its reason.
    """
    start = time.perf_counter()
    probe = await build(factory)
    name = type(probe).__name__
    passed: list[str] = []
    skipped: dict[str, str] = {}
    failures: list[str] = []
    for case in cases if cases is not None else conformance_cases():
        try:
            result = await case.run(
                factory, persistent=persistent, timeout_s=timeout_s, pages=pages
            )
        except ConformanceError as exc:
            failures.append(str(exc))
            continue
        if result.skipped:
            skipped[case.name] = result.detail
        else:
            passed.append(case.name)
    if failures:
        raise ConformanceError(
            f"{name} failed {len(failures)} conformance case(s):\n  " + "\n  ".join(failures)
        )
    return ConformanceReport(name, passed, skipped, time.perf_counter() - start)
