"""kvtier's remote tier on Mooncake Store, registered as the ``mooncake`` backend.

See :class:`kvtier_mooncake.store.MooncakeStore`; :mod:`kvtier_mooncake.server` starts a
``mooncake_master`` (with its HTTP metadata server) and a memory pool on 127.0.0.1 for
tests and benchmarks.
"""

import os

__version__ = "0.1.0"

# Mooncake's C++ client logs through glog to stderr: some 19 INFO and WARNING lines per
# client set-up on a successful run. kvtier reports what matters itself (set-up failures,
# outages, each read that fails), so Mooncake's level defaults to ERROR here unless the
# environment sets MC_LOG_LEVEL (MC_LOG_LEVEL=INFO shows everything again). One ERROR line
# remains per set-up, "GET .../metadata?key=mooncake/ram/... http=404 ... metadata not
# found": Mooncake looks up its own segment before registering it and logs the miss as an
# error; no level keeps it out without hiding real errors. Must be set before Mooncake's
# library loads (it reads the variable once).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from kvtier_mooncake.bench_profile import register as _register_bench_profile

_register_bench_profile()  # `kvtier bench io --tier mooncake` gets its own baseline
