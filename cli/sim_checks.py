"""``kvtier bench sim``'s argument checks: every option is refused with a message naming
it before any work (a replay can take minutes). ``cli/bench_sim.py`` runs them."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from kvtier.cli.bench_suite import check_policies
from kvtier.cli.sim_sizes import parse_capacity, tier_pages

from kvtier.errors import KVTierUsageError
from kvtier.policy.admission import admission_names
from kvtier.sim.hardware import HardwareProfile, profile
from kvtier.sim.replay import WRITE_POLICIES
from kvtier.spec import KVSpec, preset

#: The most tokens a trace block may hold (``--block-tokens``): a request's tokens are
#: counted in 64-bit integers, which a larger block could overflow.
MAX_BLOCK_TOKENS = 1 << 20


def check_args(
    requests: int | None,
    block_tokens: int,
    tier_scale: float,
    tiers: list[str],
    admission: str,
    capacities: list[str],
    plot_file: Path | None,
) -> None:
    """Refuse meaningless arguments before any work (a replay can take minutes):
    :class:`KVTierUsageError` naming the option. ``--block-tokens`` is from 1 to
    :data:`MAX_BLOCK_TOKENS`; a ``--capacity`` share is at most 100 %."""
    if requests is not None and requests < 1:
        raise KVTierUsageError(f"--requests must be >= 1, got {requests}")
    if block_tokens < 1:
        raise KVTierUsageError(f"--block-tokens must be >= 1, got {block_tokens}")
    if block_tokens > MAX_BLOCK_TOKENS:
        raise KVTierUsageError(
            f"--block-tokens must be at most {MAX_BLOCK_TOKENS:,} (1 << 20 tokens per block), "
            f"got {block_tokens}"
        )
    if not math.isfinite(tier_scale) or tier_scale <= 0:
        raise KVTierUsageError(f"--tier-scale must be a finite number > 0, got {tier_scale}")
    if not tiers:
        raise KVTierUsageError("--tiers must name at least one tier, e.g. --tiers hbm,dram")
    if len(set(tiers)) != len(tiers):
        raise KVTierUsageError(f"--tiers must name distinct tiers, got {','.join(tiers)!r}")
    if admission not in admission_names():
        known = ", ".join(admission_names())
        raise KVTierUsageError(
            f"--admission: unknown admission policy {admission!r}; known: {known}"
        )
    for c in capacities:  # page counts now; shares of the trace once it is read
        tier_pages(c, parse_capacity(c, 1), tier_scale, tiers, [1.0] * len(tiers))
    if plot_file is not None:
        check_plot_path(plot_file)


def check_names(policies: list[str], write_policy: str, prefetch: str | None) -> None:
    """``--policy``, ``--write-policy`` and ``--prefetch`` name known things:
    :class:`KVTierUsageError` naming the option, before the trace is read."""
    check_policies(policies)
    if prefetch not in (None, "lookahead"):
        raise KVTierUsageError(
            f"--prefetch: unknown prefetch predictor {prefetch!r}; known: lookahead"
        )
    if write_policy not in WRITE_POLICIES:
        raise KVTierUsageError(
            f"--write-policy: unknown write policy {write_policy!r}; "
            f"known: {', '.join(WRITE_POLICIES)}"
        )


def check_admission(admission_given: bool, write_policy: str) -> None:
    """``--admission`` is given only with ``--write-policy selective`` (the only write
    policy that consults it): :class:`KVTierUsageError` naming both options otherwise,
    as ``--suite`` refuses the options it does not use."""
    if admission_given and write_policy != "selective":
        raise KVTierUsageError(
            f"--admission applies only to --write-policy selective (got --write-policy "
            f"{write_policy}): drop --admission or add --write-policy selective"
        )


def parse_codec_options(items: list[str]) -> dict[str, str]:
    """``--codec TIER=CODEC[:key=value,...]`` options as tier -> codec text;
    :class:`KVTierUsageError` naming ``--codec`` for an item without ``=`` or a tier
    given twice (before: the last one silently won)."""
    codecs: dict[str, str] = {}
    for item in items:
        tier_name, eq, codec_name = item.partition("=")
        if not eq or not tier_name or not codec_name:
            raise KVTierUsageError(
                f"--codec {item!r}: use TIER=CODEC[:key=value,...], e.g. nvme=fp8-e4m3"
            )
        if tier_name in codecs:
            raise KVTierUsageError(
                f"--codec: tier {tier_name!r} is given twice ({tier_name}={codecs[tier_name]} "
                f"and {item}): give one --codec per tier"
            )
        codecs[tier_name] = codec_name
    return codecs


def model_spec(model: str) -> KVSpec:
    """The KVSpec preset ``--model model``; :class:`KVTierUsageError` naming the option."""
    try:
        return preset(model)
    except KVTierUsageError as exc:
        raise KVTierUsageError(f"--model: {exc}") from None


def hardware_profile(hardware: str) -> HardwareProfile:
    """The ``--hardware`` profile (a built-in name or a JSON file);
    :class:`KVTierUsageError` naming the option, the file, the field and the value."""
    try:
        return profile(hardware)
    except KVTierUsageError as exc:
        raise KVTierUsageError(f"--hardware: {exc}") from None


def check_hardware_tiers(hardware: str, tiers: list[str]) -> None:
    """Every tier of ``--tiers`` has a link in the ``--hardware`` profile (the cost model
    needs it): :class:`KVTierUsageError` naming the profile's tiers and a ``--tiers``
    that fits it, before the replay (which can take minutes)."""
    hw = hardware_profile(hardware)
    missing = [t for t in tiers if t not in hw.links]
    if missing:
        fits = [t for t in hw.links if t in hw.tier_bytes] or list(hw.links)
        raise KVTierUsageError(
            f"--hardware {hardware} has no tier {missing[0]!r} (from --tiers "
            f"{','.join(tiers)}); its tiers are {', '.join(hw.links)}: choose --tiers "
            f"among them, e.g. --tiers {','.join(fits)}"
        )


def check_plot_path(path: Path) -> None:
    """The plot can be written there: the directory exists and is writable, and the file
    type is one matplotlib writes (by the suffix)."""
    parent = path.parent
    if not parent.is_dir():
        raise KVTierUsageError(f"--plot: directory {parent} does not exist")
    if path.is_dir():
        hint = " (an empty --plot names the current directory)" if str(path) == "." else ""
        raise KVTierUsageError(f"--plot: {path} is a directory{hint}: give a file, e.g. hits.png")
    try:  # a file made and removed: os.access() lets root pass on /proc or /sys,
        # where the plot then failed after the whole replay, losing the report
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kvtier-plot-check-"):
            pass
    except OSError as exc:
        raise KVTierUsageError(
            f"--plot: cannot write in directory {parent}: {exc.strerror or exc}"
        ) from None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in kinds:
        raise KVTierUsageError(
            f"--plot: cannot write a {suffix or 'suffix-less'} file; use one of "
            f"{', '.join(sorted(kinds))}"
        )
