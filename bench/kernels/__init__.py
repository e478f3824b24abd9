"""Kernel benchmarks (`python -m bench.kernels`, `python -m bench.kernels.hisparse`) and their CUDA timing helpers."""
