"""Small AgentX-format trace folders for the replay tests (`bench agentx`, `pdserve simulate`): sessions of
growing prompts that share their prefixes, one with a subagent."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def request(t: float, n_in: int, n_out: int, first_id: int, think: float) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": n_out, "api_time": 0.5, "think_time": think,
            "hash_ids": list(range(first_id, first_id + n_in // 64))}


def write_traces(folder: Path, out_scale: int = 1) -> Path:
    """Two sessions (the second with a subagent) as trace_a / trace_b .json.gz in `folder`; output lengths
    times `out_scale`."""
    o = out_scale
    sub = {"type": "subagent", "t": 3.0, "duration_ms": 2000,
           "requests": [request(0.0, 300, 6 * o, 500, 0.0), request(1.0, 420, 4 * o, 500, 1.0)]}
    sessions = {"trace_a": [request(0.0, 700, 8 * o, 1, 0.0), request(2.0, 900, 5 * o, 1, 2.0),
                            request(4.0, 1000, 9 * o, 1, 1.0)],
                "trace_b": [request(0.0, 500, 7 * o, 1, 0.0), sub, request(5.0, 650, 6 * o, 1, 2.0)]}
    folder.mkdir(parents=True, exist_ok=True)
    for name, reqs in sessions.items():
        with gzip.open(folder / f"{name}.json.gz", "wt") as f:
            json.dump({"id": name, "block_size": 64, "requests": reqs}, f)
    return folder
