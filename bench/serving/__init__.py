"""Benchmarks against a running server: agentx trace replay, bench serve, the load/soak test, metrics, plots,
results."""
