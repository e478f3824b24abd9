"""A DP2 x EP2 decode group behind `pdserve up` (one process per DP rank, registered as decode-0-dp0 and
decode-0-dp1 at rank 0's address; HiSparse, MTP3 and async scheduling on both ranks): streamed chat through the router
equals the offline engine, with requests on both ranks. One rank killed mid-stream: every in-flight client,
on either rank, gets an error event at once; the group leaves service as one (NOT_SERVING, both instances
deregistered, rank 0 exits 1); restarted, it serves again and ends with no KV blocks or HiSparse rows
held. One rank stopped (alive): every stream ends at the router's idle timeout and the group leaves after
the hang timeout (docs/failures.md)."""

from __future__ import annotations

import inspect
import time

import pytest

from engine import SamplingParams
from services.launch import launcher
from services.rpc.grpc_server import check_health_sync
from tests.helpers import chaos, pace, system
from tests.helpers.chaos import CLIENT_TIMEOUT_S, ROUTER

pytestmark = pytest.mark.xdist_group("faults-dp")

HANG_S = 10.0  # the group's hang timeout: a decode step of this tiny model takes well under a second
RESTART_S = system.START_S  # as long as the first start may take; about 12 s when the machine is idle
RANKS = ("decode-0-dp0", "decode-0-dp1")
ROUTER_SETTLE_S = 1.5  # three of the router's 0.5 s load refreshes on an idle machine (scaled by its slowdown)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    topo = system.topology(tmp_path_factory.mktemp("dp-decode"), router=ROUTER)
    del topo["services"]["kvstore"]
    decode = topo["services"]["decode"]
    decode["data_parallel_size"] = 2
    decode["args"]["enable-expert-parallel"] = True
    decode["args"]["async-scheduling"] = True  # the group plans step N + 1 while N runs (KV pulls wait for N)
    decode["env"] = {"PDSERVE_RANK_HANG_TIMEOUT_S": str(HANG_S)}
    d = system.launch(topo, timeout_s=RESTART_S)
    yield d
    launcher.down(d)


