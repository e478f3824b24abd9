"""Agentic-coding traces (kv-cache-tester format) as replayable sessions.

A trace file holds one recorded session: a list of requests (`type` "n"/"s") and subagent entries
(`type` "subagent", a nested list of requests). We turn it into a tree of steps:

    Session.steps = [Turn, Turn, SubagentGroup(Session, Session), Turn, ...]

A Turn is sent `think_s` after the previous step of its session completed. A SubagentGroup starts
its sessions together when the previous step completed and the step after it waits for all of them.

Timing facts of the recordings (checked on every bundled trace): a subagent entry's `t` is when it
*finished*, `t - duration_ms/1000` is when it started, and it started right after the parent turn
before it completed; consecutive subagents that overlap in time ran in parallel; the parent's next
turn came after the last of them finished. A turn's `think_time` is the gap between the end of the
previous turn and its own start, so a turn after subagents waits `t - (end of the last subagent)`.
"""

from __future__ import annotations

import glob
import gzip
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

BLOCK_SIZE = 64


@dataclass(frozen=True)
class Turn:
    """One request: exactly `input_len` prompt tokens, `output_len` generated tokens (EOS ignored)."""

    turn_id: int  # unique within the trace (depth-first order); keys the request's unique tail
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]  # one id per full 64-token block of the prompt
    think_s: float  # wait after the previous step of the session completed


@dataclass(frozen=True)
class SubagentGroup:
    sessions: tuple[Session, ...]  # run concurrently
    think_s: float  # wait after the previous step completed before they start


@dataclass(frozen=True)
class Session:
    steps: tuple[Turn | SubagentGroup, ...]

    def turns(self) -> list[Turn]:
        """Every turn, subagents included, depth first."""
        out: list[Turn] = []
        for step in self.steps:
            if isinstance(step, Turn):
                out.append(step)
            else:
                for s in step.sessions:
                    out.extend(s.turns())
        return out


@dataclass(frozen=True)
class Trace:
    trace_id: str
    session: Session

    @property
    def num_requests(self) -> int:
        return len(self.session.turns())

    @property
    def max_request_tokens(self) -> int:
        return max((t.input_len + t.output_len for t in self.session.turns()), default=0)


# ---- parsing -------------------------------------------------------------------------------------

def parse_trace(data: dict[str, Any], *, token_scale: float = 1.0) -> Trace:
    """A trace dict (one decoded file) -> Trace, with every token length scaled by `token_scale`."""
    if not isinstance(data.get("requests"), list):
        raise ValueError(f"trace {data.get('id', '?')!r} has no 'requests' list")
    if int(data.get("block_size", BLOCK_SIZE)) != BLOCK_SIZE:
        raise ValueError(f"trace {data.get('id')!r}: block_size {data['block_size']} != {BLOCK_SIZE}")
    if token_scale <= 0:
        raise ValueError(f"token_scale must be positive, got {token_scale}")
    counter = iter(range(1 << 62))
    session = _parse_session(data["requests"], token_scale, counter, str(data.get("id", "?")))
    return Trace(trace_id=str(data.get("id", "trace")), session=session)


def _parse_session(entries: list[dict[str, Any]], scale: float, counter, trace_id: str) -> Session:
    steps: list[Turn | SubagentGroup] = []
    prev_end: float | None = None  # recorded end of the previous step, seconds since session start
    after_subagents = False
    i = 0
    while i < len(entries):
        if entries[i].get("type") == "subagent":
            j = i
            while j < len(entries) and entries[j].get("type") == "subagent":
                j += 1
            groups, prev_end = _parse_subagents(entries[i:j], scale, counter, trace_id)
            steps.extend(groups)
            i, after_subagents = j, True
            continue
        entry = entries[i]
        # `think_time` counts from the previous *turn*; after subagents the wait counts from their end
        if not steps:
            think = 0.0
        elif after_subagents or entry.get("think_time") is None:
            think = float(entry["t"]) - prev_end if prev_end is not None else 0.0
        else:
            think = float(entry["think_time"])
        steps.append(_parse_turn(entry, think, scale, counter, trace_id))
        prev_end = float(entry["t"]) + float(entry.get("api_time") or 0.0)
        i, after_subagents = i + 1, False
    return Session(tuple(steps))


