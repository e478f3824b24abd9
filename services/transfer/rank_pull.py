"""Pull on the worker ranks of a decode DP group: a request admitted on DP rank r has its prompt KV READ into
rank r's own pages by rank r's own NIXL agent, commanded by the driver (rank 0, the service process).

    driver (rank 0, event loop)                       worker rank r (blocked in the engine's collectives)
    RankPuller(r).pull(kv, block_ids, n_cached)
      engine.call(collective_rpc(start, r, ...))  ─▶  start(): hands the pull to rank r's pull thread
      agent.wait_notif("dppull:<token>:")             pull thread: KVPuller.pull into its own cache
                                                ◀──   NIXL notification "dppull:<token>:<outcome>:<detail>"
      -> bytes moved, or rank r's TransferTimeout / TransferError / ValueError raised again here

A worker's main thread runs the model between collectives and has no event loop, and a NIXL agent belongs
to the thread that built it (services/transfer/nixl_agent.py), so each worker rank runs one pull thread
with its own event loop (`AgentThread`), which builds the agent (polled by that loop: no busy progress
thread) and a `KVPuller` over the rank's cache (services/transfer/pull.py: the same plans, staging, memory types and
deadlines as rank 0's; with HiSparse the MLA rows land in the rank's host pool). Rank 0's own requests
are pulled by the service's KVPuller on the service's event loop.

Nothing waits forever: the worker's puller has its deadline; the driver waits a little longer for the
report, and gives up at once when the engine stops (a dead or hung rank: services/rank_watch.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import time

from proto.pdserve.v1 import prefill_pb2
from services.transfer.nixl_agent import AgentThread, NixlAgent, TransferError, TransferTimeout
from services.transfer.pull import KVPuller

log = logging.getLogger(__name__)

_PREFIX = b"dppull:"
_REPORT_GRACE_S = 5.0  # the driver's wait beyond the worker's own pull deadline
_POLL_S = 0.5  # how often the driver's wait checks that the engine still runs
_MAX_DETAIL = 512  # characters of an error carried in the notification


# ---- worker side (through collective_rpc; rank 0 answers None / False) ------------------------------------

class _PullThread:
    """This rank's NIXL agent on a thread with its own event loop (`AgentThread`) and a KVPuller over this
    rank's cache, built and run on that thread."""

    def __init__(self, runner, instance_id: str, driver_metadata: bytes, staging_blocks: int, timeout_s: float):
        self.runner = runner
        self.name = f"{instance_id}.dp{runner.comm.rank}.{os.getpid()}.{secrets.token_hex(3)}"
        # (a tensor's device names the rank's GPU, cfg.device may not: the staged re-layout runs there)
        self.worker = AgentThread(self.name, thread_name="kv-pull", device=runner.kv_cache.index.device)
        self.agent = self.worker.agent
        self.puller, self.driver = self.worker.call(lambda: (
            KVPuller(self.agent, runner.kv_cache, runner.spec, staging_blocks=staging_blocks, timeout_s=timeout_s),
            self.agent.add_peer(driver_metadata)))

    def submit(self, token: str, kv_bytes: bytes, block_ids: list[int], num_cached: int) -> None:
        self.worker.submit(self._pull(token, kv_bytes, block_ids, num_cached))

    async def _pull(self, token: str, kv_bytes: bytes, block_ids: list[int], num_cached: int) -> None:
        try:
            kv = prefill_pb2.KVHandle.FromString(kv_bytes)
            outcome = f"ok:{await self.puller.pull(kv, block_ids, num_cached)}"
        except TransferTimeout as exc:
            outcome = f"timeout:{exc}"
        except TransferError as exc:
            outcome = f"error:{exc}"
        except ValueError as exc:
            outcome = f"invalid:{exc}"
        except Exception as exc:  # any failure is the pull's outcome, reported to the driver (logged here)
            log.exception("KV pull %s failed", token)
            outcome = f"error:{type(exc).__name__}: {exc}"
        try:
            self.agent.send_notif(self.driver, _PREFIX + f"{token}:{outcome[:_MAX_DETAIL]}".encode())
        except TransferError as exc:  # the driver is gone: its engine is dead, nobody waits for this
            log.warning("could not report KV pull %s to the driver: %s", token, exc)


