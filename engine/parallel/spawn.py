"""Starting the ranks of a multi-rank engine.

Spawned mode (the default, used by `LLM(..., prefill_context_parallel_size=N)` and the services): the
caller's process is rank 0 — it drives the scheduler — and ranks 1..N-1 are started here as
`python -m engine.parallel.worker` with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus PDSERVE_DIST_DEVICE and PDSERVE_PARENT_PID.

torchrun mode: `torchrun --nproc-per-node N my_driver.py`, where my_driver.py calls
`run_rank(main)`: rank 0 runs `main` (which builds the engine; it finds RANK/WORLD_SIZE set and spawns
nothing), every other rank serves as a worker.

Service mode (a multi-rank prefill service, one process per rank with its own log): the launcher or
`services.launch.ranks` starts every rank with `--rank/--world-size/--master-addr/--master-port`, which
`services.rpc.service_args.set_rank_environ` turns into the same torchrun environment (`DistEnv`); rank 0
serves, the others run `engine.parallel.worker` as in the two modes above.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from engine import settings
from engine.parallel.dist import DistEnv, free_port
from engine.parallel.worker import exit_now, worker_main

_PROJECT_ROOT = Path(__file__).resolve().parents[2]


class RankSpawner:
    def __init__(self, world_size: int, device_type: str, master_addr: str = "127.0.0.1",
                 master_port: int | None = None):
        if world_size < 2:
            raise ValueError(f"a multi-rank engine needs at least 2 ranks, got {world_size}")
        self.world_size = world_size
        self.device_type = device_type
        self.master_addr = master_addr
        self.master_port = master_port or free_port()
        self.procs: list[subprocess.Popen] = []

    def start(self) -> DistEnv:
        """Start ranks 1..N-1; returns rank 0's environment (the caller joins as rank 0)."""
        base = dict(os.environ)  # this process's environment, passed on to the ranks it starts
        path = [str(_PROJECT_ROOT)] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])
        base.update(PYTHONPATH=os.pathsep.join(path), **settings.spawned_rank_environ(self.device_type, os.getpid()))
        if self.device_type == "cuda":  # GPU ranks do no heavy host math; N ranks x all cores of OpenMP
            base.setdefault("OMP_NUM_THREADS", "1")  # threads only contend with NCCL's and CUDA's
        for rank in range(1, self.world_size):
            env = dict(base)
            env.update(self.env_for(rank).to_environ())
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"], env=env,
                                               cwd=str(_PROJECT_ROOT)))
        return self.env_for(0)

    def env_for(self, rank: int) -> DistEnv:
        return DistEnv.for_rank(rank, self.world_size, self.master_addr, self.master_port, self.device_type == "cuda")

    def dead_ranks(self) -> list[int]:
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for the workers to leave (after a shutdown message), then terminate what is left."""
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.stop(timeout=5)


class RankPool:
    """Idle spawned ranks (and rank 0's process groups) handed back by the engines built with this pool, so the
    next engine of the same world size in this process starts without spawning (test modules and benchmark
    sweeps that build engine after engine). Its owner closes it; at the latest it closes at exit."""

    def __init__(self):
        self._idle: tuple | None = None  # (world_size, device_type, spawner, comm)
        atexit.register(self.close)

    def put(self, world_size: int, device_type: str, spawner: RankSpawner, comm) -> None:
        self.close()
        self._idle = (world_size, device_type, spawner, comm)

    def take(self, world_size: int, device_type: str) -> tuple | None:
        """(spawner, comm) of idle ranks of this shape, else None (idle ranks of another shape are closed)."""
        idle, self._idle = self._idle, None
        if idle is None:
            return None
        if idle[:2] == (world_size, device_type) and not idle[2].dead_ranks():
            return idle[2], idle[3]
        self._idle = idle
        self.close()
        return None

    def close(self) -> None:
        idle, self._idle = self._idle, None
        if idle is None:
            return
        _, _, spawner, comm = idle
        try:
            if not spawner.dead_ranks():
                comm.broadcast_object(("exit",))
            comm.shutdown()
        finally:
            spawner.stop()


def started_by_torchrun() -> bool:
    return settings.dist_world_size() is not None and settings.dist_rank() is not None


def run_rank(driver: Callable[[], object]) -> object:
    """torchrun entry point: rank 0 runs `driver`, the other ranks serve as workers until it shuts down."""
    if not started_by_torchrun() or settings.dist_rank() == 0:
        return driver()
    worker_main()
    exit_now(0)  # a worker rank ends here: nothing of the driver's script runs after it
