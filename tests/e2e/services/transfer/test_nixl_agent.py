"""NIXL between two real processes over loopback: byte-exact block READ/WRITE with notifications,
a deadline on a hung peer, and the error of a dead one."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time

import pytest
import torch

from services.rpc.metrics import ServiceMetrics
from services.transfer.nixl_agent import (
    AgentThread,
    NixlAgent,
    PeerDisconnected,
    TransferTimeout,
    deadline_in,
    parse_pulled,
    pulled_notif,
)
from tests.helpers.nixl_peer import Peer, make_tensors
from tests.helpers.pace import scaled, slowdown

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def peer():
    p = Peer(seed=1)
    yield p
    p.close()


def _local_agent(name: str, seed: int, metrics=None):
    tensors = make_tensors(seed)
    agent = NixlAgent(f"{name}-{os.getpid()}-{time.monotonic_ns()}", metrics=metrics)
    return agent, tensors, agent.register(tensors)


def test_read_and_write_blocks_byte_exact(peer):
    async def main():
        agent, mine, described = _local_agent("reader", seed=2)
        name = agent.add_peer(peer.metadata)
        assert agent.add_peer(peer.metadata) == name  # idempotent
        local, remote = agent.prep_local(described), agent.prep_remote(name, peer.tensors)
        theirs = make_tensors(1)
        # READ remote blocks 9, 3, 14 (shuffled) into local blocks 0, 5, 6
        xfer = agent.read(local, [0, 5, 6], remote, [9, 3, 14], notif=pulled_notif("lease-7"))
        await agent.wait(xfer, deadline_in(10))
        for key in mine:
            assert torch.equal(mine[key][[0, 5, 6]], theirs[key][[9, 3, 14]])
            assert torch.equal(mine[key][1:5], make_tensors(2)[key][1:5])  # untouched blocks unchanged
        sender, msg = await asyncio.to_thread(peer.call, "notif", 5.0)
        assert sender == agent.name and parse_pulled(msg) == "lease-7"
        # WRITE local blocks 1, 2 into remote blocks 4, 11, with a notification
        xfer = agent.write(local, [1, 2], remote, [4, 11], notif=b"stored x")
        await agent.wait(xfer, deadline_in(10))
        assert (await asyncio.to_thread(peer.call, "notif", 5.0))[1] == b"stored x"
        got = await asyncio.to_thread(peer.call, "blocks", [4, 11])
        for key in mine:
            assert torch.equal(got[key], mine[key][[1, 2]])
        expected = 3 * sum(t.block_bytes for t in described) + 2 * sum(t.block_bytes for t in described)
        assert agent.stats.bytes_transferred == expected and agent.stats.num_failed_transfers == 0
        agent.send_notif(name, b"alone")  # a notification without a transfer
        assert (await asyncio.to_thread(peer.call, "notif", 5.0))[1] == b"alone"
        agent.close()

    asyncio.run(main())


def test_bad_pairings_are_rejected(peer):
    agent, _, described = _local_agent("bad", seed=3)
    name = agent.add_peer(peer.metadata)
    local, remote = agent.prep_local(described), agent.prep_remote(name, peer.tensors)
    with pytest.raises(ValueError, match="pair them"):
        agent.read(local, [0, 1], remote, [0])
    with pytest.raises(ValueError, match="out of range"):
        agent.read(local, [0], remote, [99])
    with pytest.raises(ValueError, match="layouts differ"):
        agent.read(local, [0], agent.prep_remote(name, peer.tensors[:1]), [0])
    with pytest.raises(ValueError, match="unknown NIXL peer"):
        agent.prep_remote("nobody", peer.tensors)
    agent.close()


def test_deadline_on_hung_peer(monkeypatch):
    # Over shared memory a stopped peer does not block a READ (the copy is one-sided); over TCP its
    # UCX progress must answer, so SIGSTOP makes it hang -- and NIXL never notices on its own.
    monkeypatch.setenv("UCX_TLS", "tcp")
    peer = Peer(seed=4, env={"UCX_TLS": "tcp"})
    try:

        async def main():
            agent, mine, described = _local_agent("hung", seed=5)
            name = agent.add_peer(peer.metadata)
            local, remote = agent.prep_local(described), agent.prep_remote(name, peer.tensors)
            await agent.wait(agent.read(local, [0], remote, [0]), deadline_in(10))  # healthy first
            slow = slowdown(services=False)  # the agent runs in this process
            os.kill(peer.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                await agent.wait(agent.read(local, list(range(16)), remote, list(range(16))), deadline_in(0.5))
            assert 0.5 <= time.monotonic() - t0 < 0.5 + scaled(2.5, slow)
            assert agent.stats.num_timeouts == 1 and agent.stats.num_failed_transfers == 1
            agent.close()
        asyncio.run(main())
    finally:
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.join(5)


def test_dead_peer_raises_quickly():
    peer = Peer(seed=6)
    metrics = ServiceMetrics("decode")

    async def main():
        agent, _, described = _local_agent("dead", seed=7, metrics=metrics)
        name = agent.add_peer(peer.metadata)
        local, remote = agent.prep_local(described), agent.prep_remote(name, peer.tensors)
        await agent.wait(agent.read(local, [0], remote, [0]), deadline_in(10))
        slow = slowdown(services=False)
        peer.proc.kill()
        peer.proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(PeerDisconnected):
            for _ in range(50):  # the disconnect is noticed within milliseconds, not on a deadline
                await agent.wait(agent.read(local, [1], remote, [1]), deadline_in(2))
                await asyncio.sleep(0.02)
        assert time.monotonic() - t0 < scaled(2.0, slow)
        assert agent.stats.num_timeouts == 0, "a read's deadline fired: the disconnect was not noticed"
        assert agent.stats.num_failed_transfers >= 1
        sample = metrics.registry.get_sample_value
        assert sample("pdserve:nixl_num_failed_transfers_total") == agent.stats.num_failed_transfers
        assert sample("pdserve:nixl_bytes_transferred_total") == sum(t.block_bytes for t in described)
        with pytest.raises(PeerDisconnected):
            agent.send_notif(name, b"anyone?")
        agent.remove_peer(name)
        assert not agent.has_peer(name)
        with pytest.raises(ValueError, match="released"):
            agent.read(local, [1], remote, [1])
        agent.close()
    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("remote_device", ["cuda", "cpu"])  # GPU cache <-> GPU cache, GPU <-> host pool
def test_vram_blocks_byte_exact(remote_device):
    peer = Peer(seed=11, device=remote_device)
    try:
        async def main():
            mine = make_tensors(12, "cuda")
            agent = NixlAgent(f"gpu-{os.getpid()}-{time.monotonic_ns()}")
            described = agent.register(mine)
            assert {t.mem_type for t in described} == {"VRAM"}
            name = agent.add_peer(peer.metadata)
            local, remote = agent.prep_local(described), agent.prep_remote(name, peer.tensors)
            await agent.wait(agent.read(local, [0, 1], remote, [7, 2]), deadline_in(20))
            await agent.wait(agent.write(local, [3], remote, [9]), deadline_in(20))
            theirs = make_tensors(11)
            got = await asyncio.to_thread(peer.call, "blocks", [9])
            for key in mine:
                assert torch.equal(mine[key][[0, 1]].cpu(), theirs[key][[7, 2]])
                assert torch.equal(got[key], mine[key][[3]].cpu())
            agent.close()
        asyncio.run(main())
    finally:
        peer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hisparse_layout_pull_lands_by_memory_type():
    """A HiSparse decode cache (MLA rows in pinned host memory, indexer rows on the GPU) READs from a
    GPU cache: two registrations, and each tensor's bytes land on its own device."""
    peer = Peer(seed=13, device="cuda")
    try:
        async def main():
            cpu = make_tensors(14)
            mine = {"mla": cpu["mla"].pin_memory(), "index": cpu["index"].cuda()}
            agent = NixlAgent(f"hs-{os.getpid()}-{time.monotonic_ns()}")
            described = agent.register(mine)
            assert [t.mem_type for t in described] == ["DRAM", "VRAM"]
            local = agent.prep_local(described)
            remote = agent.prep_remote(agent.add_peer(peer.metadata), peer.tensors)
            await agent.wait(agent.read(local, [0, 4], remote, [6, 1]), deadline_in(20))
            theirs = make_tensors(13)
            for key in mine:
                assert torch.equal(mine[key][[0, 4]].cpu(), theirs[key][[6, 1]])
            agent.close()
        asyncio.run(main())
    finally:
        peer.close()


