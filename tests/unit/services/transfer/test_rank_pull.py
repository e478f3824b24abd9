"""The driver's side of a DP worker rank's pull (services/transfer/rank_pull.py): the pull is started on that
rank only, its reported outcome comes back as the bytes moved or as the error rank 0's own puller would
raise, and nothing waits forever (no report by the deadline, or an engine that stopped)."""

from __future__ import annotations

import asyncio
import time

import pytest

from proto.pdserve.v1 import prefill_pb2
from services.transfer import rank_pull
from services.transfer.nixl_agent import TransferError, TransferTimeout
from services.transfer.rank_pull import RankPuller


class _Core:
    def __init__(self):
        self.rpcs: list[tuple] = []

    def collective_rpc(self, method, *args):
        self.rpcs.append((method, *args))
        return [False, True]


class _Engine:
    def __init__(self):
        self.core, self.is_running = _Core(), True

    async def call(self, fn):
        return fn(self.core)


class _Agent:
    """Answers the first wait for a pull's report with `reply(token)` (None: never)."""

    def __init__(self, engine, reply):
        self.engine, self.reply, self.waits = engine, reply, []

    async def wait_notif(self, deadline, peer=None, prefix=b""):
        self.waits.append((peer, prefix))
        token = self.engine.core.rpcs[-1][2]
        msg = self.reply(token)
        if msg is None:
            await asyncio.sleep(max(deadline - time.monotonic(), 0))
            raise TimeoutError("none")
        return peer, msg


def _pull(reply, timeout_s: float = 0.05, stop_engine: bool = False):
    engine = _Engine()
    agent = _Agent(engine, reply)
    puller = RankPuller(engine, 1, agent, "worker-agent", spec=None, timeout_s=timeout_s)
    if stop_engine:
        engine.is_running = False
    kv = prefill_pb2.KVHandle(num_tokens=100, lease_id="l")
    return engine, agent, asyncio.run(puller.pull(kv, [4, 5], 64))


def test_the_pull_runs_on_its_rank_and_reports_the_bytes():
    engine, agent, moved = _pull(lambda t: f"dppull:{t}:ok:4096".encode())
    assert moved == 4096
    ((method, rank, token, kv_bytes, blocks, cached),) = engine.core.rpcs
    assert method is rank_pull.start and rank == 1 and blocks == [4, 5] and cached == 64
    assert prefill_pb2.KVHandle.FromString(kv_bytes).lease_id == "l"
    assert agent.waits == [("worker-agent", f"dppull:{token}:".encode())]


@pytest.mark.parametrize("kind, exc", [("timeout", TransferTimeout), ("error", TransferError),
                                       ("invalid", ValueError)])
def test_a_failed_pull_raises_what_the_rank_raised(kind, exc):
    with pytest.raises(exc, match=r"DP rank 1: the reason"):
        _pull(lambda t: f"dppull:{t}:{kind}:the reason".encode())


def test_no_report_by_the_deadline_is_a_timeout():
    t0 = time.monotonic()
    rank_pull._REPORT_GRACE_S, grace = 0.05, rank_pull._REPORT_GRACE_S
    try:
        with pytest.raises(TransferTimeout, match="did not report"):
            _pull(lambda t: None, timeout_s=0.05)
    finally:
        rank_pull._REPORT_GRACE_S = grace
    assert time.monotonic() - t0 < 2


def test_an_engine_that_stopped_ends_the_wait_at_once():
    t0 = time.monotonic()
    rank_pull._POLL_S, poll = 0.05, rank_pull._POLL_S
    try:
        with pytest.raises(TransferError, match="engine stopped"):
            _pull(lambda t: None, timeout_s=30.0, stop_engine=True)
    finally:
        rank_pull._POLL_S = poll
    assert time.monotonic() - t0 < 2


def test_start_runs_only_on_the_named_rank():
    class _Runner:
        def __init__(self, rank):
            self.comm = type("C", (), {"rank": rank})()
    assert rank_pull.start(_Runner(0), 1, "t", b"", [], 0) is False
    assert rank_pull.setup(_Runner(0), "g", b"", 4, 1.0) is None  # rank 0 pulls with the service's own puller
    with pytest.raises(RuntimeError, match="setup was not run"):
        rank_pull.start(_Runner(1), 1, "t", b"", [], 0)
