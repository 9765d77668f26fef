"""The commands a user runs, fed bad input (issue 12): each exits 2 (usage) or 1 (failure)
with a message naming the problem, prints a JSON error object with --json, never a
traceback, and checks what it can before doing any work."""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from kvtier.backends.nvme import NvmeStore
from kvtier.cli.app import get_app
from kvtier.cli.bench_sim import make_figure
from typer.testing import CliRunner

from kvtier.bench.workload import ChatParams, footprint
from kvtier.spec import preset

DATA = Path(__file__).resolve().parent / "data"
TRACE = DATA / "mooncake_conversation_head400.jsonl"


def invoke(*args: str, code: int) -> dict[str, Any]:
    """Run the command with --json; check the exit code and the JSON error object."""
    result = CliRunner().invoke(get_app(), [*args, "--json"])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    error = json.loads(result.stdout)["error"]
    assert error["exit_code"] == code and error["message"] in " ".join(result.stderr.split())
    return dict(error)


# -- bench sim ---------------------------------------------------------------------------------


SIM = ["bench", "sim", "--workload", "chat", "--requests", "50", "--no-progress"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--capacity", "-1%"], "capacity must be a finite number > 0"),
        (["--capacity", "0"], "capacity must be a finite number > 0"),
        (["--capacity", "nan"], "capacity must be a finite number > 0"),
        (["--capacity", "inf%"], "capacity must be a finite number > 0"),
        (["--capacity", "lots"], "bad capacity 'lots'"),
        (["--requests", "-5"], "--requests must be >= 1"),
        (["--requests", "0"], "--requests must be >= 1"),
        # before: a generated workload this large was built until memory ran out
        (["--requests", "1000001"], "requests must be an integer from 1 to 1,000,000"),
        (["--tier-scale", "0"], "--tier-scale must be a finite number > 0"),
        (["--tier-scale", "inf"], "--tier-scale must be a finite number > 0"),
        # before: OverflowError / int(inf), reported as a kvtier bug
        (["--tiers", "hbm,dram,nvme", "--tier-scale", "1e300"], "tier 'dram' would hold more"),
        (["--tiers", "hbm,dram", "--tier-scale", "1e300", "--capacity", "1e18"], "than 2**63"),
        (["--capacity", "1e19"], "--capacity 1e19: tier 'hbm' would hold more than 2**63 - 1"),
        # a share: checked once the trace is read, still before the first replay
        (
            ["--tiers", "hbm,dram", "--tier-scale", "1e18", "--capacity", "100%"],
            "tier 'dram' would hold",
        ),
        (["--block-tokens", "0"], "--block-tokens must be >= 1"),
        (["--admission", "bogus"], "unknown admission policy 'bogus'"),
        (["--tiers", ","], "--tiers must name at least one tier"),
        (["--tiers", "hbm,,dram"], "--tiers 'hbm,,dram' has an empty tier name"),  # was accepted
        (["--tiers", "a,a"], "--tiers must name distinct tiers"),
        (["--plot", "/nonexistent-dir/x.png"], "--plot: directory /nonexistent-dir does not exist"),
        (["--plot", "/tmp/x.nosuchformat"], "cannot write a nosuchformat file"),
        # before: accepted for root (os.access), then failed after the replay
        (["--plot", "/proc/x.png"], "--plot: cannot write in directory /proc"),
        # before: accepted, modelling a coded DRAM tier the live cache refuses
        (["--tiers", "hbm,dram", "--codec", "dram=int8"], "'dram' is a memory arena"),
        # before: OverflowError reported as a kvtier bug (blocks x block tokens > 2**63 - 1)
        (["--block-tokens", "9223372036854775807"], "--block-tokens must be at most 1,048,576"),
        (["--block-tokens", str(1 << 20 | 1)], "(1 << 20 tokens per block), got 1048577"),
        # before: accepted (300000 pages for 3 distinct blocks)
        (["--capacity", "101%"], "--capacity 101%: a share of the distinct blocks is at most"),
        (["--capacity", "1e7%"], "--capacity 1e7%: a share of the distinct blocks is at most"),
        # before: ignored without a word (JSON "admission": null)
        (["--admission", "frequency"], "--admission applies only to --write-policy selective"),
        (["--admission", "reuse", "--write-policy", "write-through"], "drop --admission or add"),
        # before: the messages did not name the option
        (["--model", "nosuch"], "--model: unknown KVSpec preset 'nosuch'"),
        (["--capacity", "0"], "--capacity: capacity must be a finite number > 0, got '0'"),
        (["--plot", ""], "--plot: . is a directory (an empty --plot names the current"),
    ],
)
def test_bench_sim_refuses_meaningless_arguments(args: list[str], needle: str) -> None:
    base = list(SIM)
    if args[0] == "--requests":
        base = base[:4] + base[6:]
    assert needle in invoke(*base, *args, code=2)["message"]


