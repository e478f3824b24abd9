"""Fault injection on a running deployment (tests/helpers/system.py / `services.launch.launcher.up`): SIGKILL,
SIGSTOP/SIGCONT and restart of its service processes by record name, and streaming clients that
report how each request ended and how long it took.

Only processes of the given deployment are signalled, by pid, after checking the pid still runs the
recorded command line (never by name)."""

from __future__ import annotations

import http.client
import inspect
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

from engine import LLM, SamplingParams
from engine.runner.sampler import keyed_exponentials
from services.launch import launcher
from services.launch.topology import ROOT
from services.rpc.procs import tie_to_parent
from tests.helpers import system
from tests.helpers.pace import pinned

GREEDY = {"temperature": 0, "ignore_eos": True}


def record(dep: launcher.Deployment, name: str) -> launcher.ProcessRecord:
    found = [p for p in dep.processes if p.name == name]
    assert found, f"no process {name!r} in this deployment: {[p.name for p in dep.processes]}"
    return found[-1]


def _signal(dep: launcher.Deployment, name: str, sig: int) -> launcher.ProcessRecord:
    rec = record(dep, name)
    assert launcher._is_ours(rec), f"{name} (pid {rec.pid}) is not running the recorded command"
    os.kill(rec.pid, sig)
    return rec