def test_agent_refuses_other_threads():
    agent, _, _ = _local_agent("owner", seed=8)
    with pytest.raises(RuntimeError, match="not thread-safe"):
        asyncio.run(asyncio.to_thread(agent.metadata))
    agent.close()


def _process_cpu_s() -> float:
    """User + system CPU seconds of this process, all its threads (NIXL's own ones included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_agent_thread_serves_reads_and_idles_cheaply():
    """A worker rank's agent (AgentThread: its own loop polls it) completes a peer's READ with nothing
    called on it, and idles at a fraction of a core (NIXL's own progress thread spins a whole one)."""
    theirs = make_tensors(4)
    worker = AgentThread(f"worker-{os.getpid()}-{time.monotonic_ns()}", thread_name="nixl-test")
    described = worker.call(lambda: worker.agent.register(theirs))
    metadata = worker.call(worker.agent.metadata)

    async def main():
        agent, mine, local_desc = _local_agent("reader-of-worker", seed=5)
        name = agent.add_peer(metadata)
        local, remote = agent.prep_local(local_desc), agent.prep_remote(name, described)
        await agent.wait(agent.read(local, [1, 2], remote, [7, 0]), deadline_in(10))
        for key in mine:
            assert torch.equal(mine[key][[1, 2]], theirs[key][[7, 0]])
        agent.close()

    asyncio.run(main())
    before = _process_cpu_s()
    time.sleep(2.0)
    busy = _process_cpu_s() - before
    assert busy < 0.6, f"this process used {busy:.2f} s of CPU in 2 s with its agent thread idle"
    worker.call(worker.agent.close)


def test_an_idle_agent_polls_slowly_and_still_serves_a_new_peer():
    """Past BUSY_S without activity an agent polls every idle interval (20 ms), not every 2 ms; a new peer's
    READ still completes with nothing called on it (its first transfer waits a few idle polls for the
    connection's wire-up), and activity brings the 2 ms polling back at once."""
    from services.transfer import nixl_agent

    theirs = make_tensors(6)
    worker = AgentThread(f"idle-{os.getpid()}-{time.monotonic_ns()}", thread_name="nixl-idle")
    agent = worker.agent
    described = worker.call(lambda: agent.register(theirs))
    metadata = worker.call(agent.metadata)
    time.sleep(nixl_agent.BUSY_S + 0.3)  # the interval has doubled up to the idle one by now
    before = agent.polls
    time.sleep(1.0)
    idle = agent.polls - before
    assert idle <= 1 / agent.idle_poll_interval_s + 10, f"{idle} polls in 1 s of idleness"

    async def main():
        reader, mine, local_desc = _local_agent("reader-of-idle", seed=7)
        name = reader.add_peer(metadata)
        local, remote = reader.prep_local(local_desc), reader.prep_remote(name, described)
        t0 = time.monotonic()
        await reader.wait(reader.read(local, [3], remote, [5]), deadline_in(10))
        first = time.monotonic() - t0
        for key in mine:
            assert torch.equal(mine[key][3], theirs[key][5])
        reader.close()
        return first

    slow = slowdown(services=False)
    first = asyncio.run(main())
    assert first < scaled(2.0, slow), f"a new peer's first READ of an idle agent took {first:.2f} s"
    worker.call(agent.busy)
    before = agent.polls
    time.sleep(1.0)
    busy = agent.polls - before
    assert busy >= 2 * idle, f"{busy} polls in 1 s after busy(), {idle} in an idle second"
    worker.call(agent.close)
