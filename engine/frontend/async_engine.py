"""AsyncEngine: the EngineCore driven from asyncio, with one stream of outputs per request.

The core is only ever touched by the engine loop task: steps run in a worker thread (so the event loop
keeps serving), and requests, aborts and service calls queued from other tasks are applied between
two steps. Nothing else synchronises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.config.arg_utils import EngineArgs
from engine.config.engine import EngineConfig
from engine.core.core import EngineStats, make_engine_core
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.outputs import RequestOutput
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every open stream gets this error."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | EngineArgs, core: Any = None, tokenizer: Tokenizer | None = None):
        self.config = config.create_engine_config() if isinstance(config, EngineArgs) else config
        self.core = core if core is not None else make_engine_core(self.config)
        if tokenizer is None:
            try:
                tokenizer = Tokenizer(self.config.model_path)
            except FileNotFoundError:
                tokenizer = None
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self._streams: dict[str, asyncio.Queue] = {}
        self._commands: list[tuple[Callable, asyncio.Future | None]] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self.last_stats: EngineStats = self.core.stats()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the loop's own failure was already reported to every stream
                pass
            self._task = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._dead is None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    **request_kwargs) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError on bad input), queue for the loop, return the output stream."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        req = Request(req_id=req_id or f"req-{next(self._ids)}", prompt_token_ids=list(prompt_token_ids),
                      sampling_params=params, **request_kwargs)
        self.core.validate(req)
        if req.req_id in self._streams:
            raise ValueError(f"request id {req.req_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.req_id] = queue
        self.processor.add(req)
        self._submit(lambda core: core.add_request(req))
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
            q.put_nowait(_snapshot(out))

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
        self._commands.append((fn, fut))
        self._wake.set()

    # ---- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_commands()
                # idle, unless finished requests are still to be dropped by the runner: one more step
                # hands it their ids, so an idle engine keeps no per-request state (HiSparse pages, rows)
                if not self.core.has_unfinished() and not self.core.has_finished_to_drop():
                    self.last_stats = self.core.stats()
                    self._wake.clear()
                    if not self._commands:
                        await self._wake.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.core.step)
                self._dispatch(outputs)
                self.last_stats = self.core.stats()
                await asyncio.sleep(0)  # let streams and new requests in between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # every stream must learn that the engine died
            log.exception("engine loop failed")
            self._dead = e
            for q in self._streams.values():
                q.put_nowait(EngineDeadError(f"engine failed: {e!r}"))
            for _, fut in self._commands:
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(f"engine failed: {e!r}"))

    def _apply_commands(self) -> None:
        cmds, self._commands = self._commands, []
        for fn, fut in cmds:
            try:
                res = fn(self.core)
            except Exception as e:  # noqa: BLE001 - reported to the caller that queued it
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                else:
                    log.warning("engine command failed: %r", e)
                continue
            if fut is not None and not fut.done():
                fut.set_result(res)

    def _dispatch(self, outputs) -> None:
        updated, to_abort = self.processor.process(outputs)
        for rid in to_abort:
            self.core.abort(rid)
        for out in updated:
            q = self._streams.get(out.req_id)
            if q is not None:
                q.put_nowait(_snapshot(out))

    def stats(self) -> EngineStats:
        return self.last_stats


def _snapshot(out: RequestOutput) -> RequestOutput:
    return dataclasses.replace(out, token_ids=list(out.token_ids), delta_token_ids=list(out.delta_token_ids),
                               logprobs=list(out.logprobs) if out.logprobs is not None else None)
