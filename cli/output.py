"""Output conventions shared by every command.

* ``--json``: exactly one JSON object on stdout, nothing else there (logs go to stderr);
  a command that fails prints ``{"error": {"message", "type", "exit_code"}}`` there
  instead (the message also goes to stderr).
* otherwise: rich tables on stdout, progress bars on stderr. When stdout is not a terminal
  (a pipe or a file) tables keep their natural width instead of being cut to 80 columns
  (``$COLUMNS`` is not applied there), and messages are never hard-wrapped (a long path
  stays on one line).
* cells: sizes in binary units (:func:`size`), floats to 3 significant digits without
  exponents, counts with thousands separators.
* exit codes: 0 success, 1 failure (:class:`~kvtier.errors.KVTierError`, an ``OSError``,
  anything unexpected), 2 usage error (:class:`~kvtier.errors.KVTierUsageError`, bad
  options). No command ends with a traceback.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.errors import KVTierError, KVTierUsageError
from kvtier.spec import KVSpec

EXIT_FAILURE = 1
EXIT_USAGE = 2

#: Width of output that does not go to a terminal: wide enough for any table.
PIPE_WIDTH = 1000


class _Console(Console):
    """A console whose width, when its stream is not a terminal, is :data:`PIPE_WIDTH`
    rather than 80 columns (or ``$COLUMNS``, which describes a terminal, not a pipe)."""

    @property
    def size(self) -> ConsoleDimensions:
        real = super().size
        if self.is_terminal:
            return real
        return ConsoleDimensions(PIPE_WIDTH, real.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


console = _Console()
err_console = _Console(stderr=True)


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


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-Infinity, which JSON has no words for)
    replaced by ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def dumps(data: Any) -> str:
    """JSON text of ``data`` (bytes as hex, numpy scalars as numbers, non-finite floats as
    ``null``): always strict JSON, as ``--json`` promises."""
    text = json.dumps(data, default=_default, sort_keys=False)
    if "NaN" in text or "Infinity" in text:  # rare: re-encode strictly
        text = json.dumps(_finite(json.loads(text)), sort_keys=False, allow_nan=False)
    return text


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
    """Compact human form of a cell value: floats to 3 significant digits (no exponent),
    large numbers with thousands separators."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 1e-3 or value == 0:
            return f"{value:.3g}"
        # small values in plain decimals too (0.00096, not 9.6e-04), 3 significant digits
        digits = 2 - math.floor(math.log10(abs(value)))
        return f"{value:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value)


def size(nbytes: Any) -> str:
    """A byte count in binary units (``512.0 MiB``); other values as :func:`fmt`."""
    if isinstance(nbytes, int | float) and not isinstance(nbytes, bool):
        from kvtier.config import format_size

        return format_size(int(nbytes))
    return fmt(nbytes)


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
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def report_failures(problems: Sequence[str]) -> None:
    """After a command's report is out: each of ``problems`` on stderr, then exit 1 (the
    report on stdout stays the only JSON object there). Nothing when there is none."""
    for line in problems[:-1]:
        err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if problems:
        raise fail(problems[-1], EXIT_FAILURE)


def json_error(message: str, kind: str, code: int) -> None:
    """Print the JSON error object of a failed ``--json`` command on stdout."""
    error = {"message": message, "type": kind, "exit_code": code}
    try:
        sys.stdout.write(dumps({"error": error}) + "\n")
        sys.stdout.flush()
    except OSError:  # stdout itself failed (full disk, closed pipe): stderr has the message
        pass


def _describe(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) for an exception a command let through."""
    if isinstance(exc, KVTierUsageError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, KVTierError):
        return str(exc), EXIT_FAILURE
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}", EXIT_FAILURE
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    return (
        f"unexpected {type(exc).__name__}: {exc} (a kvtier bug: please report it with the "
        "command that caused it)",
        EXIT_FAILURE,
    )


def given_options(ctx: typer.Context, names: Sequence[str]) -> list[str]:
    """The flags of the options ``names`` (parameter names, in that order) that the command
    line gave, whatever their value (``--tiers hbm`` or ``--no-hints``, equal to the
    default, count): for refusing, by name, the options that the mode a command runs in
    does not use. An option left to its default is not listed; an on/off pair is named
    as both (``--hints/--no-hints``)."""
    params = {p.name: p for p in ctx.command.params}
    out = []
    for name in names:
        # compared by name: typer carries its own copy of click's ParameterSource
        source = getattr(ctx.get_parameter_source(name), "name", "DEFAULT")
        if source not in ("DEFAULT", "DEFAULT_MAP"):
            param = params[name]
            other = getattr(param, "secondary_opts", None)  # --hints/--no-hints
            out.append(f"{param.opts[0]}/{other[0]}" if other else param.opts[0])
    return out


def run_guarded(fn: Callable[[], None], as_json: bool = False) -> None:
    """Run a command body, mapping errors to a message (and, with ``as_json``, a JSON
    error object on stdout) and exit codes 2 (usage) / 1 (anything else)."""
    try:
        fn()
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as exc:
        message, code = _describe(exc)
        if as_json:
            json_error(message, type(exc).__name__, code)
        raise fail(message, code) from None


def render_config(
    config: dict[str, Any],
    disk_dir: str | None = None,
    tier_metrics: dict[str, dict[str, Any]] | None = None,
) -> None:
    """The configuration a run used: model, page size, and each tier's backend, capacity
    (bytes and pages), watermarks and directory. With ``tier_metrics`` (a report's
    ``metrics.tiers``) the pages are the cache's own count (a store's pages take more
    than their payload: an NVMe tier of 1 GiB in 512-byte pages holds 1 Mi pages, not
    the 8 Mi the bytes over the page size gave); a tier that did not open shows ``-``."""
    model = config["model"]
    page = KVSpec(**model).page_bytes
    rows = []
    for t in config["tiers"]:
        path = t["options"].get("path") or t["options"].get("url") or "-"
        if tier_metrics is not None:
            pages = tier_metrics.get(t["name"], {}).get("capacity_pages")
        else:
            pages = t["capacity"] // page if page else None
        rows.append(
            (
                t["name"],
                t["backend"],
                size(t["capacity"]),
                fmt(pages),
                f"{t['high_watermark']:.0%} / {t['low_watermark']:.0%}",
                path,
            )
        )
    title = (
        f"configuration: {model['name']}, {model['page_tokens']}-token pages of "
        f"{size(page)} ({model['dtype']}), {config['pipeline']['write_policy']}"
    )
    cols = ["tier", "backend", "capacity", "pages", "high / low", "where"]
    console.print(table(title, cols, rows))
