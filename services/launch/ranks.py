"""Run the N rank processes of one multi-process engine (the prefill engine's PCP/DCP/EP ranks).

The launcher starts each rank itself (own log file); a container runs them all through
`python -m services.launch.ranks --ranks N services.prefill <flags...>`, which adds
`--rank r --world-size N --master-addr 127.0.0.1 --master-port P` to each and exits when any rank exits
(stopping the others): one dead rank means a dead engine.

SIGTERM / SIGINT go to rank 0 alone: it serves the engine's gRPC, so it drains the group (services/rpc/drain.py:
the requests in flight finish on every rank, a second signal cuts it short), then shuts the engine down,
and the other ranks leave with it. A worker rank signalled itself would break the group's collectives
mid-drain. Ranks still running `WORKER_EXIT_S` after rank 0 ended are stopped.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from engine.parallel.dist import free_port
from services.rpc.service_args import rank_flags

WORKER_EXIT_S = 30.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.launch.ranks", description=__doc__)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--master-port", type=int, default=0, help="0 = any free port")
    p.add_argument("module")
    p.add_argument("flags", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.ranks < 1:
        p.error("--ranks must be >= 1")
    port = a.master_port or free_port()
    procs = [subprocess.Popen([sys.executable, "-m", a.module, *a.flags, *rank_flags(r, a.ranks, "127.0.0.1", port)])
             for r in range(a.ranks)]
    signalled = False

    def terminate_all() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def on_signal(*_) -> None:
        nonlocal signalled
        signalled = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)  # the group drains through rank 0 (a second one: at once)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while all(proc.poll() is None for proc in procs):
        time.sleep(0.2)
    if procs[0].poll() is not None:  # rank 0 ended: the others leave once they see the engine shut down
        end = time.monotonic() + WORKER_EXIT_S
        while time.monotonic() < end and any(proc.poll() is None for proc in procs):
            time.sleep(0.2)
    terminate_all()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
    codes = [proc.wait() for proc in procs]
    if signalled and all(c in (0, -signal.SIGTERM) for c in codes):
        return 0
    return next((abs(c) for c in codes if c not in (0, -signal.SIGTERM)), 1)


if __name__ == "__main__":
    sys.exit(main())
