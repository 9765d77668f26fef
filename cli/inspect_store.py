"""``kvtier inspect store DIR``: what an NVMe store holds; ``--verify`` checks every page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.cli.app import inspect_app
from kvtier.cli.output import EXIT_FAILURE, console, emit, progress, run_guarded, table


def _render(data: dict[str, Any]) -> None:
    fill = data["fill"]
    rows = [
        ("path", data["path"]),
        ("format version", data["format_version"]),
        ("pages", data["pages"]),
        ("bytes", data["bytes"]),
        ("page bytes", data["page_bytes"]),
        ("slot bytes", data["slot_bytes"]),
        ("slabs", f"{data['slabs']} ({data['slab_bytes_on_disk']} bytes on disk)"),
        ("capacity pages", data["capacity_pages"]),
        ("fill", f"{fill:.1%}" if fill is not None else None),
        ("quarantined slots", data["quarantined"]),
    ]
    if "verified" in data:
        rows.append(("verified pages", data["verified"]))
        rows.append(("bad pages", len(data["bad"])))
    console.print(table("NVMe store", ["field", "value"], rows))
    ns_rows = [(label, v["pages"], v["bytes"]) for label, v in data["namespaces"].items()]
    if ns_rows:
        console.print(table("namespaces", ["namespace", "pages", "bytes"], ns_rows))
    if data.get("bad"):
        bad_rows = [(b["key"], b["slab"], b["offset"], b["reason"]) for b in data["bad"]]
        console.print(table("bad pages", ["key", "slab", "offset", "reason"], bad_rows))


@inspect_app.command("store")
def inspect_store_cmd(
    directory: Annotated[Path, typer.Argument(help="The NVMe store directory.")],
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-read every page and check its checksum.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show an NVMe store's pages, bytes, slabs, fill, namespaces and format version.

    With --verify, exits 1 when any page is damaged (the bad pages are listed).
    """
    bad = False

    def body() -> None:
        nonlocal bad
        with progress(verify and not as_json, "verifying pages", None) as advance:
            data = inspect_store(directory, verify=verify, progress=advance)
        bad = bool(data.get("bad"))
        emit(data, as_json, _render)

    run_guarded(body)
    if bad:
        raise typer.Exit(EXIT_FAILURE)
