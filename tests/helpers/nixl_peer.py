"""A NIXL peer in a child process for the e2e tests: owns two block-major tensors of seeded random
bytes and answers commands over a multiprocessing pipe."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import torch

NUM_BLOCKS = 16
SHAPES = {"mla": (NUM_BLOCKS, 2, 64, 40), "index": (NUM_BLOCKS, 1, 64, 12)}  # uint8, block-major


def make_tensors(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
            for name, shape in SHAPES.items()}


def _serve(conn, seed: int, env: dict[str, str], device: str) -> None:
    os.environ.update(env)  # before the agent exists: UCX reads UCX_TLS when its context is created
    from services.transfer.nixl_agent import NixlAgent, deadline_in

    loop = asyncio.new_event_loop()
    tensors = make_tensors(seed, device)  # (CUDA is initialised before the agent registers VRAM)
    agent = NixlAgent(f"peer-{os.getpid()}")
    described = agent.register(tensors)
    conn.send((agent.metadata(), described))
    while True:
        while not conn.poll(0.002):
            agent.progress()  # a passive target must drive NIXL progress for the peer's transfers
        cmd, arg = conn.recv()
        if cmd == "notif":
            try:
                conn.send(loop.run_until_complete(agent.wait_notif(deadline_in(arg))))
            except TimeoutError as e:
                conn.send(e)
        elif cmd == "blocks":
            conn.send({name: t[arg].cpu() for name, t in tensors.items()})
        elif cmd == "exit":
            agent.close()
            conn.send("bye")
            return


class Peer:
    """Handle on the child: `.metadata`, `.tensors` (BlockTensor list), `.call(cmd, arg)`."""

    def __init__(self, seed: int, env: dict[str, str] | None = None, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, seed, env or {}, device), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise TimeoutError("NIXL peer process did not start within 60 s")
        self.metadata, self.tensors = self.conn.recv()

    def call(self, cmd: str, arg=None, timeout: float = 30.0):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"NIXL peer did not answer {cmd!r} within {timeout} s")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=5)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.kill()
        self.proc.join(5)
