"""The load of `pdserve bench restart`: agent-like sessions whose prompts grow turn after turn, their greedy
reference, and the closed-loop streams that run them while services restart.

A session is a system prompt all sessions share, then `turns` completions; turn t+1's prompt is turn t's
prompt, turn t's answer and a new user message, as an agent's context grows:

    turn 0   [system][user 0]
    turn 1   [system][user 0][answer 0][user 1]
    turn 2   [system][user 0][answer 0][user 1][answer 1][user 2]

The answers in later prompts are the reference's (the offline engine's greedy output), not what the server
streamed: every request's prompt is fixed before the run, so a wrong token in one turn shows up as that one
request differing, not as every later turn of its session differing too.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

CLIENT_TIMEOUT_S = 900.0  # one completion, end to end: far above a drain, a migration and a restart together


@dataclass(frozen=True)
class Workload:
    sessions: int = 128  # distinct sessions; worker w runs sessions w, w + N, w + 2N, ... (wrapping)
    turns: int = 4
    min_tokens: int = 64  # max_tokens of each turn is uniform in [min_tokens, max_tokens]
    max_tokens: int = 96
    system_len: int = 80  # shared by every session: more than one 64-token KV block
    user_len: tuple[int, int] = (8, 40)
    seed: int = 0

    def __post_init__(self):
        if self.sessions < 1 or self.turns < 1 or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need sessions >= 1, turns >= 1 and 1 <= min_tokens <= max_tokens")


@dataclass(frozen=True)
class Turn:
    """One request of the workload and what an undisturbed greedy run answers to it."""

    session: int
    turn: int
    prompt: list[int]
    max_tokens: int
    want_ids: list[int]
    want_text: str


# generate(prompts, max_tokens per prompt) -> (ids, text) per prompt, greedy, ignoring EOS
Generate = Callable[[list[list[int]], list[int]], list[tuple[list[int], str]]]


def build_sessions(w: Workload, vocab_size: int, generate: Generate, min_token_id: int = 16) -> list[list[Turn]]:
    """Every session's turns with their reference answers: one `generate` call per turn index, over all
    sessions at once (the prompts of turn t+1 need the answers of turn t)."""
    rng = random.Random(w.seed)

    def piece(n: int) -> list[int]:
        return [rng.randrange(min_token_id, vocab_size) for _ in range(n)]

    system = piece(w.system_len)
    users = [[piece(rng.randint(*w.user_len)) for _ in range(w.turns)] for _ in range(w.sessions)]
    budgets = [[rng.randint(w.min_tokens, w.max_tokens) for _ in range(w.turns)] for _ in range(w.sessions)]
    prompts = [system + users[s][0] for s in range(w.sessions)]
    out: list[list[Turn]] = [[] for _ in range(w.sessions)]
    for t in range(w.turns):
        answers = generate(prompts, [budgets[s][t] for s in range(w.sessions)])
        for s, (ids, text) in enumerate(answers):
            out[s].append(Turn(s, t, prompts[s], budgets[s][t], list(ids), text))
            if t + 1 < w.turns:
                prompts[s] = prompts[s] + list(ids) + users[s][t + 1]
    return out


class OfflineEngine:
    """The undisturbed greedy answer: the offline engine on the deployment's checkpoint and KV dtype.

    Its prefix cache is off. With it on, turn t+1 would reuse the KV of turn t's answer that this engine's
    decode steps wrote; the served prefill computes those positions itself (a decode's KV never reaches a
    prefill), and the two differ in the last bits: enough to flip a near-tie (logits 1e-4 apart) and make an
    undisturbed served stream differ from the reference."""

    def __init__(self, model: str, kv_cache_dtype: str, num_blocks: int):
        from engine import LLM

        self.llm = LLM(model, kv_cache_dtype=kv_cache_dtype, num_blocks=num_blocks, enable_prefix_caching=False)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], str]]:
        from engine import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        return [(list(o.token_ids), o.text) for o in self.llm.generate(prompts, params)]

    def logits(self, ids: list[int], tokens: list[int]) -> dict[str, float]:
        """The logits of `tokens` for the position after `ids` (how close a greedy choice between them is), keyed
        by the token id as a string (as JSON keeps them)."""
        last = self.llm.prompt_logits(ids)[-1]
        return {str(t): round(float(last[t]), 5) for t in tokens}


# ---- the client -------------------------------------------------------------------------------------------

@dataclass
class Stream:
    """One completion as the client saw it; times are perf_counter seconds."""

    req_id: str  # the X-Request-Id sent: the router's logs name the request by it
    session: int
    turn: int
    worker: int
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def _body(model: str, turn: Turn) -> str:
    return json.dumps({"model": model, "prompt": turn.prompt, "max_tokens": turn.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})


async def stream_turn(http: aiohttp.ClientSession, url: str, model: str, turn: Turn, s: Stream) -> Stream:
    """POST one streaming completion; every failure lands in `s.error` (an HTTP status, an SSE error event,
    a broken connection, a stream that ends without a finish reason), never raises."""
    body = _body(model, turn)
    s.t_start = time.perf_counter()
    try:
        async with http.post(url.rstrip("/") + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json", "X-Request-Id": s.req_id}) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                await _read(resp, s)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    s.t_end = time.perf_counter()
    if s.error is None and s.finish_reason is None:
        s.error = f"stream ended without a finish reason after {len(s.token_ids)} tokens"
    return s


async def _read(resp: aiohttp.ClientResponse, s: Stream) -> None:
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data:"):])
        if "error" in chunk:
            s.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        for choice in chunk.get("choices") or ():
            now = time.perf_counter()
            ids = choice.get("token_ids") or []
            if ids and not s.chunks:
                s.t_first = now
            if ids:
                s.chunks.append((now, len(ids)))
            s.token_ids += ids
            s.text += choice.get("text") or ""
            s.finish_reason = choice.get("finish_reason") or s.finish_reason


class Load:
    """`concurrency` workers on a thread of their own (its event loop), each running sessions one after another
    and each session's turns in order, until `stop()`; then the requests in flight finish and `join()` returns
    every Stream. The caller's thread stays free to signal and restart services."""

    def __init__(self, url: str, model: str, sessions: list[list[Turn]], concurrency: int):
        self.url, self.model, self.sessions, self.concurrency = url, model, sessions, concurrency
        self.streams: list[Stream] = []
        self.completed = [0] * concurrency  # per worker (any outcome)
        self._stopping = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="restart-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def warmed_up(self) -> bool:
        """Every worker has completed a request: every stream is past its first prefill."""
        return min(self.completed) > 0

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout_s: float = CLIENT_TIMEOUT_S + 60) -> list[Stream]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the load's requests did not end within {timeout_s:.0f} s of the stop")
        return self.streams

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S, sock_connect=30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
            await asyncio.gather(*(self._worker(http, w) for w in range(self.concurrency)))

    async def _worker(self, http: aiohttp.ClientSession, w: int) -> None:
        k = 0
        while not self._stopping.is_set():
            session = self.sessions[(w + k * self.concurrency) % len(self.sessions)]
            k += 1
            for turn in session:
                if self._stopping.is_set():
                    return
                self._seq += 1
                s = Stream(f"s{turn.session}t{turn.turn}n{self._seq}", turn.session, turn.turn, w)
                self.streams.append(await stream_turn(http, self.url, self.model, turn, s))
                self.completed[w] += 1


async def replay(url: str, model: str, turns: list[Turn]) -> Stream:
    """Send `turns` (a session's first turns, in order) one after another, undisturbed; the last one's Stream.
    The earlier turns leave the caches as the load's sessions did before that turn."""
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for turn in turns:
            s = await stream_turn(http, url, model, turn, Stream(f"replay{turn.session}t{turn.turn}", turn.session,
                                                                 turn.turn, worker=-1))
    return s
