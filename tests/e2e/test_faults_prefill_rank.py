"""One rank of a PCP=2 prefill instance dies during load (docs/failures.md): the instance goes out of
service (NOT_SERVING, deregistered, exit 1), the router retries its in-flight prefills on the other
instance and routes new ones there, and after a restart it is routed to again; no request hangs, no
block leaks. Then a rank of the other instance hangs (stopped, alive): that instance leaves the same way
once no collective has completed for PDSERVE_RANK_HANG_TIMEOUT_S."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.launch import launcher
from services.rpc.grpc_server import check_health_sync
from tests.helpers import chaos, pace, system
from tests.helpers.chaos import CLIENT_TIMEOUT_S, GREEDY, ROUTER

HANG_S = 30.0  # the instances' hang timeout (a restarted one keeps the default); a loaded 2-core CI machine
# can take several seconds for one PCP step of a few thousand tokens, which must not look like a hang


@pytest.mark.xdist_group("faults-pcp")
def test_prefill_rank_killed_instance_goes_out_of_service_and_back(tmp_path_factory, offline, corpus):
    topo = system.topology(tmp_path_factory.mktemp("faults-pcp"), router=ROUTER)
    topo["services"]["prefill"].update(replicas=2, prefill_context_parallel_size=2,
                                       env={"PDSERVE_RANK_HANG_TIMEOUT_S": str(HANG_S)})
    del topo["services"]["kvstore"]
    dep = system.launch(topo)
    try:
        _prefill_rank_death(dep, offline, corpus)
    finally:
        launcher.down(dep)


def _at_prefills(dep, load: chaos.Load, num: int) -> float:
    """Returns once the router holds `num` requests (it hands each to a prefill at once; the prefill engines'
    own gauges are snapshots taken between steps, and one step takes all of these prompts) and they are a
    moment into their prefill, which takes seconds for these long prompts; returns the machine's slowdown,
    measured under that load, which scales the moment and the bounds after the fault."""
    metrics = chaos.instances(dep)["router-0"].metrics_address
    assert system.wait_for(lambda: system.metric(metrics, "pdserve:num_requests_running") >= num
                           or all(r is not None for r in load.results), period=0.02), "the requests never arrived"
    slow = pace.slowdown()
    time.sleep(pace.scaled(0.3, slow))
    return slow


def _prefill_rank_death(dep, offline, corpus) -> None:
    infos = chaos.instances(dep)
    p0, p1, dec = infos["prefill-0"], infos["prefill-1"], infos["decode-0"]
    # long prompts, so that several are being prefilled on prefill-0 when its rank dies
    bodies = [{"prompt": corpus[3000 * i: 3000 * i + 900 + 150 * i], "max_tokens": 16, **GREEDY} for i in range(6)]
    want = chaos.expected(offline, bodies)
    load = chaos.Load(dep.url, bodies, CLIENT_TIMEOUT_S).start()
    slow = _at_prefills(dep, load, len(bodies))
    t_kill = time.monotonic()
    chaos.kill(dep, "prefill-0.rank1")
    results = load.join()
    print("in flight when prefill-0.rank1 died:", [("ok" if r.ok else "error", round(r.elapsed, 2)) for r in results])
    router_log = open(chaos.record(dep, "router-0").log).read()
    retried = router_log.count("trying another")
    assert retried or not all(r.ok for r in results), "no request was in flight at prefill-0 when its rank died"
    for r, text in zip(results, want):  # each either completed correctly or failed cleanly: never wrong, never hung
        # the router's deadline bounds every request
        assert r.elapsed < ROUTER["request-timeout-s"] + pace.scaled(3, slow), r
        assert (r.ok and r.text == text) or (r.error is not None and r.finish_reason is None), r
    # the instance takes itself out of service: unhealthy, deregistered, rank 0 exits for a restart
    assert system.wait_for(lambda: not check_health_sync(p0.grpc_address))
    assert system.wait_for(lambda: "prefill-0" not in chaos.instances(dep)), "prefill-0 still registered"
    assert system.wait_for(lambda: chaos.exit_code(dep, "prefill-0.rank0") is not None)
    assert chaos.exit_code(dep, "prefill-0.rank0") == 1
    assert time.monotonic() - t_kill < ROUTER["request-timeout-s"] + pace.scaled(20, slow)
    served_before = system.metric(p1.metrics_address, "pdserve:time_to_first_token_seconds_count")
    for body, text in zip(bodies[:3], want[:3]):  # new requests go to the other instance
        status, out = chaos.complete_when_served(dep.url, body)
        assert status == 200 and out["choices"][0]["text"] == text, out
    assert system.metric(p1.metrics_address, "pdserve:time_to_first_token_seconds_count") == served_before + 3

    chaos.restart(dep, "prefill-0.rank0")
    chaos.restart(dep, "prefill-0.rank1")
    assert system.wait_for(lambda: "prefill-0" in chaos.instances(dep) and check_health_sync(p0.grpc_address),
                           timeout=system.START_S, period=1.0), \
        "the restarted prefill did not re-register\n" + chaos.log_tail(dep, "prefill-0.rank0", "prefill-0.rank1")

    def p0_served() -> float:
        return system.metric(p0.metrics_address, "pdserve:time_to_first_token_seconds_count")
    fresh = chaos.bodies(corpus, 6, 8, start=50000)  # no cached prefix anywhere: routed by load alone
    # two at a time: the router counts a request in flight on one prefill and sends the next to the other
    # (sequential requests tie on cost and would reach the restarted one only by chance)
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda b: chaos.complete_when_served(dep.url, b), fresh))
    for (status, out), text in zip(answers, chaos.expected(offline, fresh)):
        assert status == 200 and out["choices"][0]["text"] == text, out
    assert system.wait_for(lambda: p0_served() >= 1), "the router never chose the restarted prefill"
    chaos.assert_blocks_freed([p0.metrics_address, p1.metrics_address, dec.metrics_address])
    _prefill_rank_hang(dep, offline, corpus, p0, p1, dec)


def _prefill_rank_hang(dep, offline, corpus, p0, p1, dec) -> None:
    """prefill-1's worker rank stops (SIGSTOP): alive, so no collective fails; the hang timeout takes the
    instance out of service, its rank 0 exits 1 at once (its engine thread is stuck), clients never hang."""
    bodies = [{"prompt": corpus[70000 + 2500 * i: 70000 + 2500 * i + 900 + 150 * i], "max_tokens": 16, **GREEDY}
              for i in range(4)]
    want = chaos.expected(offline, bodies)
    load = chaos.Load(dep.url, bodies, CLIENT_TIMEOUT_S).start()
    slow = _at_prefills(dep, load, len(bodies))
    t_stop = time.monotonic()
    chaos.pause(dep, "prefill-1.rank1")
    try:
        assert system.wait_for(lambda: not check_health_sync(p1.grpc_address), timeout=HANG_S + 60)
        assert system.wait_for(lambda: "prefill-1" not in chaos.instances(dep))
        assert system.wait_for(lambda: chaos.exit_code(dep, "prefill-1.rank0") is not None)
        print(f"prefill-1 out of service {time.monotonic() - t_stop:.1f} s after its rank stopped")
        assert chaos.exit_code(dep, "prefill-1.rank0") == 1
        # it left for the hang, and only after the timeout ran from its last completed ping: that ping came before
        # the stop by up to one step and one ping period (seconds on a loaded machine), so the time since the stop
        # can be a little under HANG_S, but never near half of it
        reason = [line for line in open(chaos.record(dep, "prefill-1.rank0").log, errors="replace")
                  if "out of service" in line]
        assert reason and "a worker rank hangs" in reason[-1], \
            chaos.log_tail(dep, "prefill-1.rank0", "prefill-1.rank1")
        assert time.monotonic() - t_stop >= HANG_S / 2, "left long before the hang timeout: a false alarm"
        results = load.join()
        for r, text in zip(results, want):
            assert r.elapsed < ROUTER["request-timeout-s"] + pace.scaled(3, slow), r
            assert (r.ok and r.text == text) or (r.error is not None and r.finish_reason is None), r
        for body, text in zip(bodies[:2], want[:2]):  # the other instance serves what comes next
            status, out = chaos.complete_when_served(dep.url, body)
            assert status == 200 and out["choices"][0]["text"] == text, out
    finally:
        chaos.kill(dep, "prefill-1.rank1")  # a stopped process still takes SIGKILL
    chaos.assert_blocks_freed([p0.metrics_address, dec.metrics_address])