def _parse_turn(entry: dict[str, Any], think: float, scale: float, counter, trace_id: str) -> Turn:
    try:
        n_in, n_out, ids = int(entry["in"]), int(entry["out"]), [int(h) for h in entry["hash_ids"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"trace {trace_id!r}: request lacks in/out/hash_ids ({e})") from e
    if len(ids) != n_in // BLOCK_SIZE:
        raise ValueError(f"trace {trace_id!r}: {len(ids)} hash_ids for in={n_in} (expected in // 64)")
    n_in_s, n_out_s = scale_len(n_in, scale), scale_len(n_out, scale)
    return Turn(turn_id=next(counter), input_len=n_in_s, output_len=n_out_s,
                hash_ids=scale_hash_ids(ids, n_in_s, scale), think_s=max(think, 0.0))


def _parse_subagents(entries, scale, counter, trace_id) -> tuple[list[SubagentGroup], float]:
    """Consecutive subagent entries -> groups of overlapping (parallel) ones, and the last one's end.

    The first group starts as the parent's turn completes; a subagent that starts after the running
    group finished opens a new group, which waits for the recorded gap."""
    groups: list[SubagentGroup] = []
    members: list[Session] = []
    group_end, think = 0.0, 0.0
    for e in entries:
        end = float(e["t"])
        start = end - float(e.get("duration_ms") or 0.0) / 1000.0
        if members and start >= group_end:
            groups.append(SubagentGroup(tuple(members), think))
            members, think = [], start - group_end
        members.append(_parse_session(e.get("requests") or [], scale, counter, trace_id))
        group_end = end if len(members) == 1 else max(group_end, end)
    groups.append(SubagentGroup(tuple(members), think))
    return groups, group_end


def scale_len(n: int, scale: float) -> int:
    """A token length under `--token-scale` (never below 1: every request sends and receives)."""
    return max(int(round(n * scale)), 1)


def scale_hash_ids(ids: list[int], scaled_len: int, scale: float) -> tuple[int, ...]:
    """Keep every (1/scale)-th block id, so two prompts that share their first m blocks share about
    the first m·scale blocks after scaling: the prefix structure shrinks in proportion."""
    n_blocks = scaled_len // BLOCK_SIZE
    if not ids:
        return ()
    return tuple(ids[min(int(j / scale), len(ids) - 1)] for j in range(n_blocks))


# ---- loading -------------------------------------------------------------------------------------

def trace_files(spec: str | None) -> list[Path]:
    """A folder, a glob, a file, or a comma-separated list of these -> sorted trace files."""
    paths: list[Path] = []
    if not spec:
        raise ValueError("no traces given: pass --traces DIR|GLOB|FILES (recorded agent sessions, *.json[.gz])")
    for part in spec.split(","):
        p = Path(part)
        if p.is_dir():
            paths.extend(sorted(p.glob("*.json.gz")) + sorted(p.glob("*.json")))
        elif p.is_file():
            paths.append(p)
        else:
            paths.extend(Path(x) for x in sorted(glob.glob(part)))
    if not paths:
        raise ValueError(f"no trace files found at {spec} (pass --traces DIR|GLOB|FILES)")
    return paths


def load_traces(spec: str | None, *, token_scale: float = 1.0, max_traces: int | None = None) -> list[Trace]:
    traces = []
    for path in trace_files(spec)[:max_traces]:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not a JSON trace: {e}") from e
        trace = parse_trace(data, token_scale=token_scale)
        traces.append(replace(trace, trace_id=trace.trace_id or path.stem))
    return traces
