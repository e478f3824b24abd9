"""One simulated engine instance: the production Scheduler and KV manager (engine/core/scheduler.py,
engine/kv/manager.py) driven step by step on the virtual clock, with the device work costed instead of run.

A step is what the real engine loop does: `schedule()`, the forward (here: a timer of the profile's cost of
that SchedulerOutput), `update()` with the runner's output. The runner's output is made up where only its
shape matters: every sampling chunk emits its accepted drafts and one token (a fixed id, never EOS: the
replayed requests ignore EOS, as `bench agentx`'s do), drafts are proposed as the real MTP proposer proposes
them (min(max_drafts, k)) and accepted by the production synthetic-acceptance draw. So batching, chunked
prefill, prefix-cache hits and evictions, preemption, KV import admission and MTP's tokens per step are the
real system's; only the time each step takes comes from the profile. With a host KV tier (--kv-offloading-size)
the KV manager is given the production tier's bookkeeping, and each step also pays its block copies. The ranks of
a DP group step together (`LockStep`): each step lasts as long as its slowest rank's, idle ranks run dummy passes.
Engines placed on one device (a prefill and a decode on GPU 0, or both on a CPU's cores) share it
(`SharedDevice`): while both are in a step, each progresses at the slower rate measured by
`pdserve bench calibrate --through-services` with the other engine kept busy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.core import scheduler_stats
from engine.core.request import Request
from engine.core.scheduler import EngineCoreOutput, Scheduler
from engine.core.scheduler_output import RunnerOutput, SampledOutput, SchedulerOutput
from engine.kv.manager import KVCacheManager
from engine.kv.offload import OffloadTier
from engine.runner.speculative import SyntheticAcceptance
from services.engine_host import load_figures

TOKEN = 7  # the id every simulated token carries (not an EOS id of any model here; requests ignore EOS anyway)


class SimEngine:
    def __init__(self, instance_id: str, cfg, num_blocks: int, cost: Callable, loop: asyncio.AbstractEventLoop,
                 seed: int, acceptance_length: float | None = None, offload: OffloadTier | None = None,
                 copy_s: float = 0.0):
        """`offload`: the production bookkeeping of the engine's host KV tier (--kv-offloading-size): evicted
        prefix blocks kept in host memory, loaded back on a later hit; each block copy costs `copy_s`."""
        self.instance_id = instance_id
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, 1, cfg.cache.enable_prefix_caching,
                                 offload=offload)
        self.copy_s = copy_s
        self.pending_copies = 0  # copies queued outside a step (an import's reservation): the next step pays them
        self.k = cfg.num_spec_tokens if cfg.with_mtp else 0
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.k)
        self.cost = cost
        self.loop = loop
        self.synthetic = SyntheticAcceptance(acceptance_length, self.k, seed) if self.k and acceptance_length else None
        self.listeners: dict[str, Callable[[EngineCoreOutput], None]] = {}
        self.busy = False
        self.num_steps = 0
        self.busy_s = 0.0  # virtual seconds spent in steps
        self.step_log: list[tuple[float, float]] = []  # (end, seconds) of each step that ran a forward
        self.tokens = 0  # tokens computed (prompt rows and verified drafts)
        self.offload_copies = 0  # host KV tier block copies run in steps
        self.first_step: dict[str, float] = {}  # request -> when its first chunk's step began (the caller pops it)
        self.group: LockStep | None = None  # the DP group it steps with (LockStep.add)
        self.device: SharedDevice | None = None  # the device it shares with other engines (SharedDevice.add)
        self.role = ""  # its role on a shared device (the slowdown it takes there)
        self.served_extra: Callable[[], float] | None = None  # seconds the services add to each step it computes
        self._step_t0 = 0.0
        self._boundary: list[asyncio.Future] = []  # callers waiting for the step in progress to end

    # ---- requests ------------------------------------------------------------------------------
    def add(self, req: Request, listener: Callable[[EngineCoreOutput], None]) -> None:
        self.scheduler.add_request(req)
        self.listeners[req.req_id] = listener
        self.kick()

    def reserve_import(self, req: Request, num_tokens: int, listener) -> tuple[list[int], int] | None:
        got = self.scheduler.reserve_import(req, num_tokens)
        self.pending_copies += len(self.kv.take_copies())  # the engine runs them before the caller writes
        if got is not None:
            self.listeners[req.req_id] = listener
        return got

    def import_done(self, req_id: str, ok: bool = True, num_tokens: int | None = None) -> None:
        self.scheduler.import_done(req_id, ok, num_tokens)
        self.kick()

    def release_held(self, req_id: str) -> None:
        self.scheduler.release_held(req_id)

    def load(self) -> dict[str, float]:
        return load_figures(scheduler_stats(self.scheduler))

    def has_work(self) -> bool:
        """A step under way or requests waiting or running (a prefill's finished, held requests do not count)."""
        return self.busy or self.scheduler.has_unfinished

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` this instance's pool holds (what the router's KV-event index says)."""
        n = 0
        for h in hashes:
            if self.kv.pool.lookup(h) is None:
                break
            n += 1
        return n

    # ---- steps ---------------------------------------------------------------------------------
    def kick(self) -> None:
        if self.group is not None:  # a rank of a DP group steps with its group
            self.group.kick()
            return
        if self.busy:
            return
        sched = self._plan()
        if sched is None:
            return
        seconds = self._seconds(sched)
        self._begin(sched, seconds)
        if self.device is not None:
            self.device.start(self, seconds, lambda: self._done(sched))
        else:
            self.loop.call_later(seconds, self._done, sched)

    def _done(self, sched: SchedulerOutput) -> None:
        self._finish(sched)
        self.kick()

    def _plan(self) -> SchedulerOutput | None:
        """The scheduler's next step; None when it has nothing to run (its bookkeeping done as the loop does)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.pending_copies += len(sched.kv_copies)  # the runner's next step runs them
            if sched.finished_req_ids or sched.preempted_req_ids:
                self.scheduler.update(sched, RunnerOutput())
            return None
        return sched

    def _seconds(self, sched: SchedulerOutput | None, group_tokens_per_rank: float | None = None) -> float:
        """What the step costs (None: a DP rank's dummy pass), its host KV tier copies included;
        `group_tokens_per_rank`: its DP group's tokens this step over the group's ranks (the work expert
        parallelism spreads over them)."""
        copies = (len(sched.kv_copies) if sched is not None else 0) + self.pending_copies  # before the forward
        self.pending_copies = 0
        self.offload_copies += copies
        chunks = sched.chunks if sched is not None else []
        served = self.served_extra() if self.served_extra is not None and chunks else 0.0
        if group_tokens_per_rank is None:
            return self.cost(chunks) + copies * self.copy_s + served
        return self.cost(chunks, group_tokens_per_rank) + copies * self.copy_s + served

    def _begin(self, sched: SchedulerOutput | None, seconds: float) -> None:
        now = self.loop.time()
        for c in sched.chunks if sched is not None else ():
            self.first_step.setdefault(c.req_id, now)
        self.busy = True
        self._step_t0 = now
        self.num_steps += 1

    async def between_steps(self) -> None:
        """Until the step in progress ends (at once when there is none): where a service's call into its engine
        runs (AsyncEngine.call applies it between two steps), e.g. a decode's reservation of an imported request."""
        if self.busy:
            fut = self.loop.create_future()
            self._boundary.append(fut)
            await fut

    def _finish(self, sched: SchedulerOutput | None) -> None:
        outs = self.scheduler.update(sched, self._result(sched)) if sched is not None else []
        self.busy = False
        waiting, self._boundary = self._boundary, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
        now = self.loop.time()
        self.busy_s += now - self._step_t0  # as long as the step lasted (a shared device stretches it)
        if sched is not None and sched.chunks:  # as the services' step histogram counts them
            self.step_log.append((now, now - self._step_t0))
        for o in outs:
            listener = self.listeners.get(o.req_id)
            if o.finish_reason is not None:
                self.listeners.pop(o.req_id, None)
            if listener is not None:
                listener(o)

    def _result(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        for c in sched.chunks:
            self.tokens += len(c.token_ids)
            if not c.sample:
                continue
            d = c.num_draft_tokens
            acc = self.synthetic.num_accepted(d) if d and self.synthetic is not None else 0
            out.sampled[c.req_id] = SampledOutput(token_ids=[TOKEN] * (acc + 1), num_drafts=d, num_accepted=acc)
            if self.k and c.max_drafts:
                out.drafts[c.req_id] = [TOKEN] * min(c.max_drafts, self.k)
        return out


class LockStep:
    """The ranks of one DP x EP group, stepping together as the real group does (engine/parallel/dp.py: rank 0
    plans every rank's step; every MoE layer all-to-alls between the ranks): a step starts when any rank has work,
    a rank without any runs a dummy pass (its step cost with no rows), and the step lasts as long as its slowest
    rank's; each rank's cost counts the routed experts' share of the group's tokens (its profile entry's
    `group_token_s`), not of its own. Every rank's scheduler, KV manager and requests stay its own."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.members: list[SimEngine] = []
        self.busy = False

    def add(self, engine: SimEngine) -> None:
        self.members.append(engine)
        engine.group = self

    def kick(self) -> None:
        if self.busy:
            return
        plans = [m._plan() for m in self.members]
        if all(p is None for p in plans):
            return
        # the routed experts' work of every rank's rows is spread over the group (expert parallelism)
        spread = sum(len(c.token_ids) for p in plans if p is not None for c in p.chunks) / len(self.members)
        seconds = max(m._seconds(p, spread) for m, p in zip(self.members, plans))
        for m, p in zip(self.members, plans):
            m._begin(p, seconds)
        self.busy = True
        self.loop.call_later(seconds, self._done, plans)

    def _done(self, plans: list[SchedulerOutput | None]) -> None:
        for m, p in zip(self.members, plans):  # every rank's update before any rank plans again
            m._finish(p)
        self.busy = False
        self.kick()


@dataclass
class _SharedStep:
    """A step in flight on a shared device."""
    engine: SimEngine
    left: float  # its work left, in seconds of the engine alone on the device
    on_done: Callable[[], None]
    rate: float = 1.0
    timer: asyncio.TimerHandle | None = None


class SharedDevice:
    """Engines placed on one device (a one-GPU topology's prefill and decode, or engines on one CPU's cores),
    their device work shared as processor sharing: an engine alone in a step runs it at its profile cost; while
    any other engine of the device is in a step too, it progresses at 1 / slowdown[its role] of that rate, the
    slowdown measured with the other engine kept busy (the profile's `shared_device`). Every start and end of a
    step re-times the steps in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop, slowdown: dict[str, float]):
        self.loop = loop
        self.slowdown = slowdown
        self._running: dict[str, _SharedStep] = {}  # by instance id
        self._t = 0.0  # when the work left was last brought up to date

    def add(self, engine: SimEngine, role: str) -> None:
        engine.device, engine.role = self, role

    def start(self, engine: SimEngine, seconds: float, on_done: Callable[[], None]) -> None:
        self._advance()
        self._running[engine.instance_id] = _SharedStep(engine, seconds, on_done)
        self._retime()

    def _advance(self) -> None:
        now = self.loop.time()
        for step in self._running.values():
            step.left = max(step.left - (now - self._t) * step.rate, 0.0)
        self._t = now

    def _retime(self) -> None:
        shared = len(self._running) > 1
        for iid, step in self._running.items():
            step.rate = 1.0 / self.slowdown.get(step.engine.role, 1.0) if shared else 1.0
            if step.timer is not None:
                step.timer.cancel()
            step.timer = self.loop.call_at(self._t + step.left / step.rate, self._end, iid)

    def _end(self, iid: str) -> None:
        self._advance()
        step = self._running.pop(iid)
        self._retime()
        step.on_done()
