"""An example kvtier plugin: see :mod:`kvtier_example.memstore`."""

from kvtier_example.memstore import MemoryStore

__all__ = ["MemoryStore"]
