"""Processes we start: stop them by pid (SIGTERM, then SIGKILL), optionally tie them to our life. Shared by
the launcher (services/launch/) and the private redis-server (services/cluster/redis_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# Runs before the real command and survives its exec: PR_SET_PDEATHSIG(SIGTERM) makes the kernel
# signal the child when the thread that started it dies -- even by SIGKILL or a crash.
# (If the parent died before prctl took effect, the child is already orphaned: exit.)
_TRAMPOLINE = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
               "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def tie_to_parent(cmd: list[str]) -> list[str]:
    """`cmd`, wrapped so that it gets SIGTERM when the calling thread's process dies (Linux)."""
    return [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *cmd]


def stop_pid(pid: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Terminate a process we started (by pid), reaping it when it is our child."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if _wait_exit(pid, wait, proc):
            break
    if proc is not None:
        proc.poll()


def _wait_exit(pid: int, timeout: float, proc: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return True
        elif not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:  # our own child: reap it if it exited
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) no longer serves anything
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
