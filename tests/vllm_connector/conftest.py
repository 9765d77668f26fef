"""Fixtures of the vLLM connector tests. They run in the vLLM virtual environment
(``.venv-vllm``, made by ``scripts/setup``) and are skipped, with that reason, elsewhere."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_engines import Engine, base_env, llm_kwargs
from vllm_models import smollm2, smollm2_available, tiny_idefics3, tiny_llama
from vllm_prompts import LENGTHS, extra_prompts, prompts_for, shared_prefix_prompts

_HERE = Path(__file__).resolve().parent
NO_VLLM = (
    "vLLM is not installed in this environment: the connector tests run in .venv-vllm "
    "(scripts/setup makes it; scripts/test runs them)"
    if importlib.util.find_spec("vllm") is None
    else None
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if NO_VLLM is None:
        return
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=NO_VLLM))


@pytest.fixture(scope="session")
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kvtier-run")
    d.chmod(0o700)
    return d


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_image_model() -> Path:
    return tiny_idefics3()


@pytest.fixture(scope="session")
def smol_model() -> Path:
    reason = smollm2_available()
    if reason:
        pytest.skip(reason)
    return smollm2()


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    return prompts_for(512, LENGTHS, seed=1)


@pytest.fixture(scope="session")
def tiny_reference(
    tiny_model: Path,
    tiny_prompts: list[list[int]],
    runtime_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[list[float]] | list[list[int]]]:
    """Greedy tokens and logprobs of vLLM alone (no connector) for ``tiny_prompts``, then
    the extra prompts the tests use later, then the two shared-prefix prompts."""
    log = tmp_path_factory.mktemp("ref") / "engine.log"
    with Engine(tiny_model, llm_kwargs(), base_env(runtime_dir), log) as eng:
        out = eng.generate(
            tiny_prompts + extra_prompts() + shared_prefix_prompts(), max_tokens=8, logprobs=1
        )
    return {"tokens": out["tokens"], "logprobs": out["logprobs"]}


@pytest.fixture()
def engine_log(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "engine.log"
