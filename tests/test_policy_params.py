"""Bad eviction-policy parameters, from Python and from a tier's ``eviction_params`` in
TOML (where a quoted number arrives as a string): each is a :class:`ConfigError` naming
the policy that was given it, the parameter and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.policy.eviction import make_policy

NAN, INF = float("nan"), float("inf")

BAD = [
    # before: "'<' not supported between instances of 'str' and 'int'"; NaN, inf and 1.5
    # were accepted as arc's capacity
    ("arc", {"capacity": "5"}, r"^arc: capacity must be an integer >= 1 page \(or unset\)"),
    ("arc", {"capacity": NAN}, r"^arc: capacity must be an integer >= 1 page .*got nan"),
    ("arc", {"capacity": INF}, r"^arc: capacity must be an integer >= 1 page .*got inf"),
    ("arc", {"capacity": 1.5}, r"^arc: capacity must be an integer >= 1 page .*got 1\.5"),
    ("arc", {"ghost_factor": "2"}, r"^arc: ghost_factor must be a number, got '2'"),
    ("session", {"capacity": 1.5}, r"^session: capacity must be an integer >= 1 page"),
    ("session", {"capacity": "5"}, r"^session: capacity must be an integer >= 1 page"),
    ("session", {"ghost_factor": 0.5}, r"^session: ghost_factor must be >= 1"),
    ("s3-fifo", {"small_ratio": "0.1"}, r"^s3-fifo: small_ratio must be a number, got '0\.1'"),
    ("s3-fifo", {"ghost_factor": "1"}, r"^s3-fifo: ghost_factor must be a number"),
    # before: "hinted: history must be..." for interval
    ("interval", {"history": NAN}, r"^interval: history must be a number >= 0, got nan"),
    ("interval", {"rate_history": -1}, r"^interval: rate_history must be a number >= 0"),
    ("interval", {"fallback": "hinted"}, r"^interval: the fallback cannot be 'hinted'"),
    ("interval", {"fallback": {"a": 1}}, r"^interval: fallback must be a policy name"),
    ("hinted", {"history": NAN}, r"^hinted: history must be a number >= 0, got nan"),
    ("hinted", {"pin_share": "0.5"}, r"^hinted: pin_share must lie in \[0, 1\], got '0\.5'"),
    ("hinted", {"pin_share": NAN}, r"^hinted: pin_share must lie in \[0, 1\], got nan"),
    ("interval", {"lateness": INF}, r"^interval: lateness must be a finite number >= 0, got inf"),
    (
        "interval",
        {"lateness": "0.25"},
        r"^interval: lateness must be a finite number >= 0, got '0\.25'",
    ),
    # before: accepted (a dict's keys were taken as the points; experts ran twice)
    ("adaptive", {"experts": ["lru", "lru"]}, r"^adaptive: experts repeat: \['lru', 'lru'\]"),
    ("adaptive", {"points": {"0:last": 1}}, r"^adaptive: points must be a list of 'bonus:order'"),
    ("adaptive", {"points": NAN}, r"^adaptive: points must be a list of 'bonus:order'"),
    # before: named "two-class"
    ("adaptive", {"history": NAN}, r"^adaptive: history must be a number >= 0, got nan"),
    ("adaptive", {"capacity": 1.5}, r"^adaptive: capacity must be an integer >= 1 page"),
    ("adaptive", {"points": ["0:lst"]}, r"^adaptive: point '0:lst': order must be one of"),
    ("two-class", {"history": -1}, r"^two-class: history must be a number >= 0"),
]


@pytest.mark.parametrize(("name", "params", "match"), BAD, ids=[f"{n}-{p}" for n, p, _ in BAD])
def test_bad_parameters_name_the_policy(name: str, params: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_policy(name, **params)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("arc", {"capacity": 5, "ghost_factor": 2}),
        ("arc", {"capacity": None}),
        ("session", {"capacity": 8, "ghost_factor": 4}),
        ("s3-fifo", {"small_ratio": 0.2, "ghost_factor": 1}),
        ("adaptive", {"experts": ["s3-fifo"], "points": ["0:last", "inf:kth"]}),
        ("adaptive", {"experts": []}),
    ],
)
def test_good_parameters_still_build(name: str, params: dict) -> None:
    assert make_policy(name, **params).name == name


def test_toml_eviction_params_are_checked_at_load(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    for eviction, table, match in [
        (
            "arc",
            'capacity = "5"',
            r"tiers\[0\]\.eviction_params: arc: capacity must be an integer",
        ),
        ("adaptive", 'experts = ["lru", "lru"]', r"tiers\[0\]\.eviction_params: adaptive: experts"),
        # a bad name inside the parameters is named there, not on the valid `eviction`
        (
            "adaptive",
            'experts = ["bogus"]',
            r"tiers\[0\]\.eviction_params: adaptive: experts: unknown eviction policy 'bogus'",
        ),
        (
            "hinted",
            'fallback = "bogus"',
            r"tiers\[0\]\.eviction_params: hinted: fallback: unknown eviction policy 'bogus'",
        ),
        # a fallback that keeps a clock would never be given it
        ("hinted", 'fallback = "adaptive"', r"hinted: the fallback cannot be 'adaptive'"),
        ("interval", 'fallback = "interval"', r"interval: the fallback cannot be 'interval'"),
        ("bogus", "", r"tiers\[0\]\.eviction: unknown eviction policy 'bogus'"),
    ]:
        path.write_text(
            '[model]\npreset = "tiny"\n[[tiers]]\nbackend = "dram"\ncapacity = "1MiB"\n'
            f'eviction = "{eviction}"\n[tiers.eviction_params]\n{table}\n'
        )
        with pytest.raises(ConfigError, match=match):
            load_config(path, env={})
