"""The conformance kit's vocabulary: factories, errors, results and :func:`build`.

The bottom of :mod:`kvtier.testing`: :mod:`~kvtier.testing.case` (a case and what it works
with), :mod:`~kvtier.testing.cases` (the cases), :mod:`~kvtier.testing.conformance`
(running them) and :mod:`~kvtier.testing.model` (the state machine) build on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
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
    if not callable(factory):
        raise ConformanceError(
            f"the factory must be a callable taking no arguments that returns an unopened "
            f"backend (e.g. lambda: MyStore(page_bytes=4096, capacity_pages=16)), got "
            f"{type(factory).__name__}"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        what = factory.__name__ if isinstance(factory, type) else "MyStore"
        raise ConformanceError(
            f"the factory must be callable with no arguments ({exc}): pass e.g. "
            f"lambda: {what}(page_bytes=4096, capacity_pages=16)"
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin): call it and see
    made = factory()
    backend = await made if inspect.isawaitable(made) else made
    if not isinstance(backend, Backend):
        raise ConformanceError(f"factory returned {type(backend).__name__}, not a kvtier Backend")
    return backend
