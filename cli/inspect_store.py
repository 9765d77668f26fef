"""``kvtier inspect store DIR``: what an NVMe store holds; ``--verify`` checks every page;
``--rebuild-index`` writes the index anew from the slabs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.backends.nvme_rebuild import rebuild_index
from kvtier.cli.app import inspect_app
from kvtier.cli.output import (
    EXIT_FAILURE,
    console,
    emit,
    fmt,
    progress,
    run_guarded,
    size,
    table,
)

from kvtier.config import parse_size
from kvtier.errors import KVTierUsageError


def _render(data: dict[str, Any]) -> None:
    if "rebuild" in data:
        r = data["rebuild"]
        console.print(
            f"index rebuilt from the slabs: {fmt(r['pages'])} pages of {size(r['page_bytes'])} "
            f"indexed from {fmt(r['slots_scanned'])} slots ({fmt(r['damaged_slots'])} damaged, "
            f"{fmt(r['duplicate_slots'])} duplicate) in {r['seconds']:.2f} s; old index: "
            f"{r['old_index']}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    fill = data["fill"]
    rows = [
        ("path", data["path"]),
        ("format version", data["format_version"]),
        ("pages", fmt(data["pages"])),
        ("bytes", size(data["bytes"])),
        ("page size", size(data["page_bytes"])),
        ("slot size", size(data["slot_bytes"])),
        ("slabs", f"{data['slabs']} ({size(data['slab_bytes_on_disk'])} on disk)"),
        (
            "capacity pages",
            fmt(data["capacity_pages"])
            if data["capacity_pages"] is not None
            else "not recorded (the index was rebuilt without one; set when a cache next opens it)",
        ),
        ("fill", f"{fill:.1%}" if fill is not None else None),
        ("quarantined slots", data["quarantined"]),
        ("invalid index rows", data["invalid_index_rows"]),
    ]
    if "verified" in data:
        rows.append(("verified pages", fmt(data["verified"])))
        rows.append(("bad pages", len(data["bad"])))
    console.print(table("NVMe store", ["field", "value"], rows))
    ns_rows = [
        (label, fmt(v["pages"]), size(v["bytes"])) for label, v in data["namespaces"].items()
    ]
    if ns_rows:
        console.print(table("namespaces", ["namespace", "pages", "bytes"], ns_rows))
    if data.get("bad"):
        bad_rows = [(b["key"], b["slab"], b["offset"], b["reason"]) for b in data["bad"]]
        console.print(table("bad pages", ["key", "slab", "offset", "reason"], bad_rows))
    elif data["index_problems"]:
        rows2 = [(p["table"], p["key"], p["slot"], p["reason"]) for p in data["index_problems"]]
        console.print(table("invalid index rows", ["table", "key", "slot", "reason"], rows2))


@inspect_app.command("store")
def inspect_store_cmd(
    directory: Annotated[Path, typer.Argument(help="The NVMe store directory.")],
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-read every page and check its checksum.")
    ] = False,
    rebuild: Annotated[
        bool,
        typer.Option(
            "--rebuild-index",
            help="Write the index anew from the slabs' page headers (the store must be "
            "closed); for an index that is damaged, deleted or emptied.",
        ),
    ] = False,
    page_bytes: Annotated[
        str | None,
        typer.Option(
            "--page-bytes",
            help="With --rebuild-index: the page size (default: from the old index, else "
            "from the first intact page header).",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show an NVMe store's pages, bytes, slabs, fill, namespaces and format version.

    With --verify, exits 1 when any page is damaged or any index row is invalid (they
    are listed). With --rebuild-index, rebuilds the index first, then reports.
    """
    bad = False

    def body() -> None:
        nonlocal bad
        rebuilt = None
        if page_bytes is not None and not rebuild:
            raise KVTierUsageError("--page-bytes goes with --rebuild-index")
        if rebuild:
            pb = parse_size(page_bytes, "--page-bytes") if page_bytes is not None else None
            if pb is not None and pb < 1:
                raise KVTierUsageError("--page-bytes must be at least 1 byte")
            with progress(not as_json, "scanning slots", None) as advance:
                rebuilt = rebuild_index(directory, page_bytes=pb, progress=advance)
        with progress(verify and not as_json, "verifying pages", None) as advance:
            data = inspect_store(directory, verify=verify, progress=advance)
        if rebuilt is not None:
            data["rebuild"] = rebuilt
        bad = bool(data.get("bad"))
        emit(data, as_json, _render)

    run_guarded(body, as_json)
    if bad:
        raise typer.Exit(EXIT_FAILURE)
