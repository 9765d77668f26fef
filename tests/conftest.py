"""Shared test set-up. Keep this minimal: fixtures of one test file live in that file.

``python -m pytest`` puts the repository root first on ``sys.path``, where the source
folder ``kvtier/`` would shadow the installed package: ``backends/`` and ``cli/`` import as
``kvtier.backends`` and ``kvtier.cli`` only through the (strict editable) install. So the
root is taken off ``sys.path`` before any test imports kvtier.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

_ROOT = Path(__file__).resolve().parent.parent


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == _ROOT
    except OSError:
        return False


sys.path[:] = [p for p in sys.path if not _is_root(p)]
for _name in [m for m in sys.modules if m == "kvtier" or m.startswith("kvtier.")]:
    _file = getattr(sys.modules[_name], "__file__", None) or ""
    if _file.startswith(str(_ROOT / "kvtier")):
        del sys.modules[_name]

pytest_plugins = ["hang_watch"]  # where a test that hangs waits (tests/hang_watch.py)


@pytest.fixture(autouse=True)
def logging_left_as_found() -> Iterator[None]:
    """A cache opened with ``log.level`` reconfigures structlog for the whole process: put
    it back after each test, or a later test's ``capture_logs`` sees nothing below that
    level (three NVMe fault tests failed after a test that opened a cache at "critical")."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
