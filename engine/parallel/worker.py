"""A worker rank: `python -m engine.parallel.worker` (torchrun's environment, see launcher.py).

It joins the process groups, then serves engines one after another: ("engine", EngineConfig) builds its
CPModelRunner (a DPModelRunner with data_parallel_size > 1), whose messages it then runs, in order:

    ("step", SchedulerOutput, check)  run the step (collectives with the other ranks); with `check`,
                                      all-gather what was sampled so rank 0 can compare
    ("dpstep", launch, async)         data parallel: receive this rank's SchedulerOutput (scatter) and run it
                                      (`launch`), gather the RankStepResults (RunnerOutput + HiSparse figures)
                                      on rank 0: this step's, or with async scheduling the one before it
    ("rpc", method, args)             call a runner method (by name) or a function (runner first; it arrives
                                      pickled by reference) and gather the results on rank 0
    ("release",)                      drop the runner, wait for the next ("engine", cfg) or ("exit",)
    ("shutdown",)                     leave
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch

from engine import settings
from engine.parallel.cp_runner import CPModelRunner, rank_output_digest
from engine.parallel.dist import DistEnv, RankComm
from engine.parallel.dp_runner import DPModelRunner


def worker_main() -> None:
    env = DistEnv.from_environ()
    device_type = settings.dist_device() or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    _exit_with_parent()
    comm = RankComm(env, device)
    while True:  # one engine after another (a pooled rank waits here between engines)
        msg = comm.broadcast_object()
        if msg[0] == "exit":
            break
        assert msg[0] == "engine", f"expected an engine config from rank 0, got {msg[0]!r}"
        if serve(rank_runner(msg[1], comm), comm) == "shutdown":
            break
        comm.reset_counters()
    comm.shutdown()


def rank_runner(cfg, comm: RankComm):
    """This rank's runner: a DP rank's (data_parallel_size > 1) or a CP rank's."""
    if cfg.parallel.data_parallel_size > 1:
        return DPModelRunner(cfg, comm)
    return CPModelRunner(cfg, comm)


def serve(runner, comm: RankComm) -> str:
    """Run rank 0's messages until "release" (back to the pool) or "shutdown"; returns which."""
    while True:
        msg = comm.broadcast_object()
        if msg[0] == "step":
            out = runner.execute(msg[1])
            if msg[2]:
                comm.all_gather_objects(rank_output_digest(out))
        elif msg[0] == "dpstep":  # data parallel: this rank's own SchedulerOutput, its RunnerOutput back
            launch, async_scheduling = msg[1], msg[2]
            comm.gather_objects(runner.run_step(comm.scatter_objects() if launch else None, async_scheduling))
        elif msg[0] == "rpc":
            comm.gather_objects(call_rpc(runner, msg[1], msg[2]))
        elif msg[0] in ("release", "shutdown"):
            return msg[0]
        else:
            raise RuntimeError(f"unknown message {msg[0]!r} from rank 0")


def check_rank_call(method) -> None:
    """What `collective_rpc` accepts: a runner method's name, or a function defined at a module's top level
    (pickled by reference: a lambda or a nested function cannot reach the other ranks)."""
    if isinstance(method, str):
        if not method.isidentifier():
            raise ValueError(f"collective_rpc takes a runner method's name or a function, got {method!r}")
        return
    name = getattr(method, "__qualname__", "")
    if not callable(method) or "<" in name or not getattr(method, "__module__", None):
        raise TypeError(f"collective_rpc takes a function defined at a module's top level, got {method!r}")


def call_rpc(runner, method, args: tuple) -> tuple[bool, object]:
    """(ok, result or formatted exception): an RPC error must not leave the other ranks waiting."""
    try:
        if isinstance(method, str):
            return True, getattr(runner, method)(*args)
        return True, method(runner, *args)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it
        return False, traceback.format_exc()


def _exit_with_parent() -> None:
    parent = settings.parent_pid()
    if parent is None:
        return

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: a process group's C++ threads may still be joinable when
    static destructors run, which aborts the process ("terminate called without an active exception")
    after its work is done. Nothing of ours is left to flush but the standard streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        worker_main()
    except Exception:  # noqa: BLE001 - printed for the log; rank 0 sees the rank gone
        traceback.print_exc()
        exit_now(1)
    exit_now(0)
