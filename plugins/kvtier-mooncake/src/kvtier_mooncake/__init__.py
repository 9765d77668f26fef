"""kvtier's remote tier on Mooncake Store, registered as the ``mooncake`` backend.

See :class:`kvtier_mooncake.store.MooncakeStore`; :mod:`kvtier_mooncake.server` starts a
``mooncake_master`` (with its HTTP metadata server) and a memory pool on 127.0.0.1 for
tests and benchmarks.
"""

__version__ = "0.1.0"

from kvtier_mooncake.bench_profile import register as _register_bench_profile

_register_bench_profile()  # `kvtier bench io --tier mooncake` gets its own baseline
