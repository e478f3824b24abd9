"""An asyncio-friendly NIXL agent for moving whole KV blocks between processes.

    agent = NixlAgent("decode-0")
    mine = agent.register({"mla": cache.mla, "index": cache.index})      # -> [BlockTensor, ...]
    peer = agent.add_peer(remote_metadata)                               # from a KVHandle / Describe
    local = agent.prep_local(mine)
    remote = agent.prep_remote(peer, remote_tensors)                     # BlockTensors from the wire
    xfer = agent.read(local, [5, 6], remote, [17, 18], notif=pulled_notif(lease_id))
    await agent.wait(xfer, deadline_in(5.0))                             # raises TransferTimeout

Layout: a block-major cache tensor holds block b at bytes [base + b*block_bytes, +block_bytes), so
a transfer is one descriptor per (tensor, block) and NIXL merges adjacent ones. Descriptor lists
over *all* blocks of the registered tensors are prepared once per peer (`prep_*`); a transfer then
names block ids only.

Memory types: NIXL registers and prepares one memory type (DRAM: host memory; VRAM: GPU memory) per
call, so tensors are registered and prepared per type, and a transfer is split into one NIXL
transfer per (local type, remote type) pair (a HiSparse decode cache is a host pool of MLA rows
beside a GPU indexer cache: its pulls land MLA rows in DRAM and indexer rows in VRAM). A split
transfer's notification is sent by `wait` once every part is done.

Threading: a nixl_agent is not thread-safe. A NixlAgent belongs to the thread that built it (its
event loop); every call from another thread raises. Calls are non-blocking C calls, so the event
loop's tasks interleave them safely; only `wait`/`wait_notif` await, polling between sleeps.

Progress: NIXL's own progress thread busy-spins a whole core even when idle (the Python binding
fixes its delay at 0), so by default there is none; instead a task on the owner's event loop polls
NIXL: every `poll_interval_s` (2 ms) while the agent is busy, i.e. within `BUSY_S` of its last transfer,
registration, metadata export (a prefill hands its metadata out with every KV handle, just before a
peer reads), new peer or notification; then the interval doubles up to `idle_poll_interval_s` (20 ms,
PDSERVE_NIXL_IDLE_POLL_S). Polling every 2 ms costs ~5% of a core per agent for nothing while idle;
every 20 ms, about a tenth of that. Both sides of a transfer need progress: the initiator's `wait` polls
its transfer, and the passive side's task completes peers' READs and WRITEs and collects notifications.
On one host a READ of registered host memory is one-sided once connected; a new peer's connection
wire-up needs the passive side's progress, so an idle passive agent delays a new peer's first transfer
by a few idle intervals. `progress_thread=True` (or PDSERVE_NIXL_PROGRESS_THREAD=1)
restores NIXL's thread where a spare core is cheaper than the polling latency. A process whose main
thread has no event loop (a worker rank, blocked in the engine's collectives between steps) keeps its
agent on an `AgentThread`: a thread with an event loop of its own, whose task polls the agent the same way.

Deadlines: NIXL reports a dead peer (nixlRemoteDisconnectError within milliseconds) but never a hung
one (a stopped or wedged peer leaves a transfer in progress forever), so every wait takes an
explicit deadline, after which the transfer is cancelled (released) and TransferTimeout raised.
Bytes of a cancelled transfer may still land: do not reuse its target blocks before the peer's
lease/reservation has expired too. After PeerDisconnected, `remove_peer(name)` the dead peer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from engine import settings
from services.transfer.nixl_descs import (
    BlockDescList,
    BlockTensor,
    DescGroup,
    NixlStats,
    PeerDisconnected,
    Transfer,
    TransferError,
    TransferTimeout,
    by_mem_type,
    deadline_in,
    parse_pulled,
    pulled_notif,
    region_descs,
    transfer_parts,
)

__all__ = ["NixlAgent", "BlockTensor", "BlockDescList", "Transfer", "NixlStats", "TransferError",
           "PeerDisconnected", "TransferTimeout", "deadline_in", "pulled_notif", "parse_pulled"]

log = logging.getLogger(__name__)
_SETTLE_ROUNDS = 20
BUSY_S = 2.0  # an agent polls at its busy interval for this long after its last activity


class NixlAgent:
    """Owns one nixl_agent; see the module docstring for the rules."""

    def __init__(self, name: str, backends: Iterable[str] | None = None, *, num_threads: int = 0,
                 progress_thread: bool | None = None, poll_interval_s: float = 0.002,
                 idle_poll_interval_s: float | None = None, metrics: Any = None):
        # here, not at the top: nixl loads UCX and CUDA libraries, which a process that only describes
        # transfers (the router's conversions, the tests' fakes) must not pay for
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.backends = tuple(backends or settings.nixl_backends())
        self.progress_thread = settings.nixl_progress_thread() if progress_thread is None else progress_thread
        self.poll_interval_s = poll_interval_s
        self.idle_poll_interval_s = max(poll_interval_s, settings.nixl_idle_poll_s() if idle_poll_interval_s is None
                                        else idle_poll_interval_s)
        self._busy_until = time.monotonic() + BUSY_S
        self._wake: asyncio.Event | None = None  # set by busy() to end an idle poll's sleep early
        self.polls = 0  # progress-loop rounds so far (how often this agent woke up to poll NIXL)
        conf = nixl_agent_config(enable_prog_thread=self.progress_thread, backends=list(self.backends),
                                 num_threads=num_threads)
        self._agent = nixl_agent(name, conf)
        missing = [b for b in self.backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backend(s) {missing} did not start; available plugins: "
                               f"{self._agent.get_plugin_list()} (only UCX and POSIX start without a GPU)")
        self._owner = threading.get_ident()
        self._registered: list[tuple[Any, dict[str, torch.Tensor]]] = []
        self._prepped: list[BlockDescList] = []
        self._peers: dict[str, bytes] = {}
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._stuck: list[Any] = []  # handles NIXL refused to cancel; retried on close()
        self._progress_task: asyncio.Task | None = None
        self.stats = NixlStats()
        self._metrics = metrics
        self.start()

    def start(self) -> None:
        """Drive NIXL progress from the running event loop (no-op without one, or with a progress
        thread). Without progress a passive agent -- one whose memory peers READ or WRITE -- never
        completes their transfers; the constructor calls this, call it again once a loop runs."""
        if self.progress_thread or self._progress_task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._progress_task = loop.create_task(self._progress_loop(), name=f"nixl-progress-{self.name}")

    def progress(self) -> None:
        """One progress step for callers without an event loop (also collects notifications)."""
        self._drain()

    def busy(self) -> None:
        """Poll at the busy interval for the next BUSY_S (the agent's own calls do this; a service calls it
        when it expects a peer's transfer that this agent will not see coming)."""
        self._busy_until = time.monotonic() + BUSY_S
        if self._wake is not None:
            self._wake.set()

    async def _progress_loop(self) -> None:
        self._wake = asyncio.Event()
        delay = self.poll_interval_s
        while True:
            self._drain()  # get_new_notifs progresses the UCX worker
            self.polls += 1
            if time.monotonic() < self._busy_until:
                delay = self.poll_interval_s
                await asyncio.sleep(delay)
                continue
            delay = min(2 * delay, self.idle_poll_interval_s)
            self._wake.clear()
            try:  # asyncio.timeout, not wait_for, which can swallow close()'s cancellation (Python 3.11)
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # ---- memory and peers ----------------------------------------------------------------------
    def register(self, tensors: dict[str, torch.Tensor]) -> list[BlockTensor]:
        """Register block-major tensors (CPU -> DRAM, CUDA -> VRAM; one registration per memory type);
        returns their descriptions."""
        self._check_owner()
        self.busy()
        described = [BlockTensor.of(name, t) for name, t in tensors.items()]
        for mem_type, group in by_mem_type(described):
            reg = self._agent.register_memory(region_descs(group), mem_type)
            # Keep the tensors alive as long as NIXL may touch their memory (a freed registered tensor
            # would be a use-after-free by a peer's one-sided READ/WRITE).
            self._registered.append((reg, {t.name: tensors[t.name] for t in group}))
        return described

    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory), for peers' add_peer()."""
        self._check_owner()
        self.busy()  # handed to a peer that is about to connect and transfer
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name. Loading the same metadata twice is a no-op."""
        self._check_owner()
        self.busy()
        for name, md in self._peers.items():
            if md == metadata:
                return name
        try:
            name = _as_str(self._agent.add_remote_agent(metadata))
        except Exception as exc:  # NIXL's own error types: corrupt or foreign metadata is a bad argument
            raise ValueError(f"NIXL rejected the peer's agent metadata ({len(metadata)} bytes): "
                             f"{type(exc).__name__}: {exc}") from exc
        if name in self._peers:  # the same name with new metadata: NIXL replaced it; our dlists are stale
            for dl in [d for d in self._prepped if d.peer == name]:
                self._release_dlist(dl)
        self._peers[name] = metadata
        return name

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def remove_peer(self, name: str) -> None:
        self._check_owner()
        if self._peers.pop(name, None) is not None:
            for dl in [d for d in self._prepped if d.peer == name]:
                self._release_dlist(dl)
            self._agent.remove_remote_agent(name)
            self._settle()

    def connect(self, peer: str) -> None:
        """Optional: set up the connection now so the first transfer does not pay for it."""
        self._check_owner()
        self.busy()
        self._agent.make_connection(peer)

    def prep_local(self, tensors: Sequence[BlockTensor]) -> BlockDescList:
        return self._prep("", tensors)

    def prep_remote(self, peer: str, tensors: Sequence[BlockTensor]) -> BlockDescList:
        if peer not in self._peers:
            raise ValueError(f"unknown NIXL peer {peer!r}: add_peer(its metadata) first")
        return self._prep(peer, tensors)

    def _prep(self, peer: str, tensors: Sequence[BlockTensor]) -> BlockDescList:
        self._check_owner()
        if not tensors:
            raise ValueError("prep needs >= 1 tensor")
        groups = []
        for mem_type, group in by_mem_type(tensors):
            descs = np.concatenate([t.descs() for t in group])
            groups.append(DescGroup(mem_type, group, self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", descs,
                                                                                 mem_type)))
        dl = BlockDescList(peer=peer, tensors=tuple(tensors), groups=tuple(groups))
        self._prepped.append(dl)
        return dl

    def release_descs(self, dl: BlockDescList) -> None:
        self._check_owner()
        self._release_dlist(dl)

    def _release_dlist(self, dl: BlockDescList) -> None:
        if any(d is dl for d in self._prepped):
            self._prepped = [d for d in self._prepped if d is not dl]
            for g in dl.groups:
                g.handle.release()
                g.handle = None

    # ---- transfers -----------------------------------------------------------------------------
    def read(self, local: BlockDescList, local_block_ids: Sequence[int], remote: BlockDescList,
             remote_block_ids: Sequence[int], notif: bytes = b"") -> Transfer:
        """Post a READ of remote blocks into local blocks (the remote gets `notif` when done)."""
        return self._post("READ", local, local_block_ids, remote, remote_block_ids, notif)

    def write(self, local: BlockDescList, local_block_ids: Sequence[int], remote: BlockDescList,
              remote_block_ids: Sequence[int], notif: bytes = b"") -> Transfer:
        """Post a WRITE of local blocks into remote blocks (the remote gets `notif` when done)."""
        return self._post("WRITE", local, local_block_ids, remote, remote_block_ids, notif)

    def _post(self, op: str, local: BlockDescList, local_ids: Sequence[int], remote: BlockDescList,
              remote_ids: Sequence[int], notif: bytes) -> Transfer:
        self._check_owner()
        self.busy()
        if local.released or remote.released:
            raise ValueError(f"descriptor list released (peer {remote.peer or 'local'} removed?): prep it again")
        _check_pairing(local, local_ids, remote, remote_ids)
        now = time.monotonic()
        if len(local_ids) == 0:  # nothing to move; still deliver the notification
            if notif:
                self.send_notif(remote.peer, notif)
            return Transfer([], op, remote.peer, 0, now)
        parts = transfer_parts(local, local_ids, remote, remote_ids)
        split = len(parts) > 1
        xfer = Transfer([], op, remote.peer, local.num_bytes(len(local_ids)), now, notif if split else b"")
        for part in parts:
            try:
                handle = self._agent.make_prepped_xfer(op, part.local.handle, part.local_idx, part.remote.handle,
                                                       part.remote_idx, b"" if split else notif)
                xfer.handles.append(handle)
                state = self._agent.transfer(handle)
            except Exception as exc:
                self._finish_failed(xfer)
                raise _wrap(exc, f"{op} to {remote.peer}") from exc
            if state == "ERR":
                self._finish_failed(xfer)
                raise TransferError(f"NIXL {op} to {remote.peer} failed when posted")
        return xfer

    async def wait(self, xfer: Transfer, deadline: float) -> None:
        """Poll until `xfer` is done; release its handle. Raises TransferTimeout after `deadline`
        (monotonic clock; the transfer is cancelled), TransferError/PeerDisconnected on failure."""
        self.start()
        if not xfer.handles:
            return
        delay = 0.0
        while True:
            self._check_owner()
            try:
                states = [self._agent.check_xfer_state(h) for h in xfer.handles]
            except Exception as exc:
                self._finish_failed(xfer)
                raise _wrap(exc, f"{xfer.op} to {xfer.peer}") from exc
            if all(s == "DONE" for s in states):
                for h in xfer.handles:
                    h.release()
                xfer.handles = []
                self._count(xfer.num_bytes)
                if xfer.notif_after:
                    self.send_notif(xfer.peer, xfer.notif_after)
                return
            if "ERR" in states:
                self._finish_failed(xfer)
                raise TransferError(f"NIXL {xfer.op} to {xfer.peer} failed ({xfer.num_bytes} bytes)")
            if time.monotonic() >= deadline:
                self.stats.num_timeouts += 1
                self._finish_failed(xfer)
                raise TransferTimeout(f"NIXL {xfer.op} to {xfer.peer} ({xfer.num_bytes} bytes) still running "
                                      f"after {time.monotonic() - xfer.started:.3f}s: peer hung? cancelled")
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, 1e-4), 2e-3)  # 0.1 ms .. 2 ms: a 64 MiB block set takes >= 15 ms

    def _count(self, num_bytes: int) -> None:
        self.stats.bytes_transferred += num_bytes
        self.stats.num_transfers += 1
        if self._metrics is not None and hasattr(self._metrics, "nixl_bytes_transferred"):
            self._metrics.nixl_bytes_transferred.inc(num_bytes)

    def _failed(self, n: int) -> None:
        self.stats.num_failed_transfers += n
        if self._metrics is not None and hasattr(self._metrics, "nixl_num_failed_transfers"):
            self._metrics.nixl_num_failed_transfers.inc(n)

    def _finish_failed(self, xfer: Transfer) -> None:
        self._failed(1)
        for handle in xfer.handles:
            try:
                handle.release()  # cancels an active transfer when the backend can
            except Exception:  # noqa: BLE001 - whatever NIXL raises, the handle is kept and released at close
                log.warning("NIXL could not cancel %s to %s; keeping its handle", xfer.op, xfer.peer)
                self._stuck.append(handle)
        xfer.handles = []

    # ---- notifications -------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        """A standalone notification (no transfer). Raises PeerDisconnected for a dead peer."""
        self._check_owner()
        self.busy()
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:
            raise _wrap(exc, f"notification to {peer}") from exc

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, as (sender agent name, message)."""
        self._drain()
        out = list(self._notifs)
        self._notifs.clear()
        return out

    async def wait_notif(self, deadline: float, peer: str | None = None, prefix: bytes = b"") -> tuple[str, bytes]:
        """The first notification (from `peer`, starting with `prefix`); other ones stay queued."""
        self.start()
        delay = 0.0
        while True:
            self._drain()
            for item in self._notifs:
                if (peer is None or item[0] == peer) and item[1].startswith(prefix):
                    self._notifs.remove(item)
                    return item
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no NIXL notification {prefix!r} from {peer or 'any peer'} before the deadline")
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, 1e-4), 5e-3)

    def _drain(self) -> None:
        self._check_owner()
        for sender, msgs in self._agent.get_new_notifs().items():
            if msgs:
                self._busy_until = time.monotonic() + BUSY_S
            self._notifs.extend((_as_str(sender), bytes(m)) for m in msgs)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        self._check_owner()
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        for dl in list(self._prepped):
            self._release_dlist(dl)
        for h in self._stuck:
            try:
                h.release()
            except Exception:  # noqa: BLE001 - closing: a stuck handle must not stop the rest of the clean-up
                pass
        for reg, _ in self._registered:
            self._agent.deregister_memory(reg)
        self._registered.clear()
        for name in list(self._peers):
            self._agent.remove_remote_agent(name)
        self._peers.clear()
        self._settle()

    def _settle(self) -> None:
        # UCX aborts the process (assertion in its endpoint cleanup) when a worker is destroyed while
        # an endpoint to a dead peer still queues failed operations; a few progress calls purge them.
        for _ in range(_SETTLE_ROUNDS):
            self._agent.get_new_notifs()

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(f"NixlAgent {self.name!r} used from another thread: NIXL agents are not "
                               "thread-safe; call it from the event loop thread that created it")


