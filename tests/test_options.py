"""kvtier.options: a plugin's options declared as a dataclass, converted and checked with
errors that name the backend and the option."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.options import option, parse_options


@dataclass(frozen=True)
class Opts:
    path: Path
    fsync: bool = True
    batch_pages: int = option(8, minimum=1, maximum=1024)
    mode: str = option("fast", choices=("fast", "safe"))
    timeout_s: float | None = None
    ratio: float = option(0.5, minimum=0.0, maximum=1.0)
    slots: int = option(1024, minimum=1, maximum=1 << 20)


def parse(**raw: object) -> Opts:
    return parse_options("mystore", {"path": "/tmp/x", **raw}, Opts)


def test_defaults_and_conversions_a_config_means() -> None:
    assert parse() == Opts(Path("/tmp/x"))
    got = parse(fsync="off", batch_pages="64", mode="safe", timeout_s="2.5", ratio=1)
    assert got == Opts(Path("/tmp/x"), False, 64, "safe", 2.5, 1.0)
    assert parse(batch_pages=16.0).batch_pages == 16  # an integral float
    assert parse(timeout_s="none").timeout_s is None and parse(timeout_s=None).timeout_s is None
    assert isinstance(parse().path, Path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"colour": "red"}, r"mystore: unknown option\(s\) colour; known: path, fsync, "),
        ({"fsync": "maybe"}, r"mystore option 'fsync' must be a boolean, got 'maybe'"),
        ({"fsync": 2}, r"'fsync' must be a boolean"),
        ({"batch_pages": True}, r"'batch_pages' must be an integer, got True"),
        ({"batch_pages": 2.5}, r"'batch_pages' must be an integer, got 2.5"),
        ({"batch_pages": "8k"}, r"'batch_pages' must be an integer, got '8k'"),
        ({"batch_pages": 0}, r"'batch_pages' must be in \[1, 1024\], got 0"),
        ({"batch_pages": 10**30}, r"'batch_pages' must be in \[1, 1024\]"),
        # before: "[1, 1.04858e+06]", an inexact bound
        ({"slots": 0}, r"'slots' must be in \[1, 1048576\], got 0"),
        ({"mode": "turbo"}, r"'mode' must be one of 'fast', 'safe', got 'turbo'"),
        ({"mode": 3}, r"'mode' must be a string, got 3"),
        ({"timeout_s": "soon"}, r"'timeout_s' must be a number, got 'soon'"),
        ({"timeout_s": math.inf}, r"'timeout_s' must be a finite number"),
        ({"ratio": "nan"}, r"'ratio' must be a finite number"),
        ({"ratio": 1.5}, r"'ratio' must be in \[0, 1\], got 1.5"),
        ({"path": 7}, r"'path' must be a path, got 7"),
        ({"path": None}, r"'path' must be a path, got None"),
    ],
)
def test_each_bad_value_is_named(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(**raw)


def test_a_required_option_missing_is_named() -> None:
    with pytest.raises(ConfigError, match=r"mystore: option 'path' is required"):
        parse_options("mystore", {}, Opts)


def test_a_spec_it_cannot_convert_is_the_backends_bug() -> None:
    @dataclass(frozen=True)
    class Bad:
        hosts: list[str]

    with pytest.raises(TypeError, match="cannot convert type"):
        parse_options("mystore", {"hosts": ["a"]}, Bad)
    with pytest.raises(TypeError, match="needs a dataclass type"):
        parse_options("mystore", {}, dict)  # type: ignore[arg-type]


@given(st.integers(1, 1024))
def test_integers_round_trip_from_any_spelling(n: int) -> None:
    for spelling in (n, float(n), str(n), f" {n} "):
        assert parse(batch_pages=spelling).batch_pages == n
