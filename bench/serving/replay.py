"""The AgentX replay scheduler: `concurrency` session slots, each replaying trace after trace.

Timeline of one concurrency level (seconds from its start):

    0 ── ramp-up ──▶ warmup_s ───────── measured window ─────────▶ warmup_s + duration_s ── drain ──▶
    slots start      requests sent from here on count              no new turn starts; in-flight
    staggered        in the metrics                                requests finish or are cancelled
                                                                   after drain_timeout_s

Inside a session, a turn is sent `think_s · think_time_scale` (capped at `max_think_s`) after the
previous step completed; a subagent group runs its sessions concurrently and the parent's next step
waits for all of them. Concurrency counts sessions, so a session with parallel subagents can have
several requests in flight. Each session copy gets a unique id that keys its synthetic prompt
(see bench/serving/synth.py), so copies never share cache while its own turns do.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.serving.client import RequestRecord
from bench.serving.synth import PromptSynth
from bench.serving.traces import Session, Trace, Turn

# send(prompt, max_tokens, record) fills `record` (times, tokens, error) and returns it
SendFn = Callable[[list[int], int, RequestRecord], Awaitable[RequestRecord]]
BIG_PROMPT = 32_768  # synthesise longer prompts off the event loop so other streams keep their timing


@dataclass(frozen=True)
class ReplayConfig:
    concurrency: int
    duration_s: float
    warmup_s: float = 0.0
    think_time_scale: float = 1.0
    max_think_s: float | None = None
    max_context: int | None = None  # prompt + max_tokens above this: not sent, counted as overflow
    ramp_up_s: float = 0.0
    drain_timeout_s: float = 60.0
    seed: int = 0
    copy_offset: int = 0  # first session-copy id of this level; keep levels of one run disjoint
    max_consecutive_errors: int = 5  # then the session copy is abandoned and the slot starts another
    vocab_size: int = 4096
    min_token_id: int = 16

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.ramp_up_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("duration must be > 0 and warm-up, ramp-up and drain timeout >= 0")
        if self.think_time_scale < 0:
            raise ValueError(f"think_time_scale must be >= 0, got {self.think_time_scale}")


@dataclass
class LiveStats:
    """Counters the progress bar reads while the level runs."""

    in_flight: int = 0
    completed: int = 0
    errors: int = 0
    overflows: int = 0
    output_tokens: int = 0
    sessions_started: int = 0


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    t_begin: float  # perf_counter at the level's start
    t_measure: float  # end of warm-up
    t_stop: float  # no new turn after this
    t_end: float  # every slot finished (drained or cancelled)
    sessions: list[str] = field(default_factory=list)  # session copies started, in order


@dataclass
class _Copy:
    """One replay of one trace: its prompt synthesiser and error streak."""

    key: str
    synth: PromptSynth
    consecutive_errors: int = 0
    aborted: bool = False


class Replayer:
    """`clock`: the time the level runs on (perf_counter; the simulator's virtual loop time, bench/simulate/)."""

    def __init__(self, traces: list[Trace], send: SendFn, cfg: ReplayConfig,
                 clock: Callable[[], float] = time.perf_counter, big_prompt: float = BIG_PROMPT):
        if not traces:
            raise ValueError("no traces to replay")
        self.clock = clock
        self.big_prompt = big_prompt  # prompts above it are synthesised in a thread (never, on a virtual clock)
        self.traces = traces
        self.send = send
        self.cfg = cfg
        self.stats = LiveStats()
        self.records: list[RequestRecord] = []
        self.sessions: list[str] = []
        self._order = list(range(len(traces)))
        random.Random(cfg.seed).shuffle(self._order)
        self._next_copy = 0
        self.t_begin = self.t_measure = self.t_stop = 0.0

    def phase(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        return "warmup" if now < self.t_measure else "measure" if now < self.t_stop else "drain"

    async def run(self) -> ReplayResult:
        cfg = self.cfg
        self.t_begin = self.clock()
        self.t_measure = self.t_begin + cfg.warmup_s
        self.t_stop = self.t_measure + cfg.duration_s
        slots = [asyncio.create_task(self._slot(i)) for i in range(cfg.concurrency)]
        try:
            await asyncio.wait(slots, timeout=self.t_stop + cfg.drain_timeout_s - self.clock())
        finally:
            for task in slots:
                task.cancel()
            results = await asyncio.gather(*slots, return_exceptions=True)
        for r in results:  # a bug in a slot must not pass as a quiet benchmark
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r
        return ReplayResult(self.records, self.t_begin, self.t_measure, self.t_stop, self.clock(),
                            self.sessions)

    async def _slot(self, slot: int) -> None:
        await asyncio.sleep(self.cfg.ramp_up_s * slot / self.cfg.concurrency)
        while self.clock() < self.t_stop:
            idx = self._next_copy
            self._next_copy += 1
            trace = self.traces[self._order[idx % len(self.traces)]]
            copy_id = self.cfg.copy_offset + idx
            copy = _Copy(f"{trace.trace_id}#{copy_id}",
                         PromptSynth(trace.trace_id, copy_id, vocab_size=self.cfg.vocab_size,
                                     min_token_id=self.cfg.min_token_id))
            self.sessions.append(copy.key)
            self.stats.sessions_started += 1
            await self._run_session(trace.session, copy, depth=0)
            if copy.aborted:  # a failing server: do not spin through traces
                await asyncio.sleep(min(1.0, max(self.t_stop - self.clock(), 0.0)))

    async def _run_session(self, session: Session, copy: _Copy, depth: int) -> None:
        for step in session.steps:
            if not await self._think(step.think_s) or copy.aborted:
                return
            if isinstance(step, Turn):
                await self._send_turn(step, copy, depth)
            else:
                await asyncio.gather(*(self._run_session(s, copy, depth + 1) for s in step.sessions))

    async def _think(self, think_s: float) -> bool:
        """Sleep the scaled think time; False when the run stops before it ends."""
        wait = think_s * self.cfg.think_time_scale
        if self.cfg.max_think_s is not None:
            wait = min(wait, self.cfg.max_think_s)
        if self.clock() + wait >= self.t_stop:
            return False
        if wait > 0:
            await asyncio.sleep(wait)
        return True

    async def _send_turn(self, turn: Turn, copy: _Copy, depth: int) -> None:
        rec = RequestRecord(prompt_len=turn.input_len, max_tokens=turn.output_len, session=copy.key, depth=depth)
        now = self.clock()
        rec.measured = now >= self.t_measure
        if self.cfg.max_context is not None and turn.input_len + turn.output_len > self.cfg.max_context:
            rec.overflow, rec.t_start, rec.t_end = True, now, now
            self.stats.overflows += 1
            self.records.append(rec)
            return
        if turn.input_len > self.big_prompt:
            prompt = await asyncio.to_thread(copy.synth.prompt, turn)
        else:
            prompt = copy.synth.prompt(turn)
        self.stats.in_flight += 1
        try:
            rec = await self.send(prompt, turn.output_len, rec)
        except asyncio.CancelledError:
            rec.cancelled, rec.t_end = True, self.clock()
            raise
        finally:
            self.stats.in_flight -= 1
            if rec.t_start:  # the send's own start decides: prompt synthesis may cross the warm-up's end
                rec.measured = rec.t_start >= self.t_measure
            self.records.append(rec)
        self._count(rec, copy)

    def _count(self, rec: RequestRecord, copy: _Copy) -> None:
        if rec.error is not None:
            self.stats.errors += 1
            copy.consecutive_errors += 1
            copy.aborted = copy.consecutive_errors >= self.cfg.max_consecutive_errors
        else:
            self.stats.completed += 1
            self.stats.output_tokens += rec.output_tokens
            copy.consecutive_errors = 0
