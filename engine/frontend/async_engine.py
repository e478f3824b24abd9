"""AsyncEngine: the EngineCore driven from asyncio, with one stream of outputs per request.

    engine thread   applies the queued commands (requests, aborts, service calls), steps the core, hands
                    each step's outputs to the event loop, and steps again at once: it never waits for them
    event loop      output processing — detokenization, stop strings (an abort queued back to the engine
                    thread), logprobs — and streaming to each request's queue

The core is only ever touched by the engine thread; commands queued from the event loop are applied
between two steps, and their results come back as futures. With async scheduling the core's step returns
the previous step's outputs while the next one runs on the GPU, so neither Python side keeps the GPU
waiting (docs/async_scheduling.md). `stats()` is a snapshot the engine thread takes between steps, at most
every STATS_PERIOD_S while it is busy (reading some of it, HiSparse's counters, waits for the GPU).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.config.arg_utils import EngineArgs
from engine.config.engine import EngineConfig
from engine.core.core import EngineStats
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.warmup import warm_up
from engine.frontend.core_factory import make_engine_core
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.outputs import RequestOutput
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.05  # how stale stats() may be while the engine is busy
IDLE_POLL_S = 0.005  # with requests that cannot be scheduled yet, how often the engine thread looks again
STEP_LOG_LEN = 1 << 16  # steps kept for `drain_step_times` (a reader every 0.5 s leaves far fewer)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every open stream gets this error."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | EngineArgs, core: Any = None, tokenizer: Tokenizer | None = None,
                 text: bool = True, cumulative: bool = True):
        """text False: the outputs carry token ids only, except for requests with stop strings (which need the
        text to be found). cumulative False: a stream's outputs carry the step's delta (`delta_token_ids`, and
        `logprobs` for just those tokens), the whole `token_ids` only on the final one, so a step costs the same
        however long a request has run. The services use both (they stream deltas of token ids)."""
        self.cumulative = cumulative
        self.config = config.create_engine_config() if isinstance(config, EngineArgs) else config
        self.core = core if core is not None else make_engine_core(self.config)
        if self.config.warmup:  # kernels compile now, not in a served step (engine/core/warmup.py)
            warm_up(self.core)
        if tokenizer is None:
            try:
                tokenizer = Tokenizer(self.config.model_path)
            except FileNotFoundError:
                tokenizer = None
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, text=text)
        self._streams: dict[str, asyncio.Queue] = {}
        self._commands: list[tuple[Callable, asyncio.Future | None]] = []  # under _lock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self.last_stats: EngineStats = self.core.stats()
        self._stats_at = 0.0
        # (seconds of a step that ran, seconds since the one before it ended or None after idle): each step's own
        # time and the engine thread's time between two steps while it had work (commands, posting outputs, waiting
        # for the interpreter lock), appended by the engine thread, read by `drain_step_times`
        self._step_log: collections.deque[tuple[float, float | None]] = collections.deque(maxlen=STEP_LOG_LEN)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread after the step it is in (the core is left as it is)."""
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    output_token_ids: list[int] = (), **request_kwargs) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError on bad input), queue for the loop, return the output stream.
        `output_token_ids`: tokens the request already generated elsewhere (a migrated request): the engine
        computes their KV with the prompt's and continues after them; the stream carries only new tokens."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        req = Request(req_id=req_id or f"req-{next(self._ids)}", prompt_token_ids=list(prompt_token_ids),
                      sampling_params=params, **request_kwargs)
        if output_token_ids:
            req.append_output(list(output_token_ids))
        self.core.validate(req)
        if req.req_id in self._streams:
            raise ValueError(f"request id {req.req_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.req_id] = queue
        self.processor.add(req)
        # a request the core turns down between two steps (its checks ran above, but the core's state may
        # have moved on since) ends its stream with the reason, rather than leaving it waiting forever
        added = (self._loop or asyncio.get_running_loop()).create_future()
        added.add_done_callback(lambda f: queue.put_nowait(f.exception())
                                if not f.cancelled() and f.exception() is not None else None)
        self._submit(lambda core: core.add_request(req), added)
        return self._stream(req.req_id, queue)

    async def add_import_request(self, req: Request, num_import_tokens: int, rank: int | None = None):
        """Decode/prefill services: admit `req` whose first `num_import_tokens` tokens' KV the caller
        will write. Returns (output stream, all block ids, tokens already cached locally), or None when
        the KV pool is short right now. Call `import_done` once the bytes are in (or failed). `rank`: the
        DP rank of a DP group that takes it (its block ids are that rank's); None for any other engine."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        self.core.validate(req)
        if req.req_id in self._streams:
            raise ValueError(f"request id {req.req_id!r} is already running")
        where = {} if rank is None else {"rank": rank}
        reserved = await self.call(lambda core: core.reserve_import(req, num_import_tokens, **where))
        if reserved is None:
            return None
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.req_id] = queue
        self.processor.add(req)
        return self._stream(req.req_id, queue), reserved[0], reserved[1]

    def import_done(self, req_id: str, ok: bool, num_tokens: int | None = None) -> None:
        self._submit(lambda core: core.import_done(req_id, ok, num_tokens))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None,
                       **kw) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(prompt_token_ids, params, req_id, **kw):
            yield out

    async def _stream(self, req_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req_id, None)
            if not finished:  # the consumer went away (client disconnect): free the request's KV now
                self.abort(req_id)

    def abort(self, req_id: str) -> None:
        self._submit(lambda core: core.abort(req_id))
        out = self.processor.abort(req_id)
        q = self._streams.get(req_id)
        if q is not None and out is not None:
            q.put_nowait(_snapshot(out, self.cumulative))

    def cancel(self, req_id: str) -> None:
        """Abort a request whose output stream will never be read (its consumer gave up before
        iterating it, so the stream's own cleanup never runs)."""
        self.abort(req_id)
        self._streams.pop(req_id, None)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(core) between two steps (services use it for KV export/import bookkeeping)."""
        if self._dead is not None:  # nothing would ever run it: fail now instead of waiting forever
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        fut = asyncio.get_running_loop().create_future()
        self._submit(fn, fut)
        return await fut

    def _submit(self, fn: Callable, fut: asyncio.Future | None = None) -> None:
        with self._lock:
            self._commands.append((fn, fut))
        self._wake.set()

    def drain_step_times(self) -> list[tuple[float, float | None]]:
        """The steps that ran a forward since the last call: (step seconds, seconds between the previous step's end
        and this step's start, None when the engine idled in between)."""
        out, log_ = [], self._step_log
        while log_:
            out.append(log_.popleft())
        return out

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        clock, last_end = time.perf_counter, None
        try:
            while not self._stop:
                self._apply_commands()
                # idle, unless finished requests are still to be dropped by the runner: one more step
                # hands it their ids, so an idle engine keeps no per-request state (HiSparse pages, rows)
                if not core.has_unfinished() and not core.has_finished_to_drop():
                    self._take_stats()
                    self._wake.clear()
                    with self._lock:
                        idle = not self._commands
                    if idle and not self._stop:
                        self._wake.wait()
                    last_end = None
                    continue
                n, in_flight = core.num_steps, getattr(core, "in_flight", False)
                t0 = clock()
                outputs = core.step()
                t1 = clock()
                if core.num_steps != n:
                    if getattr(core, "last_step_forward", True):  # a step that only drops finished ids: not logged
                        self._step_log.append((t1 - t0, None if last_end is None else t0 - last_end))
                    last_end = t1
                if outputs:
                    done = [o.req_id for o in outputs if o.finish_reason is not None]
                    # a finished request's held KV pages, read now: its export then waits for no later step
                    exports = core.held_exports(done) if done else {}
                    self._post(self._dispatch, outputs, time.monotonic(), exports)
                elif core.num_steps == n and not in_flight:  # nothing could run (blocks a command frees): no spin
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                    last_end = None
                if time.monotonic() - self._stats_at >= STATS_PERIOD_S:
                    self._take_stats()
        except BaseException as e:  # every stream must learn that the engine died
            log.exception("engine loop failed")
            self._post(self._fail, e)

    def _take_stats(self) -> None:
        self.last_stats = self.core.stats()
        self._stats_at = time.monotonic()

    def _post(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the event loop (from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _apply_commands(self) -> None:
        with self._lock:
            cmds, self._commands = self._commands, []
        for fn, fut in cmds:
            try:
                res = fn(self.core)
            except Exception as e:  # noqa: BLE001 - reported to the caller that queued it
                if fut is not None:
                    self._post(_settle, fut, None, e)
                else:
                    log.warning("engine command failed: %r", e)
                continue
            if fut is not None:
                self._post(_settle, fut, res, None)

    # ---- the event loop ------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        self._dead = e
        for q in self._streams.values():
            q.put_nowait(EngineDeadError(f"engine failed: {e!r}"))
        with self._lock:
            cmds, self._commands = self._commands, []
        for _, fut in cmds:
            if fut is not None and not fut.done():
                fut.set_exception(EngineDeadError(f"engine failed: {e!r}"))

    def _dispatch(self, outputs, step_time: float, exports: dict | None = None) -> None:
        updated, to_abort = self.processor.process(outputs)
        for rid in to_abort:  # a stop string: the core stops the request at its next command pass
            self._submit(lambda core, rid=rid: core.abort(rid))
        for out in updated:
            q = self._streams.get(out.req_id)
            if q is not None:
                snap = _snapshot(out, self.cumulative)
                snap.step_time = step_time
                if exports and out.finished:
                    snap.kv_exports = exports.get(out.req_id)
                q.put_nowait(snap)

    def stats(self) -> EngineStats:
        return self.last_stats


def _snapshot(out: RequestOutput, cumulative: bool = True) -> RequestOutput:
    """A copy the processor no longer changes (its lists copied): one per request per step, so the fields are
    copied as they are (a fifth of `dataclasses.replace`'s cost, which re-runs __init__). Not cumulative
    (AsyncEngine(cumulative=False)): the step's tokens' logprobs only, and the token ids only once the request
    has finished, so nothing proportional to the tokens produced so far is copied before that."""
    snap = object.__new__(RequestOutput)
    snap.__dict__.update(out.__dict__)
    snap.delta_token_ids = list(out.delta_token_ids)
    snap.token_ids = list(out.token_ids) if cumulative or out.finished else []
    if out.logprobs is not None:
        n = len(out.delta_token_ids)
        snap.logprobs = list(out.logprobs) if cumulative else out.logprobs[len(out.logprobs) - n:] if n else []
    return snap


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
