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

import time
from collections.abc import Sequence

from kvtier.testing.case import Case
from kvtier.testing.cases import CASES
from kvtier.testing.kit import (
    DEFAULT_CASE_TIMEOUT_S,
    BackendFactory,
    CaseResult,
    CaseSkipped,
    ConformanceError,
    ConformanceReport,
    PageSource,
    build,
)

__all__ = [
    "DEFAULT_CASE_TIMEOUT_S",
    "BackendFactory",
    "Case",
    "CaseResult",
    "CaseSkipped",
    "ConformanceError",
    "ConformanceReport",
    "PageSource",
    "build",
    "check_backend",
    "conformance_cases",
]


def conformance_cases() -> list[Case]:
    """Every case of the suite, in order (arena-only and persistence cases skip
    themselves where they do not apply)."""
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
    ``pages`` replaces the random pages the cases store (see :data:`PageSource`); a case
    still running after ``timeout_s`` fails as a hang (a backend whose calls never return
    costs that much per case: lower it to see such a backend fail sooner).
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
        first = next((f for f in failures if f.startswith("round_trip:")), None)
        if first is not None and len(failures) > 1:
            failures.append(
                "(round_trip hung: a backend call never returns, so the other cases may "
                f"only be waiting on it too; timeout_s={timeout_s:g} s per case)"
                if "did not finish within" in first
                else "(round_trip failed: pages do not read back as put, so the other cases' "
                "diagnoses may only be consequences of that; fix round_trip first)"
            )
        raise ConformanceError(
            f"{name} failed {len(failures)} conformance case(s):\n  " + "\n  ".join(failures)
        )
    return ConformanceReport(name, passed, skipped, time.perf_counter() - start)
