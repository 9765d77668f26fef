"""The ``kvtier`` command: ``kvtier inspect ...`` and ``kvtier bench ...``.

Each command lives in its own module under ``kvtier.cli`` and registers itself on
:data:`inspect_app` or :data:`bench_app` when imported below. The CLI is the only layer
that prints.

Help is plain text (flags show as flags: ``--json``, not ``--json <bool>``). Errors that
the option parser finds (a bad value, a missing argument) exit 2 with click's message; with
``--json`` on the command line they also print the JSON error object on stdout, like
every other failure (:mod:`kvtier.cli.output`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup


def _option_errors() -> tuple[type[Exception], ...]:
    """The option parser's error classes: typer's vendored click (typer >= 0.2x) and/or
    click itself (older typer)."""
    found: list[type[Exception]] = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(name).ClickException)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _aborts() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [typer.Abort]
    with contextlib.suppress(ImportError, AttributeError):
        found.append(importlib.import_module("click.exceptions").Abort)
    return tuple(found)


_OPTION_ERRORS = _option_errors()
_ABORTS = _aborts()


class _Group(TyperGroup):
    """Typer's group, with option-parsing errors reported as JSON under ``--json``."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, False, **extra)
        except _ABORTS:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        except _OPTION_ERRORS as exc:
            exit_code = int(getattr(exc, "exit_code", 2))
            if "--json" in argv:
                from kvtier.cli.output import json_error

                json_error(exc.format_message(), type(exc).__name__, exit_code)  # type: ignore[attr-defined]
            exc.show()  # type: ignore[attr-defined]
            sys.exit(exit_code)
        sys.exit(code if isinstance(code, int) else 0)


_PLAIN: dict[str, Any] = {"rich_markup_mode": None, "cls": _Group}

app = typer.Typer(
    name="kvtier",
    help="A memory hierarchy for LLM KV caches: inspect tiers and benchmark them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    **_PLAIN,
)
inspect_app = typer.Typer(
    help="Show backends, topology, store contents, config, a running cache's stats.",
    no_args_is_help=True,
    **_PLAIN,
)
bench_app = typer.Typer(
    help="Benchmarks: tier I/O, live workloads, trace simulation.",
    no_args_is_help=True,
    **_PLAIN,
)
app.add_typer(inspect_app, name="inspect")
app.add_typer(bench_app, name="bench")


def version() -> str:
    """The installed kvtier version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvtier")
    except PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        return "unknown"


def source_revision() -> str | None:
    """``git <commit>`` (``+modified`` when the work tree has changes) when kvtier runs
    from a git checkout of kvtier itself (an editable install), else ``None``: the version
    number alone does not move between revisions of a checkout."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or not (Path(top) / "kvtier" / "__init__.py").is_file():
        return None  # not a checkout, or some other project's (a venv inside it)
    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"git {commit}{'+modified' if changed else ''}"


def _print_version(value: bool) -> None:
    if value:
        rev = source_revision()
        typer.echo(f"kvtier {version()}{f' ({rev})' if rev else ''}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print kvtier's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
) -> None:
    """A memory hierarchy for LLM KV caches: inspect tiers and benchmark them."""


def _register_commands() -> None:
    """Import every command module; each registers on inspect_app / bench_app."""
    import importlib

    for module in _COMMAND_MODULES:
        importlib.import_module(f"kvtier.cli.{module}")


#: Command modules, one job each.
_COMMAND_MODULES: list[str] = [
    "inspect_backends",
    "bench_io",
    "inspect_config",
    "bench_run",
    "inspect_store",
    "bench_sim",
    "inspect_topology",
    "inspect_stats",
    "bench_codec",
    "inspect_codecs",
]


def get_app() -> typer.Typer:
    """The fully registered application (for ``typer.testing.CliRunner`` too)."""
    _register_commands()
    return app


def main() -> None:
    """Console-script entry point."""
    get_app()()


if __name__ == "__main__":
    # Run as ``python -m kvtier.cli.app``, this file is ``__main__``, and the command modules
    # register on the ``kvtier.cli.app`` module's groups: start that module's app.
    importlib.import_module("kvtier.cli.app").main()
