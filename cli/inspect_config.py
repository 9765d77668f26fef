"""``kvtier inspect config``: the resolved configuration, where each value came from, and
whether it is valid (``--check``: whether each tier opens and works)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from kvtier.cli.app import inspect_app
from kvtier.cli.output import (
    EXIT_FAILURE,
    console,
    emit,
    err_console,
    fail,
    run_guarded,
    size,
    table,
)

from kvtier.config import load_config
from kvtier.errors import BackendUnavailableError
from kvtier.options import mask_url_password
from kvtier.tier_check import check_tiers, create_backend


def config_report(path: Path | None, check: bool = False) -> dict[str, Any]:
    """The resolved config of ``path`` (or ``$KVTIER_CONFIG``, or the embedded default)
    with ``KVTIER_*`` overrides applied, validated down to each backend's options.

    Returns ``{"config": <file-shaped dict>, "values": [{"key", "value", "source"}, ...],
    "sources": {key: source}}`` plus, with ``check``, ``"checks": [{tier, backend, ok,
    step, error, note}, ...]`` (:func:`~kvtier.tier_check.check_tiers`: stores checked
    without being created or changed, other tiers opened and probed; the model counts as
    known when any ``model.*`` value has a source other than the default). A source is ``default``,
    ``file:PATH``, ``python`` or ``env:NAME``. Raises
    :class:`~kvtier.errors.ConfigError` (or the registry's errors) naming a bad key, value,
    backend or backend option.
    """
    resolved = load_config(path)
    config = resolved.config
    for i in range(len(config.tiers)):
        try:
            create_backend(config, i)  # unknown backend, unknown or missing option: raises
        except BackendUnavailableError:
            if not check:
                raise
            # valid config, but the backend cannot run here: --check reports the tier
            # failing at its step 'create' beside the others
    # Model fields filled in from a preset carry no source of their own: they come from
    # wherever the preset was chosen.
    preset_source = resolved.sources.get("model.preset", "default")
    values = []
    for key, value, source in resolved.as_rows():
        if key.startswith("model.") and key not in resolved.sources and preset_source != "default":
            source = f"preset from {preset_source}"
        values.append({"key": key, "value": value, "source": source})
    report: dict[str, Any] = {
        "config": _masked("", config.to_dict()),
        "values": [{**v, "value": _masked(v["key"], v["value"])} for v in values],
        "sources": dict(resolved.sources),
    }
    if check:
        model_known = any(
            k.startswith("model.") and src != "default" for k, src in resolved.sources.items()
        )
        checks = asyncio.run(check_tiers(config, model_known))
        report["checks"] = [c.to_dict() for c in checks]
    return report


#: Option names whose values are secrets: shown as ``***`` (as ``stats()`` and logs do).
SECRET_OPTIONS = frozenset({"password", "secret", "token", "api_key"})


def _masked(key: str, value: Any) -> Any:
    """``value`` with secrets masked: an option named in :data:`SECRET_OPTIONS`, and the
    password of a URL (``redis://user:***@host``). Its output is pasted into bug
    reports; it printed a tier's password in clear, twice."""
    if isinstance(value, dict):
        return {k: _masked(f"{key}.{k}" if key else k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if value is not None and key.rsplit(".", 1)[-1] in SECRET_OPTIONS:
        return "***"
    if isinstance(value, str) and "://" in value:
        return mask_url_password(value)
    return value


def _cell(key: str, value: Any) -> Any:
    """Sizes in binary units, other values as they are."""
    if key.endswith((".capacity", "_bytes")) and isinstance(value, int):
        return size(value)
    return value


def _render(data: dict[str, Any]) -> None:
    rows = [(v["key"], _cell(v["key"], v["value"]), v["source"]) for v in data["values"]]
    console.print(table("kvtier config", ["key", "value", "source"], rows))
    if "checks" in data:
        checks = [
            (c["tier"], c["backend"], "ok" if c["ok"] else f"failed at {c['step']}",
             c["error"] if not c["ok"] else c["note"])
            for c in data["checks"]
        ]  # fmt: skip
        console.print(table("tier checks", ["tier", "backend", "result", "detail"], checks))


@inspect_app.command("config")
def inspect_config(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="TOML file (default: $KVTIER_CONFIG, else the embedded default)."
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Also check each tier; exits 1 naming each tier that fails. Stores on "
            "disk (file, nvme) are checked without being created or changed (a missing "
            "directory: whether it can be created); other tiers are opened and store, "
            "read back and delete a probe page (reachable, authenticated, writable).",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Show the resolved configuration (default < file < KVTIER_* environment) and the
    source of every value, after validating it down to each backend's options (exit 2
    naming what is wrong)."""
    failed: list[str] = []

    def body() -> None:
        data = config_report(config, check)
        failed.extend(
            f"{c['tier']} ({c['backend']}) failed at {c['step']}: {c['error']}"
            for c in data.get("checks", [])
            if not c["ok"]
        )
        emit(data, as_json, _render)

    run_guarded(body, as_json)
    if failed:
        for line in failed[:-1]:
            err_console.print(f"error: {line}", highlight=False, markup=False, soft_wrap=True)
        raise fail(failed[-1], EXIT_FAILURE)
