"""The backend conformance kit: check that a backend keeps the contract of
:mod:`kvtier.backend`.

One call runs every case::

    import kvtier.testing

    report = await kvtier.testing.check_backend(
        lambda: MyBackend(page_bytes=4096, capacity_pages=16), persistent=False
    )

It raises :class:`ConformanceError` (an ``AssertionError``) naming each failed case, or
returns a :class:`ConformanceReport`. For one pytest test per case, parametrize over
:func:`conformance_cases` (see :mod:`kvtier.testing.conformance` for the recipe).
:func:`kvtier.testing.model.backend_state_machine` adds a hypothesis state machine that
checks random call sequences against a model of the contract (needs ``hypothesis``).
"""

from kvtier.testing.conformance import (
    BackendFactory,
    Case,
    CaseResult,
    CaseSkipped,
    ConformanceError,
    ConformanceReport,
    PageSource,
    check_backend,
    conformance_cases,
)

__all__ = [
    "BackendFactory",
    "Case",
    "CaseResult",
    "CaseSkipped",
    "ConformanceError",
    "ConformanceReport",
    "PageSource",
    "check_backend",
    "conformance_cases",
]
