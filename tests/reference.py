"""Moved to tests/parity.py (the shared parity helpers); kept for benchmarks/bench_checkpoint.py, which imports
`from reference import batches, rank_slice`. Tests import from parity."""

from parity import batches, rank_slice, tiny_model, to_numpy  # noqa: F401
