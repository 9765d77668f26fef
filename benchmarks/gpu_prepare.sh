#!/usr/bin/env bash
# Prepare a run of benchmarks/gpu_run.sh on a GPU machine that cannot download anything
# (the device tool's H200 image: Python 3.12, torch, CuPy 14, nvidia-cufile, numpy, typer,
# rich, xxhash, aiofiles, pytest, hypothesis). Run here, in the repository root:
#
#     benchmarks/gpu_prepare.sh [WHEEL_DIR]     # default .whl (ignored by git)
#
# It downloads, for CPython 3.12 on manylinux x86-64, the wheels that image lacks
# (kvtier's other dependencies, KvikIO for CUDA 13, pytest-asyncio and the pytest /
# hypothesis / typer versions kvtier's own venv uses, with pydantic, which that typer
# needs) and builds kvtier's own wheel from
# the working tree. Nothing is installed on this machine. Rerun after changing kvtier:
# its wheel is a snapshot.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$dir"
rm -f "$dir"/kvtier-*.whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
    manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# Same versions as kvtier's own venv where it has them, so the GPU run tests what CI tests.
pinned() { "$py" -m pip show "$1" 2>/dev/null | awk -v n="$1" '/^Version:/ {print n "==" $2}'; }
wanted=(structlog redis hiredis zstandard lz4 pytest-asyncio pytest hypothesis typer click
    pydantic pydantic-core annotated-types typing-inspection)
specs=()
for name in "${wanted[@]}"; do
    spec=$(pinned "$name")
    specs+=("${spec:-$name}")
done
specs+=(kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 "rapids-logger==0.3.*")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dir" "${specs[@]}"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" .
# what the wheel was built from: gpu_run.sh warns when the tree it runs in differs
git ls-files -z kvtier backends cli plugins pyproject.toml | xargs -0 cat | sha256sum \
    | cut -d' ' -f1 >"$dir/tree.sha"
echo "wheels in $dir:" && ls -1 "$dir" && du -sh "$dir"
