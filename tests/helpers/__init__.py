"""What several test modules share and is not a fixture: the repository root, deployments and fault
injection of the e2e tier, kernel inputs, the HF oracle, fake servers, rank-side checks."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