_THREAD: _PullThread | None = None


def setup(runner, instance_id: str, driver_metadata: bytes, staging_blocks: int, timeout_s: float) -> str | None:
    """On every rank: a worker starts its pull thread (once) and answers its agent's name; rank 0 None."""
    global _THREAD
    if runner.comm.rank == 0:
        return None
    if _THREAD is None:
        _THREAD = _PullThread(runner, instance_id, driver_metadata, staging_blocks, timeout_s)
    elif _THREAD.runner is not runner:  # its puller writes the first engine's cache: never another's
        raise RuntimeError("this worker rank already pulls KV for another engine: one decode group per process")
    return _THREAD.name


def start(runner, rank: int, token: str, kv_bytes: bytes, block_ids: list[int], num_cached: int) -> bool:
    """On every rank: rank `rank` starts a pull into its blocks `block_ids` (returns at once; the outcome
    arrives at the driver as a notification); the others do nothing."""
    if runner.comm.rank != rank:
        return False
    if _THREAD is None:
        raise RuntimeError("rank_pull.setup was not run on this rank")
    _THREAD.submit(token, kv_bytes, block_ids, num_cached)
    return True


# ---- driver side ------------------------------------------------------------------------------------------

class RankPuller:
    """KVPuller's interface (`spec`, `pull`) for worker rank `rank` of the engine's DP group."""

    def __init__(self, engine, rank: int, agent: NixlAgent, peer: str, spec, timeout_s: float):
        self.engine, self.rank, self.agent, self.peer, self.spec = engine, rank, agent, peer, spec
        self.timeout_s = timeout_s

    async def pull(self, kv, local_blocks: list[int], num_cached: int) -> int:
        """READ the handle's blocks into rank `rank`'s `local_blocks`; returns the bytes moved."""
        token = secrets.token_hex(8)
        args = (self.rank, token, kv.SerializeToString(), list(local_blocks), num_cached)
        await self.engine.call(lambda core: core.collective_rpc(start, *args))
        return self._outcome(await self._report(token))

    async def _report(self, token: str) -> str:
        prefix = _PREFIX + f"{token}:".encode()
        deadline = time.monotonic() + self.timeout_s + _REPORT_GRACE_S
        while True:
            try:
                _, msg = await self.agent.wait_notif(min(deadline, time.monotonic() + _POLL_S), self.peer, prefix)
                return msg[len(prefix):].decode(errors="replace")
            except TimeoutError:
                if not self.engine.is_running:
                    raise TransferError(f"the engine stopped while DP rank {self.rank} pulled KV") from None
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"DP rank {self.rank} did not report its KV pull within "
                                          f"{self.timeout_s + _REPORT_GRACE_S:.0f} s") from None

    def _outcome(self, report: str) -> int:
        kind, _, detail = report.partition(":")
        if kind == "ok":
            return int(detail)
        raise {"timeout": TransferTimeout, "invalid": ValueError}.get(kind, TransferError)(
            f"DP rank {self.rank}: {detail}")


def rank_pullers(engine, agent: NixlAgent, instance_id: str, *, staging_blocks: int,
                 timeout_s: float) -> list[RankPuller]:
    """Start every worker rank's pull thread; the pullers of ranks 1..D-1 (rank 0 uses its own KVPuller).
    Call before `engine.start()`: until then the core is the caller's to use directly."""
    names = engine.core.collective_rpc(setup, instance_id, agent.metadata(), staging_blocks,
                                       timeout_s)
    spec = engine.core.runner.spec
    return [RankPuller(engine, r, agent, names[r], spec, timeout_s) for r in range(1, len(names))]
