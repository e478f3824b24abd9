"""Benchmarks against a running server: agentx trace replay, bench serve, the load/soak test, rolling restarts
under load (bench restart), metrics, plots, results."""
