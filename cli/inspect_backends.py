"""``kvtier inspect backends``: every backend discovery finds, and whether it can run here."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import console, emit, run_guarded, table

from kvtier import registry


def backends_report() -> dict[str, Any]:
    """``{"backends": [{name, kind, available, reason, origin, target}, ...]}``."""
    return {"backends": [info.to_dict() for info in registry.discover()]}


def _render(data: dict[str, Any]) -> None:
    rows = [
        (b["name"], b["kind"], "yes" if b["available"] else "no", b["reason"], b["origin"])
        for b in data["backends"]
    ]
    console.print(table("kvtier backends", ["name", "kind", "available", "reason", "origin"], rows))
    if not rows:
        console.print(f"no backend registered in entry-point group {registry.ENTRY_POINT_GROUP}")


@inspect_app.command("backends")
def inspect_backends(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """List the tier backends found through the "kvtier.backends" entry-point group."""
    run_guarded(lambda: emit(backends_report(), as_json, _render), as_json)