class AgentThread:
    """A NixlAgent for a process whose main thread has no event loop. A daemon thread runs an event loop of
    its own and builds the agent there, so that loop's task drives its progress (no spinning progress
    thread: an idle worker rank costs ~5% of a core, not a whole one); `call` and `submit` run work on it.

        worker = AgentThread("prefill-0.r1.…", device=cache.index.device)
        tensors = worker.call(lambda: worker.agent.register(regions))
    """

    def __init__(self, name: str, *, thread_name: str = "nixl", device: torch.device | None = None,
                 start_timeout_s: float = 120.0, **agent_kwargs: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=thread_name, daemon=True)
        self.thread.start()

        def build() -> NixlAgent:
            if device is not None and device.type == "cuda":  # a new thread starts on GPU 0
                torch.cuda.set_device(device)
            return NixlAgent(name, **agent_kwargs)  # on the running loop: its progress task starts there
        self.agent: NixlAgent = self.call(build, timeout_s=start_timeout_s)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, fn: Callable[[], Any], timeout_s: float = 120.0) -> Any:
        """fn() on the agent's thread: its result, or its exception raised here."""
        async def run():
            return fn()
        return self.submit(run()).result(timeout_s)

    def submit(self, coro) -> Any:
        """Schedule a coroutine on the agent's loop; returns its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


def _check_pairing(local: BlockDescList, local_ids: Sequence[int], remote: BlockDescList,
                   remote_ids: Sequence[int]) -> None:
    if local.peer:
        raise ValueError("the first descriptor list must be a local one (prep_local)")
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks vs {len(remote_ids)} remote blocks: pair them 1:1")
    mine = [(t.name, t.block_bytes) for t in local.tensors]
    theirs = [(t.name, t.block_bytes) for t in remote.tensors]
    if mine != theirs:
        raise ValueError(f"block layouts differ (local {mine} vs {remote.peer} {theirs}): both sides need "
                         "the same KVCacheSpec (model, kv_cache_dtype, block size)")


def _wrap(exc: Exception, what: str) -> TransferError:
    text = f"{type(exc).__name__}: {exc}"
    if "DISCONNECT" in text.upper():
        return PeerDisconnected(f"{what}: remote agent disconnected ({text})")
    return TransferError(f"{what}: {text}")


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
