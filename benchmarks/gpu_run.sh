#!/usr/bin/env bash
# The prepared GPU run: kvtier's GPU tests, the GPU check, and the whole hierarchy
# (HBM -> pinned DRAM -> NVMe with KvikIO) under `kvtier bench run` and `kvtier bench io`.
#
#     benchmarks/gpu_prepare.sh            # here: wheels the GPU image lacks, into .whl/
#     OUT=DIR benchmarks/gpu_run.sh        # there, in the repository root
#
# With .whl/ present it first installs those wheels (kvtier's own included) into
# /tmp/kvtier-gpu-site, without dependencies and without touching the system's packages,
# and puts that first on PYTHONPATH. Each step has its own time limit and its output goes
# to $OUT (default /tmp/kvtier-gpu-out): env.txt, pytest.log, gpu_check.json,
# bench_run.json, bench_speculative.json (block tables over HBM), bench_io_4MiB.json,
# bench_io_64KiB.json, steps.log. A failing step is
# recorded and the next one runs; the exit status is the number of failed steps.
# Without a GPU every step still runs: GPU tests skip with their reason, the GPU check
# exits 2, and the bench steps fail at the hbm tier (a rehearsal of the script itself).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvtier-gpu-out}
py=${PYTHON:-python3}
mkdir -p "$out"
log="$out/steps.log"
# Disk scratch beside the working tree (on the machine's disk, not a tmpfs /tmp); removed
# at exit.
scratch=$(mktemp -d -p "$PWD" .gpu-scratch.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
failed=0

step() {  # step NAME SECONDS COMMAND... : run with a time limit, record how it ended
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

# -P: the source folder kvtier/ in the working directory must not shadow the installed one
kvtier=("$py" -P -m kvtier)

if compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/kvtier-gpu-site
    step install 45 "$py" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # the carried kvtier wheel is a snapshot of the tree gpu_prepare.sh ran on
    if [ -f .whl/tree.sha ]; then
        now=$(git ls-files -z kvtier backends cli plugins pyproject.toml 2>/dev/null \
            | xargs -0 cat 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [ "$now" != "$(cat .whl/tree.sha)" ]; then
            echo "WARNING: .whl/ was built from another tree: rerun gpu_prepare.sh" \
                | tee -a "$log"
        fi
    fi
fi
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID

# The limits add up to 450 s (a device command may run 600 s, and the session's device
# time, start-up included, is 15 minutes): correctness first, then the hierarchy's
# figures never measured yet, then the GPU check, which writes its JSON after each
# section, so a step cut by its limit keeps what it measured.
timeout 30 bash -c '
    date -u
    nvidia-smi 2>&1 | head -20
    "$0" -P - <<'"'"'PY'"'"'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("kvtier", "torch", "cupy", "kvikio", "numpy", "pytest", "pytest_asyncio",
             "typer", "pydantic", "structlog", "redis", "zstandard", "lz4"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(name, "not importable:", repr(exc))
PY
    "$0" -P -m kvtier inspect backends 2>&1
    "$0" -P -m kvtier inspect topology --path "$1" 2>&1
    df -hT "$1" /tmp 2>&1
' "$py" "$scratch" >"$out/env.txt" 2>&1

step pytest 110 "$py" -m pytest -q -p no:cacheprovider -rs \
    tests/test_hbm.py tests/test_hbm_hierarchy.py tests/test_dram.py tests/test_registry.py \
    tests/test_layout.py tests/test_cli_bench_io.py tests/test_nvme_conformance.py \
    tests/test_nvme_store.py tests/test_nvme_kvikio_standin.py \
    tests/test_conformance_builtin.py tests/test_numa.py tests/test_topology.py \
    tests/test_vllm_groups.py tests/test_cli_polish.py::test_python_dash_m_runs_every_command \
    >"$out/pytest.log" 2>&1
step bench_run 60 "${kvtier[@]}" bench run -c benchmarks/gpu_tiers.toml --json \
    --nvme-dir "$scratch/bench-run" \
    >"$out/bench_run.json" 2>>"$log"
step bench_speculative 45 "${kvtier[@]}" bench run -c benchmarks/gpu_tiers.toml --json \
    --workload speculative --nvme-dir "$scratch/bench-spec" \
    >"$out/bench_speculative.json" 2>>"$log"
for size in 4MiB 64KiB; do
    step "bench_io_$size" 30 "${kvtier[@]}" bench io --tier hbm --tier dram --tier nvme \
        --page-size "$size" --pages 64 --repeats 5 --dir "$scratch" --json \
        >"$out/bench_io_$size.json" 2>>"$log"
done
step gpu_check 130 "$py" benchmarks/gpu_check.py --budget-s 90 --nvme-dir "$scratch" \
    --out "$out/gpu_check.json" 2>>"$log" >/dev/null
echo "failed steps: $failed" | tee -a "$log"
exit "$failed"
