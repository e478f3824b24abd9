"""Prefill benchmarks: one-GPU layer stack, PCP x DCP x EP scaling with its report, context-parallel
communication volume."""
