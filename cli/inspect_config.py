"""``kvtier inspect config``: the resolved configuration and where each value came from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import console, emit, run_guarded, size, table

from kvtier.config import load_config


def config_report(path: Path | None) -> dict[str, Any]:
    """The resolved config of ``path`` (or ``$KVTIER_CONFIG``, or the embedded default)
    with ``KVTIER_*`` overrides applied.

    Returns ``{"config": <file-shaped dict>, "values": [{"key", "value", "source"}, ...],
    "sources": {key: source}}``; a source is ``default``, ``file:PATH``, ``python`` or
    ``env:NAME``. Raises :class:`~kvtier.errors.ConfigError` naming a bad key or value.
    """
    resolved = load_config(path)
    # Model fields filled in from a preset carry no source of their own: they come from
    # wherever the preset was chosen.
    preset_source = resolved.sources.get("model.preset", "default")
    values = []
    for key, value, source in resolved.as_rows():
        if key.startswith("model.") and key not in resolved.sources and preset_source != "default":
            source = f"preset from {preset_source}"
        values.append({"key": key, "value": value, "source": source})
    return {
        "config": resolved.config.to_dict(),
        "values": values,
        "sources": dict(resolved.sources),
    }


def _cell(key: str, value: Any) -> Any:
    """Sizes in binary units, other values as they are."""
    if key.endswith((".capacity", "_bytes")) and isinstance(value, int):
        return size(value)
    return value


def _render(data: dict[str, Any]) -> None:
    rows = [(v["key"], _cell(v["key"], v["value"]), v["source"]) for v in data["values"]]
    console.print(table("kvtier config", ["key", "value", "source"], rows))


@inspect_app.command("config")
def inspect_config(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="TOML file (default: $KVTIER_CONFIG, else the embedded default)."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show the resolved configuration (default < file < KVTIER_* environment) and the
    source of every value."""
    run_guarded(lambda: emit(config_report(config), as_json, _render), as_json)