def kill(dep: launcher.Deployment, name: str) -> None:
    """SIGKILL: the process gets no chance to deregister or say goodbye."""
    rec = _signal(dep, name, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while launcher._is_ours(rec) and time.monotonic() < deadline:
        time.sleep(0.05)


def pause(dep: launcher.Deployment, name: str) -> None:
    _signal(dep, name, signal.SIGSTOP)


def resume(dep: launcher.Deployment, name: str) -> None:
    _signal(dep, name, signal.SIGCONT)


def restart(dep: launcher.Deployment, name: str, env: dict[str, str] | None = None) -> launcher.ProcessRecord:
    """Start the recorded command again (same ports and instance id), tied to this process's life (and pinned
    where the launcher's services are)."""
    rec = record(dep, name)
    assert not launcher._is_ours(rec), f"{name} still runs: kill it first"
    full_env = {**os.environ, **(env or {})}
    path = [str(ROOT)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    full_env["PYTHONPATH"] = os.pathsep.join(path)
    with open(rec.log, "ab") as out, pinned():
        proc = subprocess.Popen(tie_to_parent(rec.cmd), cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    launcher._children[proc.pid] = proc  # reaped and stopped by launcher.down
    rec.pid = proc.pid
    return rec


def log_tail(dep: launcher.Deployment, *names: str, lines: int = 25) -> str:
    """The last lines of each named process's log and its exit status, for an assertion's message."""
    out = []
    for name in names:
        rec = record(dep, name)
        try:
            with open(rec.log, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError as exc:
            tail = [f"(no log: {exc})"]
        out.append(f"--- {name} (pid {rec.pid}, exit status {exit_code(dep, name)}):\n" + "\n".join(tail))
    return "\n".join(out)


def kill_redis(dep: launcher.Deployment) -> None:
    """SIGKILL the Redis the deployment started (a private one: never a shared server)."""
    assert dep.redis_pid and urlparse(dep.redis_url).port != 6379, "only the deployment's private Redis"
    os.kill(dep.redis_pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            with open(f"/proc/{dep.redis_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True
    assert system.wait_for(gone, timeout=60)


def exit_code(dep: launcher.Deployment, name: str) -> int | None:
    child = launcher._children.get(record(dep, name).pid)
    return None if child is None else child.poll()


# ---- clients ------------------------------------------------------------------------------------

@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None  # the SSE error event's "error" object
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids in the body
    done: bool = False  # saw data: [DONE]
    elapsed: float = 0.0
    exception: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None and self.done


def stream_completion(url: str, body: dict, timeout_s: float, started: threading.Event | None = None,
                      path: str = "/v1/completions") -> StreamResult:
    """POST a streaming /v1/completions (or /v1/chat/completions: `path`, the deltas' content is the text);
    read SSE until [DONE]. Every socket read is bounded, so the call returns within about `timeout_s`
    whatever the server does (a hang shows as `exception`)."""
    res, t0 = StreamResult(), time.monotonic()
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = json.loads(resp.read() or b"{}").get("error")
            return res
        while time.monotonic() - t0 < timeout_s:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                res.done = True
                break
            event = json.loads(data)
            if "error" in event:
                res.error = event["error"]
                continue
            choice = event["choices"][0]
            res.text += (choice["delta"].get("content") if "delta" in choice else choice.get("text")) or ""
            res.token_ids += choice.get("token_ids") or []
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if started is not None and res.text:
                started.set()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res.exception = f"{type(exc).__name__}: {exc}"
    finally:
        res.elapsed = time.monotonic() - t0
        conn.close()
    return res


@dataclass
class Load:
    """`num_streams` concurrent streaming requests in threads; `wait_started` returns once each has
    received text (so a fault lands mid-stream)."""

    url: str
    bodies: list[dict]
    timeout_s: float
    path: str = "/v1/completions"
    results: list[StreamResult | None] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _started: list[threading.Event] = field(default_factory=list)

    def start(self) -> Load:
        self.results = [None] * len(self.bodies)
        for i, body in enumerate(self.bodies):
            ev = threading.Event()

            def run(i=i, body=body, ev=ev):
                self.results[i] = stream_completion(self.url, body, self.timeout_s, ev, self.path)
                ev.set()
            self._started.append(ev)
            self._threads.append(threading.Thread(target=run, daemon=True))
            self._threads[-1].start()
        return self

    def wait_started(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        return all(ev.wait(max(deadline - time.monotonic(), 0)) for ev in self._started)

    def join(self) -> list[StreamResult]:
        for t in self._threads:
            t.join(self.timeout_s + 10)
        assert not any(t.is_alive() for t in self._threads), "a client call outlived its own timeout"
        return [r for r in self.results if r is not None]


# ---- checks -------------------------------------------------------------------------------------

CLIENT_TIMEOUT_S = 45.0  # every client call is bounded by this; the router's deadlines are far shorter
ROUTER = {"stream-idle-timeout-s": 5, "request-timeout-s": 40}  # router flags of the fault deployments


def corpus_ids(tok) -> list[int]:
    import argparse
    import difflib
    import typing
    ids = tok.encode("".join(inspect.getsource(m) for m in (difflib, argparse, typing, inspect)))
    assert len(ids) > 64_000, "the corpus is too short for the tests' slices"
    return ids


def instances(dep) -> dict[str, object]:
    return {i.instance_id: i for i in system.with_state(dep.redis_url, lambda s: s.instances())}


def _usage(address: str) -> float:
    return system.metric(address, "pdserve:kv_cache_usage_perc")


def assert_blocks_freed(addresses: list[str], timeout: float = 60.0) -> None:
    for a in addresses:
        assert system.wait_for(lambda: _usage(a) == 0, timeout=timeout), f"KV blocks still in use at {a}"


def complete_when_served(url: str, body: dict, timeout_s: float = CLIENT_TIMEOUT_S, wait_s: float = 120.0):
    """POST /v1/completions as a client told to "retry shortly" would: a 503 (no healthy instance of a role
    yet: e.g. a decode that a fault left busy past the stream-idle timeout, until its health check passes
    again) is retried for up to `wait_s`; any other answer is returned as it is."""
    deadline = time.monotonic() + wait_s
    while True:
        status, out = system.post(url, "/v1/completions", body, timeout=timeout_s)
        if status != 503 or time.monotonic() > deadline:
            return status, out
        time.sleep(0.5)


def bodies(corpus: list[int], n: int, max_tokens: int, start: int = 0) -> list[dict]:
    return [{"prompt": corpus[start + 400 * i: start + 400 * i + 90 + 23 * i], "max_tokens": max_tokens, **GREEDY}
            for i in range(n)]


def expected(offline: LLM, bodies: list[dict]) -> list[str]:
    outs = offline.generate([b["prompt"] for b in bodies],
                            SamplingParams(max_tokens=bodies[0]["max_tokens"], temperature=0.0, ignore_eos=True))
    return [o.text for o in outs]


NEAR_TIE = 1e-2  # logits closer than this are a near-tie: batching the same math differently may flip the argmax


def _race(offline: LLM, body: dict, tokens: list[int]) -> torch.Tensor:
    """What picks the token after `tokens` (prompt and output so far), in logit units: the logits for a greedy
    body; for a seeded one (temperature t, no other filter) t * (logits / t - log E), E the keyed exponentials at
    that token's sequence position (engine/runner/sampler.py), whose argmax is the seeded draw."""
    last = offline.prompt_logits(tokens)[-1].float()
    t = body.get("temperature", 0.0)
    if t == 0.0:
        return last
    seed, pos = torch.tensor([body["seed"]]), torch.tensor([len(tokens)])
    return last - t * torch.log(keyed_exponentials(seed, pos, last.numel())[0])


def assert_stream_matches(offline: LLM, body: dict, got: list[int], max_ties: int = 2) -> None:
    """A served stream's token ids against the undisturbed offline run, greedy or seeded. They may part only
    where the reference's choice was a near-tie: the two candidates' scores (`_race`: the logits, or a seeded
    draw's race) within NEAR_TIE, which a different batching of the same math can flip; past each such step the
    reference continues from the served token (a seeded draw is keyed on its position, so the continuation
    draws what the served run drew) and must match again. Anything else (a different token at a clear margin,
    a lost or repeated token) fails."""
    unfiltered = all(body.get(k) in (None, 0, -1, 1.0, 0.0) for k in ("top_k", "top_p", "min_p"))
    assert unfiltered and (body.get("temperature", 0.0) == 0.0 or "seed" in body), \
        f"only greedy or seeded unfiltered streams can be checked against a near-tie: {body}"
    prompt, n = list(body["prompt"]), body["max_tokens"]

    def reference(head: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=n - len(head), temperature=body.get("temperature", 0.0),
                                seed=body.get("seed"), ignore_eos=True)
        return head + (list(offline.generate([prompt + head], params)[0].token_ids) if n - len(head) else [])

    want = reference([])
    for _ in range(max_ties + 1):
        assert len(got) == n, f"served {len(got)} tokens, asked for {n}"
        p = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if p is None:
            return
        score = _race(offline, body, prompt + got[:p])
        gap = abs(float(score[got[p]]) - float(score[want[p]]))
        assert gap < NEAR_TIE, (f"token {p}: served {got[p]}, reference {want[p]} by a margin of {gap:.4g} "
                                f"(not a near-tie)")
        want = reference(got[:p + 1])
    raise AssertionError(f"more than {max_ties} near-ties in one stream: {got} against {want}")