def test_bench_sim_checks_the_plot_path_before_the_replay(tmp_path: Path) -> None:
    """A replay of many requests would take long: the bad path is refused at once (the
    workload is not even generated: --requests is huge)."""
    error = invoke(
        "bench", "sim", "--workload", "chat", "--requests", "100000000",
        "--plot", str(tmp_path / "missing" / "x.png"), code=2,
    )  # fmt: skip
    assert "does not exist" in error["message"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hardware", "cpu"], "--hardware cpu has no tier 'hbm' (from --tiers hbm); its tiers "
         "are dram, nvme, remote: choose --tiers among them, e.g. --tiers dram,nvme"),
        (["--hardware", "h200-gen5", "--tiers", "hbm,ssd"], "has no tier 'ssd'"),
        (["--codec", "nvme=fp8-e4m3"], "--codec names tier(s) ['nvme']; tiers are ['hbm'] "
         "(--tiers, default hbm): add them, e.g. --tiers hbm,nvme"),
    ],
)  # fmt: skip
def test_bench_sim_names_the_tiers_that_fit_before_the_replay(args: list[str], needle: str) -> None:
    """Before: --hardware cpu with the default --tiers failed after the whole replay, with
    no hint of --tiers (the workload is not even generated here: --requests is huge)."""
    error = invoke("bench", "sim", "--workload", "chat", "--requests", "100000000", *args, code=2)
    assert needle in error["message"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [(b"", "holds no request"), (b"\xff\xfe\x00binary\x00" * 50, "not UTF-8 text")],
    ids=["empty", "binary"],
)
def test_bench_sim_refuses_a_trace_with_no_requests(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(content)
    assert needle in invoke("bench", "sim", "--trace", str(trace), code=2)["message"]
    assert "is not a file" in invoke("bench", "sim", "--trace", str(tmp_path), code=2)["message"]


def test_bench_sim_reads_a_gzip_trace_like_the_plain_one(tmp_path: Path) -> None:
    gz = tmp_path / "head.jsonl.gz"
    gz.write_bytes(gzip.compress(TRACE.read_bytes()))
    runs = []
    for path in (TRACE, gz):
        args = ["bench", "sim", "--trace", str(path), "--capacity", "5%", "--policy", "lru"]
        result = CliRunner().invoke(get_app(), [*args, "--json", "--no-progress"])
        assert result.exit_code == 0, result.output
        runs.append(json.loads(result.stdout))
    assert runs[0]["runs"] == [{**r, "replay_s": runs[0]["runs"][0]["replay_s"]}
                               for r in runs[1]["runs"]]  # fmt: skip
    assert runs[1]["trace"] == "head"  # the name without .jsonl.gz


def test_the_plot_is_readable(tmp_path: Path) -> None:
    args = ["bench", "sim", "--trace", str(TRACE), "--capacity", "1%", "--capacity", "10%"]
    args += ["--policy", "lru", "--policy", "arc", "--tiers", "hbm,dram", "--no-progress"]
    result = CliRunner().invoke(get_app(), [*args, "--json", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (tmp_path / "p.png").stat().st_size > 1000
    fig = make_figure(report)
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0  # y from 0
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert any(t.endswith("%") for t in ticks)  # percentage ticks
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1  # off the lines
    title = ax.get_title()
    for part in (report["model"], report["hardware"], "hbm > dram", report["write_policy"]):
        assert part in title
    lines = {line.get_label(): line for line in ax.get_lines()}
    refs = [lines["Belady MIN (ceiling)"], lines["LRU (reference)"]]
    assert all(r.get_zorder() < lines["arc"].get_zorder() for r in refs)  # drawn under


# -- bench run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--steps", "4"], ["--accept-rate", "0.5"], ["--fork-every", "2"],
                                  ["--draft-tokens", "3"], ["--fork-every", "0"]])  # fmt: skip
def test_bench_run_refuses_speculative_flags_with_the_chat_workload(flag: list[str]) -> None:
    error = invoke("bench", "run", "--model", "tiny", *flag, code=2)
    assert f"{flag[0]} applies only to --workload speculative" in error["message"]


@pytest.mark.parametrize("flag", [["--turns", "9"], ["--system-prompts", "3"],
                                  ["--system-tokens", "8"], ["--turn-tokens", "20"],
                                  ["--concurrency", "4"], ["--predictor", "prefix"],
                                  ["--queue-delay-ms", "5"],
                                  # given with the default value: refused all the same
                                  ["--turns", "4"], ["--predictor", "none"]])  # fmt: skip
def test_bench_run_refuses_chat_flags_with_the_speculative_workload(flag: list[str]) -> None:
    """Before: the speculative workload ran and ignored them."""
    error = invoke("bench", "run", "--model", "tiny", "--workload", "speculative", *flag, code=2)
    assert f"{flag[0]} applies only to --workload chat" in error["message"]


def test_the_documented_bench_run_example_is_sized_up_front() -> None:
    """The docs' example with 48 MiB used to fail after playing turns ("cannot load 26
    distinct pages"); now it is refused before anything runs, naming the minimum."""
    params = ChatParams(sessions=4, turns=3)
    spec = preset("llama3-8b")
    need = footprint(params, spec.page_tokens).min_top_pages
    error = invoke(
        "bench", "run", "--sessions", "4", "--turns", "3", "--dram-capacity", "48MiB", code=2
    )
    assert f"up to {need} pages at once" in error["message"]
    assert f"at least {need * spec.page_bytes // (1 << 20)}.0 MiB" in error["message"]


def test_bench_run_at_its_minimum_runs_and_prints_its_configuration(tmp_path: Path) -> None:
    params = ChatParams(sessions=4, turns=3)
    spec = preset("tiny")
    need = footprint(params, spec.page_tokens).min_top_pages
    args = ["bench", "run", "--model", "tiny", "--sessions", "4", "--turns", "3"]
    below = CliRunner().invoke(get_app(), [*args, "--dram-capacity", str((need - 1) * 512)])
    assert below.exit_code == 2 and "at least" in below.output
    result = CliRunner().invoke(get_app(), [*args, "--dram-capacity", str(need * 512)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "configuration: tiny" in out and "dram" in out and f"{need}" in out
    assert "mismatches 0" in out
    # the NVMe row counts the store's pages (4 KiB slots), not its bytes over 512-byte
    # pages (8,388,608 for the 4 GiB default: 8x too many)
    nvme_row = next(line for line in out.splitlines() if line.startswith("│ nvme"))
    assert f"{NvmeStore.capacity_pages_for(4 << 30, 512):,}" in nvme_row
    assert f"{(4 << 30) // 512:,}" not in nvme_row


def test_bench_run_fails_when_a_tier_is_unreachable_for_the_whole_run(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "kv.toml"
    cfg.write_text(
        '[model]\npreset = "tiny"\n'
        '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "256KiB"\n'
        '[[tiers]]\nname = "remote"\nbackend = "redis"\ncapacity = "1MiB"\n'
        f'options = {{url = "redis://127.0.0.1:{port}/0", op_timeout_s = 0.2, '
        "connect_timeout_s = 0.2, retry_interval_s = 0.5}\n"
    )
    # the report comes out (the only JSON object on stdout), then exit 1 naming the tier
    chat = ["--sessions", "2", "--turns", "2"]
    speculative = ["--workload", "speculative", "--steps", "4", "--sessions", "2"]
    for workload in (chat, speculative):
        args = ["bench", "run", "-c", str(cfg), *workload, "--json"]
        result = CliRunner().invoke(get_app(), args)
        assert result.exit_code == 1, result.output
        (failed,) = json.loads(result.stdout)["failed_tiers"]
        assert "tier 'remote' was unreachable for the whole run" in failed["error"]
        assert failed["error"] in " ".join(result.stderr.split())


# -- bench io ----------------------------------------------------------------------------------


def test_bench_io_refuses_a_missing_dir_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "x"
    error = invoke("bench", "io", "--tier", "file", "--dir", str(missing), code=2)
    assert "does not exist" in error["message"]
    assert not (tmp_path / "nonexistent").exists()


def test_bench_io_refuses_a_file_as_dir(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    assert "is not a directory" in invoke("bench", "io", "--dir", str(f), code=2)["message"]


def test_bench_io_refuses_a_dir_nothing_can_be_created_in() -> None:
    """/proc passes a permission check even for root, yet refuses a new directory: the
    bench tries one before it measures (a usage error, exit 2, not a failed run)."""
    error = invoke("bench", "io", "--tier", "file", "--dir", "/proc", code=2)
    assert "--dir /proc is not writable: cannot create a directory in it" in error["message"]


# -- inspect config ----------------------------------------------------------------------------


def _write(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "kv.toml"
    path.write_text('[model]\npreset = "tiny"\n' + tiers)
    return path


DRAM = '[[tiers]]\nname = "dram"\nbackend = "dram"\ncapacity = "64KiB"\n'


@pytest.mark.parametrize(
    ("tier", "needle"),
    [
        (
            '[[tiers]]\nname = "x"\nbackend = "nosuch"\ncapacity = "1MiB"\n',
            "unknown backend 'nosuch'",
        ),
        ('[[tiers]]\nname = "n"\nbackend = "nvme"\ncapacity = "1MiB"\n', "option 'path'"),
        (
            '[[tiers]]\nname = "f"\nbackend = "file"\ncapacity = "1MiB"\n'
            'options = {path = "/tmp/x", colour = "blue"}\n',
            "unknown option(s) colour",
        ),
        (
            '[[tiers]]\nname = "f"\nbackend = "file"\ncapacity = "1MiB"\n'
            'options = {path = "/tmp/x", io_threads = "abc"}\n',
            "io_threads must be an integer",
        ),
    ],
    ids=["unknown backend", "missing path", "unknown option", "bad option type"],
)
def test_inspect_config_validates_backends_and_options(
    tmp_path: Path, tier: str, needle: str
) -> None:
    path = _write(tmp_path, DRAM + tier)
    assert needle in invoke("inspect", "config", "-c", str(path), code=2)["message"]


def test_inspect_config_check_opens_each_tier(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    good = _write(
        tmp_path,
        DRAM + '[[tiers]]\nname = "f"\nbackend = "file"\ncapacity = "1MiB"\n'
        f'options = {{path = "{tmp_path / "fs"}"}}\n',
    )
    args = ["inspect", "config", "-c", str(good), "--check", "--json"]
    result = CliRunner().invoke(get_app(), args)
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)["checks"]
    assert [(c["tier"], c["ok"]) for c in checks] == [("dram", True), ("f", True)]
    # the file store is checked without being created (before: --check created it)
    assert checks[1]["note"] == f"{tmp_path / 'fs'} will be created ({tmp_path} is writable)"
    assert not (tmp_path / "fs").exists()
    bad = _write(
        tmp_path,
        DRAM + '[[tiers]]\nname = "remote"\nbackend = "redis"\ncapacity = "1MiB"\n'
        f'options = {{url = "redis://127.0.0.1:{port}/0", op_timeout_s = 0.3, '
        "connect_timeout_s = 0.3}\n"
        + '[[tiers]]\nname = "locked"\nbackend = "nvme"\ncapacity = "1MiB"\n'
        f'options = {{path = "{tmp_path / "nv"}"}}\n',
    )
    (tmp_path / "nv").mkdir()
    (tmp_path / "nv" / "index.sqlite").write_bytes(b"not a database" * 100)
    result = CliRunner().invoke(get_app(), ["inspect", "config", "-c", str(bad), "--check"])
    assert result.exit_code == 1
    err = " ".join(result.stderr.split())
    assert "remote (redis) failed at write" in err and "onnect" in err
    assert "locked (nvme) failed at open" in err and "not a kvtier store index" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bench", "run", "--model", "tiny", "--turn-tokens", "999999999"], "at most 33,554,432"),
        (["bench", "run", "--workload", "speculative", "--model", "tiny", "--draft-tokens",
          "999999999"], "--draft-tokens must be at most"),
        (["bench", "io", "--tier", "dram", "--page-size", "64TiB", "--pages", "2"],
         "GiB is available: lower --pages or --page-size"),
        # a MemoryError reported as 'a kvtier bug' before
        (["bench", "codec", "--page-tokens", "100000000"],
         "GiB is available: lower --pages or --page-tokens"),
        (["bench", "codec", "--page-tokens", "0"], "--page-tokens must be an integer >= 1"),
        (["inspect", "stats", "--url", "http://127.0.0.1:1/x", "--timeout", "-1"],
         "--timeout must be a number of seconds"),
        (["inspect", "stats", "--url", "http://[::1"], "is not a valid URL"),
        # before: 'unexpected InvalidURL ... a kvtier bug' (exit 1), 'ordinal not in range'
        (["inspect", "stats", "--url", "http://127.0.0.1:1/x y"], "holds ' ' at position 20"),
        (["inspect", "stats", "--url", "http://127.0.0.1:1/m\u00e9trics"], "percent-encode"),
        (["bench", "run", "-c", str(DATA / "README.md")], "is not valid TOML"),
        # before: an infinite queue delay was taken, and the run waited forever
        (["bench", "run", "--model", "tiny", "--queue-delay-ms", "inf"],
         "--queue-delay-ms must be a number of ms from 0 to 60000 (a minute per turn), got inf"),
        (["bench", "run", "--model", "tiny", "--queue-delay-ms", "1e999"],
         "--queue-delay-ms must be a number of ms from 0 to 60000 (a minute per turn), got inf"),
        (["bench", "run", "--model", "tiny", "--queue-delay-ms", "-1"],
         "--queue-delay-ms must be a number of ms from 0 to 60000 (a minute per turn), got -1"),
        # before: taken, and each turn waited 115 days
        (["bench", "run", "--model", "tiny", "--queue-delay-ms", "1e10"],
         "--queue-delay-ms must be a number of ms from 0 to 60000 (a minute per turn)"),
    ],
)  # fmt: skip
def test_values_that_would_exhaust_memory_or_make_no_sense_are_refused(
    args: list[str], needle: str
) -> None:
    """Before: a huge --turn-tokens generated the token streams until the OOM killer came."""
    assert needle in invoke(*args, code=2)["message"]


def test_binary_config_files_are_named_by_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "kv.toml"
    binary.write_bytes(b"\xff\xfe[\x00m\x00")
    for args in (["inspect", "config", "-c", str(binary)], ["bench", "run", "-c", str(binary)]):
        assert "is not UTF-8 text" in invoke(*args, code=2)["message"]
    monkeypatch.setenv("KVTIER_CONFIG", str(binary))
    assert "is not UTF-8 text" in invoke("inspect", "config", code=2)["message"]


def test_inspect_config_check_names_a_plugin_that_cannot_be_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin whose constructor raises (it connects there and fails) is a tier failing
    at ``create`` in ``--check``, beside the tiers that pass (before: 'unexpected
    ValueError ... a kvtier bug', exit 1, no report)."""
    (tmp_path / "kvtier_ctor_fault.py").write_text(
        "from kvtier.backends.dram import DramArena\n\n"
        "class Store(DramArena):\n"
        "    def __init__(self, **kw):\n"
        "        raise ValueError('cannot connect to fancyd')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(
        tmp_path,
        DRAM + '[[tiers]]\nname = "far"\nbackend = "kvtier_ctor_fault:Store"\ncapacity = "1MiB"\n',
    )
    result = CliRunner().invoke(
        get_app(), ["inspect", "config", "-c", str(path), "--check", "--json"]
    )
    assert result.exit_code == 1, result.output
    checks = json.loads(result.stdout)["checks"]
    assert [(c["tier"], c["ok"], c["step"]) for c in checks] == [
        ("dram", True, None),
        ("far", False, "create"),
    ]
    assert "its constructor raised ValueError('cannot connect to fancyd')" in checks[1]["error"]
    # without --check the configuration cannot be shown either: the same error, exit 1
    error = invoke("inspect", "config", "-c", str(path), code=1)
    assert "tiers[1] (far, backend 'kvtier_ctor_fault:Store')" in error["message"]


@pytest.mark.parametrize("fault", ["delete_keeps", "wrong_bytes", "put_raises", "get_raises"])
async def test_config_check_catches_a_bad_probe_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """``--check`` fails a tier whose delete answers True but keeps the page, one that
    reads back wrong bytes, and one whose write or read raises, each at its step; no probe
    page is left in the tier."""
    import numpy as np
    from kvtier.backends.dram import DramArena

    from kvtier import tier_check
    from kvtier.config import load_config

    class Faulty(DramArena):
        deleted: tuple[bytes, ...] = ()

        async def delete(self, keys):  # type: ignore[no-untyped-def]
            self.deleted = (*self.deleted, *keys)
            if fault == "delete_keeps":
                return [True] * len(keys)
            return await super().delete(keys)

        async def put(self, keys, data, namespace=""):  # type: ignore[no-untyped-def]
            if fault == "put_raises":
                raise OSError("the pool refused the write")
            return await super().put(keys, data, namespace)

        async def get(self, keys, out):  # type: ignore[no-untyped-def]
            if fault == "get_raises":
                raise OSError("the pool refused the read")
            ok = await super().get(keys, out)
            if fault == "wrong_bytes":
                for o in out:
                    np.asarray(o)[0] ^= 0xFF
            return ok

    raw = {
        "model": {"preset": "tiny"},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": "64KiB"}],
    }
    cfg = load_config(raw, env={}).config
    made: list[DramArena] = []

    def create(config, i):  # type: ignore[no-untyped-def]
        made.append(Faulty(page_bytes=cfg.spec.page_bytes, capacity_pages=8))
        return made[-1]

    monkeypatch.setattr(tier_check, "create_backend", create)
    result = await tier_check.check_tier(cfg, 0)
    assert not result.ok
    want = {"delete_keeps": "delete", "wrong_bytes": "read", "put_raises": "write"}
    assert result.step == want.get(fault, "read")  # a raised error is named at its step
    if fault == "wrong_bytes":  # the probe was deleted on the way out
        assert len(made[0].deleted) == 1


@pytest.mark.parametrize("flag", [["--tiers", "hbm,dram"], ["--tier-scale", "2"],
                                  ["--block-tokens", "16"],
                                  ["--write-policy", "write-through"], ["--admission", "frequency"],
                                  ["--prefetch", "lookahead"], ["--hints"], ["--hardware", "cpu"],
                                  ["--model", "tiny"], ["--codec", "hbm=zstd"],
                                  # given with their default value: refused all the same
                                  # (before: they passed and the suite ran)
                                  ["--tiers", "hbm"], ["--tier-scale", "4.0"],
                                  ["--block-tokens", "512"], ["--write-policy", "write-back"],
                                  ["--admission", "reuse"], ["--no-hints"],
                                  ["--hardware", "h200-gen5"],
                                  ["--model", "llama3-70b"]])  # fmt: skip
def test_bench_sim_suite_refuses_the_options_it_does_not_use(flag: list[str]) -> None:
    """Before: --suite ran and ignored them (even --tiers hbm,hbm or --hardware bogus)."""
    error = invoke("bench", "sim", "--suite", "--requests", "20", *flag, code=2)
    assert error["message"].startswith("--suite replays one tier") and flag[0] in error["message"]


@pytest.mark.parametrize("half", ["tune", "held-out"])
def test_bench_sim_half_needs_the_suite(half: str) -> None:
    assert "add --suite" in invoke(*SIM, "--half", half, code=2)["message"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--source", "nosuch"], "unknown KV source 'nosuch'"),
        (["--pages", "0"], "must be >= 1"),
        (["--codec", "nosuch"], "nosuch"),
        # checked before the codec speed table is measured (before: after it)
        (["--tier", "dram"], "tier throughput runs on file, nvme, redis, not 'dram'"),
    ],
)
def test_bench_codec_errors_are_json_objects_with_json(args: list[str], needle: str) -> None:
    """Before: with --json a failing ``bench codec`` printed nothing on stdout."""
    assert (
        needle
        in invoke("bench", "codec", "--pages", "2", "--repeat", "1", *args, code=2)["message"]
    )
