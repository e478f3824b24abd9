"""Process groups of a multi-rank engine and the collectives it uses, with byte counters.

One process per rank (torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Three groups over the same ranks:

    data      NCCL on CUDA, gloo on CPU: per-layer all-gathers, all-to-alls, the DCP merges
    prefetch  same backend, its own communicator: the asynchronous DCP context gathers of the next
              layer, so they run beside (not queued behind) the data group's collectives
    control   gloo, CPU objects: the per-step SchedulerOutput broadcast and RPCs; no timeout, since
              workers wait in it while the engine is idle

Every collective is called by all ranks in the same order with the same shapes; the callers compute
shapes from the step plan, which every rank knows in full.
"""

from __future__ import annotations

import itertools
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import settings

_STARTUP_TIMEOUT = timedelta(minutes=5)
_DATA_TIMEOUT = timedelta(minutes=30)
_CONTROL_TIMEOUT = timedelta(days=365)
# torch 2.13 names the single-tensor collectives *_single; torch 2.11 (GPU images) only *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        rank, world, port = settings.dist_rank(), settings.dist_world_size(), settings.dist_master_port()
        if rank is None or world is None or port is None:
            raise ValueError("RANK, WORLD_SIZE and MASTER_PORT must be set (launch with torchrun or "
                             "engine.parallel.spawn)")
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}")
        return cls(rank, world, settings.dist_local_rank(), settings.dist_master_addr(), port)

    @classmethod
    def for_rank(cls, rank: int, world_size: int, master_addr: str, master_port: int, cuda: bool,
                 local_rank: int | None = None) -> DistEnv:
        """Rank `rank` of a group; on CUDA it drives GPU `local_rank` (default: GPU r on one host), on CPU 0."""
        local = (rank if local_rank is None else local_rank) if cuda else 0
        return cls(rank, world_size, local, master_addr, master_port)

    def to_environ(self) -> dict[str, str]:
        """torchrun's variable names, for a process we start ourselves."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


_PORTS = random.SystemRandom()  # not the global generator: processes that seed it alike would pick alike


def _ephemeral_low() -> int:
    """The lowest port the OS hands out on its own (connections' local ports, bind to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def default_port_range() -> tuple[int, int]:
    """(lo, hi) inclusive: the 12,000 ports just below the OS's ephemeral range, where free_port draws unless
    PDSERVE_PORT_RANGE says otherwise."""
    low = min(_ephemeral_low(), 65536)
    return max(1024, low - 12000), low - 1


_HANDED_OUT: dict[int, float] = {}  # port -> when this process handed it out (time.monotonic())
_HANDED_OUT_LOCK = threading.Lock()
_PROMISE_S = 600.0  # a port handed out is not handed out again for this long: its process may not have bound it yet


def _shuffled(lo: int, hi: int) -> Iterator[int]:
    """Every port of [lo, hi) once, in random order: after 64 random draws missed (a crowded or small range)."""
    every = list(range(lo, hi))
    _PORTS.shuffle(every)
    yield from every


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, to be bound soon by another process. The one definition: the ranks'
    rendezvous, the services, the launcher and the tests all take their free ports here.

    It is drawn at random below the OS's ephemeral range (or in PDSERVE_PORT_RANGE), where the OS gives no
    port to anyone on its own: a port the OS picked (bind to 0) could meanwhile become some client socket's
    local port, and the process meant to listen there would fail with "address already in use". A port
    handed out by this process is not drawn again for ten minutes: a launcher picks all of a deployment's ports
    before any of its processes binds one, so a free-looking port may already be promised."""
    with _HANDED_OUT_LOCK:
        return _free_port(host)


def _free_port(host: str) -> int:
    now = time.monotonic()
    for port in [p for p, t in _HANDED_OUT.items() if now - t > _PROMISE_S]:
        del _HANDED_OUT[port]
    lo, hi = settings.port_range() or default_port_range()
    hi += 1
    for port in itertools.chain((_PORTS.randrange(lo, hi) for _ in range(64)), _shuffled(lo, hi)):
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT[port] = now
        return port
    while True:  # that range is crowded: let the OS choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT[port] = now
            return port


class CommCounters:
    """What a rank's collectives moved: `bytes[tag]` and `calls[tag]` (RankComm, and the one-GPU emulation's
    loopback transport)."""

    def _init_counters(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _count(self, tag: str, t: torch.Tensor) -> None:
        self.bytes[tag] += t.numel() * t.element_size()
        self.calls[tag] += 1

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class RankComm(CommCounters):
    """The collectives of one rank. `bytes[tag]` counts what this rank received (all-gather outputs,
    all-to-all receive buffers) or sent (reduce-scatter inputs), for the communication-volume report."""

    def __init__(self, env: DistEnv, device: torch.device):
        self.rank = env.rank
        self.world_size = env.world_size
        self.device = device
        self._init_counters()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one multi-rank engine "
                               "per process (shut the other down first: core.shutdown())")
        # the store's timeout bounds the start-up rendezvous (a worker that died importing is not waited
        # for 30 minutes); the groups' timeouts bound each collective. Under torchrun its agent hosts
        # the store and every rank is a client.
        host_store = env.rank == 0 and not settings.torchelastic_agent_store()
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, host_store,
                              timeout=_STARTUP_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=_DATA_TIMEOUT)
        self.data = dist.group.WORLD
        self.prefetch = dist.new_group(backend=backend, timeout=_DATA_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)

    # ---- tensors -------------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, tag: str, *, prefetch: bool = False, async_op: bool = False):
        """x [n, ...] on every rank -> [world * n, ...] in rank order (or (out, work) when async)."""
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._count(tag, out)
        work = _all_gather_single(out, x, group=self.prefetch if prefetch else self.data, async_op=async_op)
        return (out, work) if async_op else out

    def all_gather_padded(self, x: torch.Tensor, max_rows: int, tag: str) -> torch.Tensor:
        """Rows x [n <= max_rows, ...] of every rank -> [world, max_rows, ...] (padding rows are zero)."""
        pad = x.new_zeros((max_rows, *x.shape[1:]))
        pad[: x.shape[0]] = x
        return self.all_gather(pad, tag).view(self.world_size, max_rows, *x.shape[1:])

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int], tag: str) -> torch.Tensor:
        """Rows of x grouped by destination rank (send_counts) -> rows from every rank (recv_counts)."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self._count(tag, out)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.data)
        return out

    def exchange_counts(self, send_counts: list[int], tag: str) -> list[int]:
        """How many rows every rank will send to this one, given how many this one sends to each."""
        send = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        recv = torch.empty_like(send)
        self._count(tag, recv)
        dist.all_to_all_single(recv, send, group=self.data)
        return recv.tolist()

    def reduce_scatter(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """x [world * n, ...] summed over ranks -> this rank's block [n, ...]."""
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        self._count(tag, x)
        _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=self.data)
        return out

    def broadcast(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Rank 0's x into x on every rank (same shape and dtype everywhere), in place."""
        self._count(tag, x)
        dist.broadcast(x, src=0, group=self.data)
        return x

    def all_reduce_max(self, value: int, tag: str) -> int:
        """Max of one int over the ranks, on the data group (CPU/gloo callers only: it syncs)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._count(tag, t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.data)
        return int(t.item())

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def control_max(self, values: list[int], tag: str) -> list[int]:
        """Element-wise max of a few ints over the ranks, on the control group (a host round trip)."""
        t = torch.tensor(values, dtype=torch.int64)
        self._count(tag, t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return t.tolist()

    # ---- objects (control group) ---------------------------------------------------------------
    def broadcast_object(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def scatter_objects(self, objs: list | None = None):
        """Rank 0's objs[r] -> rank r (the others pass nothing)."""
        box = [None]
        dist.scatter_object_list(box, objs if self.rank == 0 else None, src=0, group=self.control)
        return box[0]

    def all_gather_objects(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