def _chats(n: int, max_tokens: int, start: int = 0) -> list[dict]:
    import difflib
    src = inspect.getsource(difflib)
    return [{"messages": [{"role": "user", "content": src[start + 700 * i: start + 700 * i + 150 + 40 * i]}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **NO_THINKING}
            for i in range(n)]


def _expected(dep, offline, chats: list[dict]) -> list[list[int]]:
    prompts = []
    for c in chats:
        status, out = system.post(dep.url, "/tokenize", {"messages": c["messages"], **NO_THINKING})
        assert status == 200, out
        prompts.append(out["tokens"])
    outs = offline.generate(prompts, SamplingParams(max_tokens=chats[0]["max_tokens"], temperature=0.0,
                                                    ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _loads(dep) -> dict[str, dict]:
    return system.with_state(dep.redis_url, lambda s: s.loads(list(RANKS)))


def _serves_equal_to_offline(dep, offline, address: str, chats: list[dict]) -> None:
    want = _expected(dep, offline, chats)
    before = system.admitted_per_rank(address, len(RANKS))
    results = chaos.Load(dep.url, chats, CLIENT_TIMEOUT_S, path="/v1/chat/completions").start().join()
    for r, ids in zip(results, want):
        assert r.ok and r.text, r
        assert r.token_ids == ids, "streamed chat differs from the offline engine"
    gained = [a - b for a, b in zip(system.admitted_per_rank(address, len(RANKS)), before)]
    assert sum(gained) == len(chats) and min(gained) >= 1, f"the router did not use both DP ranks: {gained}"
    steps = system.dp_steps(address)  # the group's decode steps ran planned (the static dispatch)
    assert steps["planned"] >= chats[0]["max_tokens"] // 4, steps


def _nothing_held(address: str) -> None:
    chaos.assert_blocks_freed([address])
    for gauge in ("pdserve:hisparse_requests_placed", "pdserve:hisparse_device_blocks_in_use"):
        assert system.wait_for(lambda g=gauge: system.metric(address, g) == 0), f"{gauge} at {address}"


def test_dp_group_serves_then_a_dead_or_hung_rank_takes_it_out(dep, offline):
    infos = chaos.instances(dep)
    assert all(infos[r].grpc_address == infos[RANKS[0]].grpc_address for r in RANKS)
    assert [infos[r].extra["dp_rank"] for r in RANKS] == [0, 1]
    dec, pre = infos[RANKS[0]], infos["prefill-0"]
    _serves_equal_to_offline(dep, offline, dec.metrics_address, _chats(6, 24))
    _nothing_held(dec.metrics_address)
    _rank_killed_mid_stream(dep, offline, dec, pre)
    _rank_hangs(dep, dec, pre)


def _mid_stream(dep, chats: list[dict]) -> chaos.Load:
    """Long streams on both ranks, every one of them past its first tokens. The router places them by the
    loads the ranks publish each heartbeat plus its own in-flight counts: it starts once both ranks have
    published themselves idle and the router has had time to read that (on a loaded 2-core CI machine one
    run saw all four streams go to rank 0 without the wait), so a load left over from the chats before cannot
    steer every stream to one rank."""
    assert system.wait_for(lambda: all(v.get("running", 0) == 0 and v.get("waiting", 0) == 0
                                       for v in _loads(dep).values())), \
        f"the ranks still publish work from before: {_loads(dep)}"
    # the router re-reads those loads every 0.5 s and says nothing when it has: let it see them idle too
    time.sleep(pace.scaled(ROUTER_SETTLE_S))
    load = chaos.Load(dep.url, chats, CLIENT_TIMEOUT_S, path="/v1/chat/completions").start()
    assert load.wait_started(120), "streams did not start"
    assert system.wait_for(lambda: all(v.get("running", 0) >= 1 for v in _loads(dep).values())), \
        f"streams are not running on both ranks: {_loads(dep)}"
    return load


def _rank_killed_mid_stream(dep, offline, dec, pre) -> None:
    load = _mid_stream(dep, _chats(4, 1500, start=20000))
    slow = pace.slowdown()
    t_kill = time.monotonic()
    chaos.kill(dep, "decode-0.rank1")
    results = load.join()
    print(f"decode-0.rank1 killed: {len(results)} streams ended {time.monotonic() - t_kill:.2f}s after "
          f"(machine {slow:.1f}x slower than usual)")
    assert time.monotonic() - t_kill < ROUTER["stream-idle-timeout-s"] + pace.scaled(5, slow), \
        "streams did not end promptly"
    for r in results:  # every client of either rank: its text so far, then an error event, never a finish
        assert r.status == 200 and r.text and r.done and r.finish_reason is None, r
        assert r.error is not None and r.error["type"] in ("upstream_error", "service_unavailable"), r
    assert system.wait_for(lambda: not any(i in chaos.instances(dep) for i in RANKS)), \
        "the group's instances are still registered"
    assert system.wait_for(lambda: chaos.exit_code(dep, "decode-0.rank0") is not None)
    assert chaos.exit_code(dep, "decode-0.rank0") == 1
    assert not check_health_sync(dec.grpc_address)
    t0 = time.monotonic()  # no decode left: the router answers 503 at once, nothing waits
    status, err = system.post(dep.url, "/v1/completions", {"prompt": "x = 1", "max_tokens": 4},
                              timeout=CLIENT_TIMEOUT_S)
    assert status == 503 and "decode" in err["error"]["message"] and time.monotonic() - t0 < pace.scaled(5, slow), err
    chaos.assert_blocks_freed([pre.metrics_address])  # the streams' prefill leases were released

    for rank in ("decode-0.rank0", "decode-0.rank1"):  # the restarted group keeps the short hang timeout
        chaos.restart(dep, rank, env={"PDSERVE_RANK_HANG_TIMEOUT_S": str(HANG_S)})
    assert system.wait_for(lambda: all(i in chaos.instances(dep) for i in RANKS)
                           and check_health_sync(dec.grpc_address), timeout=RESTART_S, period=1.0), \
        "the restarted group did not re-register\n" + chaos.log_tail(dep, "decode-0.rank0", "decode-0.rank1")
    _nothing_held(dec.metrics_address)
    _serves_equal_to_offline(dep, offline, dec.metrics_address, _chats(6, 24, start=40000))
    _nothing_held(dec.metrics_address)
    chaos.assert_blocks_freed([pre.metrics_address])


def _rank_hangs(dep, dec, pre) -> None:
    load = _mid_stream(dep, _chats(4, 1500, start=60000))
    slow = pace.slowdown()
    t_stop = time.monotonic()
    chaos.pause(dep, "decode-0.rank1")
    try:
        results = load.join()
        assert time.monotonic() - t_stop < ROUTER["stream-idle-timeout-s"] + pace.scaled(5, slow), \
            "streams outlived the idle timeout"
        for r in results:
            assert r.status == 200 and r.done and r.finish_reason is None, r
            assert r.error is not None and "sent nothing" in r.error["message"], r
        assert system.wait_for(lambda: not any(i in chaos.instances(dep) for i in RANKS), timeout=HANG_S + 60)
        assert system.wait_for(lambda: chaos.exit_code(dep, "decode-0.rank0") is not None)
        print(f"decode group out of service {time.monotonic() - t_stop:.1f} s after its rank stopped")
        assert chaos.exit_code(dep, "decode-0.rank0") == 1
        assert time.monotonic() - t_stop >= HANG_S - 1, "left before the hang timeout: a false alarm"
    finally:
        chaos.kill(dep, "decode-0.rank1")  # a stopped process still takes SIGKILL
    chaos.assert_blocks_freed([pre.metrics_address])
