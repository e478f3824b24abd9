"""What several test modules share and is not a fixture: the repository root, deployments and fault
injection of the e2e tier, waiting on a slow machine (pace.py: events polled, latencies scaled, services
pinned; env.py: the variables that change how tests run), kernel inputs, the HF oracle, fake servers,
rank-side checks."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
