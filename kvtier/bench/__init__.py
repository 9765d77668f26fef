"""Benchmarks as a library: tier I/O against raw baselines, and the live chat workload.

Everything here returns plain data (dataclasses with ``to_dict``); only :mod:`kvtier.cli`
prints. Benchmarks are never timed tests: figures are reported as ratios against a raw
baseline measured in the same run, on the same memory, directory or server.
"""
