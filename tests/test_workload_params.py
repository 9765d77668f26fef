"""A generated workload's parameters are checked by name before it is built
(:mod:`kvtier.sim.workload_params`): a bad value or an unknown name is a usage error
that names the workload, the parameter and the value."""

from __future__ import annotations

import inspect

import pytest

from kvtier.errors import KVTierUsageError
from kvtier.sim.workload_params import KNOWN
from kvtier.sim.workloads import WORKLOADS, workload


def test_every_generator_parameter_has_a_rule() -> None:
    """A new generator's parameter names must be given a rule (or be put in OTHERS)."""
    for name, gen in WORKLOADS.items():
        missing = set(inspect.signature(gen).parameters) - KNOWN
        assert not missing, f"{name}: no rule for {sorted(missing)}"


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("rotation", {"tenants": 0}, "tenants must be an integer >= 1, got 0"),
        ("rotation", {"loyal": 1.5}, r"loyal must be a number in \[0, 1\], got 1.5"),
        ("zipf", {"prefixes": 0}, "prefixes must be an integer >= 1, got 0"),
        ("zipf", {"prefixes": 2.5}, "prefixes must be an integer >= 1, got 2.5"),
        ("zipf", {"rate": -1.0}, "rate must be a finite number > 0, got -1.0"),
        ("chat", {"rate": float("inf")}, "rate must be a finite number > 0, got inf"),
        ("shift", {"carry": float("nan")}, r"carry must be a number in \[0, 1\], got nan"),
        ("shift", {"alpha": -0.5}, "alpha must be a finite number >= 0, got -0.5"),
        ("drift", {"swaps": -1}, "swaps must be an integer >= 0, got -1"),
        ("longchat", {"shape": 0}, "shape must be a finite number > 0, got 0"),
        ("sizes", {"doc_share": "half"}, "doc_share must be a number, got 'half'"),
        ("uniform", {"block_tokens": True}, "block_tokens must be an integer >= 1, got True"),
        ("templates", {"seed": 1.0}, "seed must be an integer, got 1.0"),
        ("bursty", {"calm_rate": 0}, "calm_rate must be a finite number > 0, got 0"),
    ],
)
def test_a_bad_value_names_the_workload_the_parameter_and_the_value(
    name: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(KVTierUsageError, match=f"workload '{name}': {message}"):
        workload(name, n=50, **params)


def test_an_unknown_parameter_is_refused_with_the_ones_it_takes() -> None:
    with pytest.raises(KVTierUsageError, match="'zipf' has no parameter 'tenants'") as err:
        workload("zipf", n=50, tenants=4)
    assert "prefixes" in str(err.value) and "alpha" in str(err.value)


def test_edge_values_that_are_allowed_still_build() -> None:
    assert len(workload("drift", n=60, seed=0, swaps=0).requests) == 60
    assert len(workload("rotation", n=60, tenants=1, loyal=0.0, alpha=0.0).requests) == 60
    assert len(workload("shift", n=60, carry=1.0, phases=1).requests) == 60
    with pytest.raises(KVTierUsageError, match="requests must be an integer"):
        workload("chat", n=0)  # ``n`` keeps its own check and message
