"""Output conventions shared by every command.

* ``--json``: exactly one JSON object on stdout, nothing else there (logs go to stderr).
* otherwise: rich tables on stdout, progress bars on stderr.
* exit codes: 0 success, 1 failure (:class:`~kvtier.errors.KVTierError`), 2 usage error
  (:class:`~kvtier.errors.KVTierUsageError`, bad options).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.errors import KVTierError, KVTierUsageError

EXIT_FAILURE = 1
EXIT_USAGE = 2

console = Console()
err_console = Console(stderr=True)


def _default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    return str(obj)


def dumps(data: Any) -> str:
    """JSON text of ``data`` (bytes as hex, numpy scalars as numbers)."""
    return json.dumps(data, default=_default, sort_keys=False)


def emit(data: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> None:
    """Print ``data`` as one JSON object, or call ``render`` for the human form."""
    if as_json:
        sys.stdout.write(dumps(data) + "\n")
        sys.stdout.flush()
    else:
        render(data)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A rich table with string cells (floats to 3 significant digits)."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*(escape(fmt(v)) for v in row))  # cells are data, never rich markup
    return t


def fmt(value: Any) -> str:
    """Compact human form of a cell value."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


@contextmanager
def progress(
    enabled: bool, description: str, total: float | None
) -> Iterator[Callable[[float], None]]:
    """A progress bar on stderr (a no-op when ``enabled`` is false); yields ``advance``."""
    if not enabled:
        yield lambda _n: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def fail(message: str, code: int = EXIT_FAILURE) -> typer.Exit:
    """Print ``message`` on stderr and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def run_guarded(fn: Callable[[], None]) -> None:
    """Run a command body, mapping kvtier errors to messages and exit codes 2 / 1."""
    try:
        fn()
    except KVTierUsageError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except KVTierError as exc:
        raise fail(str(exc), EXIT_FAILURE) from None
