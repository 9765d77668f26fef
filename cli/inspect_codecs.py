"""``kvtier inspect codecs``: every page codec discovery finds, and whether it can run here."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import console, emit, run_guarded, table

from kvtier.codec import registry


def codecs_report() -> dict[str, Any]:
    """``{"codecs": [{name, lossy, available, reason, origin, target}, ...]}``."""
    return {"codecs": [info.to_dict() for info in registry.discover()]}


def _render(data: dict[str, Any]) -> None:
    rows = [
        (
            c["name"],
            {True: "lossy", False: "lossless"}.get(c["lossy"], "?"),
            "yes" if c["available"] else "no",
            c["reason"],
            c["origin"],
        )
        for c in data["codecs"]
    ]
    console.print(table("kvtier codecs", ["name", "kind", "available", "reason", "origin"], rows))


@inspect_app.command("codecs")
def inspect_codecs(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """List the page codecs found through the "kvtier.codecs" entry-point group."""
    run_guarded(lambda: emit(codecs_report(), as_json, _render), as_json)
