"""The ``kvtier`` command: ``kvtier inspect ...`` and ``kvtier bench ...``.

Each command lives in its own module under ``kvtier.cli`` and registers itself on
:data:`inspect_app` or :data:`bench_app` when imported below. The CLI is the only layer
that prints.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvtier",
    help="A memory hierarchy for LLM KV caches: inspect tiers and benchmark them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
inspect_app = typer.Typer(
    help="Show backends, topology, store contents, config, stats.", no_args_is_help=True
)
bench_app = typer.Typer(
    help="Benchmarks: tier I/O, live workloads, trace simulation.", no_args_is_help=True
)
app.add_typer(inspect_app, name="inspect")
app.add_typer(bench_app, name="bench")


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
    main()
