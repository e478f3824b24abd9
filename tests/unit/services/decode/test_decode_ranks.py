"""The decode servicer of a DP group: the request's instance id picks the DP rank (its blocks, its puller, its
admission bounds), an empty id takes the least-loaded rank, an id the group does not serve is refused; a
one-instance servicer takes any id, as before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from proto.pdserve.v1 import decode_pb2, prefill_pb2
from services.decode.server import DecodeRank, DecodeServicer
from services.rpc.admission import Admission
from services.rpc.grpc_server import Overloaded
from services.rpc.metrics import ServiceMetrics


class _Engine:
    config = SimpleNamespace(scheduler=SimpleNamespace(max_model_len=4096), model=SimpleNamespace(vocab_size=4096))

    def __init__(self, running: tuple[int, int] = (0, 0)):
        self.reserved: list[tuple[str, int | None]] = []
        self.running = running
        self.planned = 7

    async def add_import_request(self, req, num_tokens, rank=None):
        self.reserved.append((req.req_id, rank))

        async def stream():
            return
            yield
        return stream(), [3, 4], 0

    def abort(self, req_id):
        pass

    def import_done(self, req_id, ok, num_tokens=None):
        pass

    def stats(self):
        ranks = tuple(SimpleNamespace(num_running=n, num_waiting=0, num_free_blocks=8) for n in self.running)
        return SimpleNamespace(spec_drafts=0, spec_accepted=0, spec_steps=0, spec_emitted=0, dp_ranks=ranks,
                               dp_steps={"planned": self.planned, "dynamic": 1})


class _Puller:
    spec = None

    def __init__(self):
        self.pulls = 0

    async def pull(self, kv, block_ids, n_cached):
        self.pulls += 1
        return 0


def _group(engine, max_inflight: int = 4) -> DecodeServicer:
    ranks = [DecodeRank(f"g-dp{r}", _Puller(), Admission(f"decode g-dp{r}", max_inflight, 4)) for r in range(2)]
    s = DecodeServicer(engine, None, ServiceMetrics("decode"), admit_timeout_s=1.0, ranks=ranks)
    s._request = lambda r: Request(f"r{len(engine.reserved)}", [1, 2, 3], SamplingParams(max_tokens=8))
    s._release = lambda kv, gens: asyncio.sleep(0, result=True)
    return s


def _call(s: DecodeServicer, instance_id: str) -> list:
    async def run():
        req = decode_pb2.DecodeRequest(kv=prefill_pb2.KVHandle(num_tokens=3), instance_id=instance_id)
        return [r async for r in s.Generate(req, context=None)]
    return asyncio.run(run())


def test_the_instance_id_picks_the_rank_and_its_puller():
    engine = _Engine()
    s = _group(engine)
    _call(s, "g-dp1")
    _call(s, "g-dp0")
    _call(s, "g-dp1")
    assert [rank for _, rank in engine.reserved] == [1, 0, 1]
    assert [r.puller.pulls for r in s.ranks] == [1, 2]
    assert s.metrics.dp_rank_requests.labels(dp_rank="1")._value.get() == 2
    # the group's steps by kind as the engine counts them (pdserve:dp_steps_total), not once per request
    assert s.metrics.dp_steps.labels(kind="planned")._value.get() == 7
    assert s.metrics.dp_steps.labels(kind="dynamic")._value.get() == 1
    engine.planned = 12
    _call(s, "g-dp0")
    assert s.metrics.dp_steps.labels(kind="planned")._value.get() == 12


def test_an_empty_id_takes_the_least_loaded_rank_and_a_foreign_id_is_refused():
    assert _group(_Engine(running=(3, 1)))._rank("") == 1
    assert _group(_Engine(running=(0, 0)))._rank("") == 0
    with pytest.raises(ValueError, match=r"'decode-9-dp0' is not served here \(this group serves g-dp0, g-dp1\)"):
        _group(_Engine())._rank("decode-9-dp0")


def test_admission_bounds_are_per_rank():
    s = _group(_Engine(), max_inflight=1)
    s.ranks[1].admission.acquire()  # rank 1 is full
    with pytest.raises(Overloaded, match="g-dp1 is at capacity"):
        s.ranks[1].admission.acquire()
    _call(s, "g-dp0")  # rank 0 still admits
    assert s.ranks[0].admission.num_inflight == 0 and s.ranks[0].puller.pulls == 1


def test_one_instance_takes_any_id_and_no_rank_argument():
    engine = _Engine()
    s = DecodeServicer(engine, _Puller(), ServiceMetrics("decode"), admit_timeout_s=1.0)
    assert s._rank("whatever-the-router-calls-it") == 0 and s._rank("") == 0
    s._request = lambda r: Request("one", [1, 2, 3], SamplingParams(max_tokens=8))
    s._release = lambda kv, gens: asyncio.sleep(0, result=True)
    _call(s, "decode-0")
    assert engine.reserved == [("one", None)]  # add_import_request(req, n): no rank for a one-rank engine


def test_a_group_needs_one_process_per_dp_rank(capsys):
    from services.decode.main import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data-parallel-size", "2", "--world-size", "4"])
    assert "--world-size 4 must equal --data-parallel-size 2" in capsys.readouterr().err
    args = parse_args(["--model", "m", "--data-parallel-size", "2", "--enable-expert-parallel", "--world-size", "2",
                       "--rank", "1"])
    assert (args.data_parallel_size, args.world_size, args.rank) == (2, 2, 1)
