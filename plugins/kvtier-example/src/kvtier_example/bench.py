"""The example store's profile for ``kvtier bench io``: no options (the store keeps its
pages in process memory) and a memcpy of the same bytes as the raw baseline. Registered in
``pyproject.toml`` under the ``kvtier.bench_io_profiles`` entry-point group, named like the
backend, so ``kvtier bench io --tier example-mem`` finds it."""

from kvtier.bench.baselines import IOProfile, memcpy_baseline, no_options

PROFILE = IOProfile(
    options=no_options,
    baseline=memcpy_baseline,
    description="memcpy into separate buffers",
)
