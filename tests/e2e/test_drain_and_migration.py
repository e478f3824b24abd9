"""No request lost when a service stops (docs/failures.md, "Drain and migration"): on one deployment of two
prefills, two decodes, the kvstore and the router, 16 streaming greedy completions run while, phase after
phase, a decode gets SIGTERM (it drains: every stream finishes there), a decode gets SIGTERM twice (the drain
is cut: its streams move to the other decode), a decode is killed (its streams move), a prefill and the
kvstore get SIGTERM. Every client stream completes with exactly the tokens of an undisturbed run (greedy, and
seeded sampling when a decode is killed), each
stopped service exits 0, and no KV block, lease or HiSparse row stays held anywhere."""

from __future__ import annotations

import signal
import time

import pytest

from engine import SamplingParams
from services.launch import launcher
from tests.helpers import chaos, system
from tests.helpers.chaos import CLIENT_TIMEOUT_S

pytestmark = [pytest.mark.xdist_group("drain"), pytest.mark.slow]

STREAMS = 16
MAX_TOKENS = 120
SHUTDOWN_TIMEOUT_S = 90  # services' --shutdown-timeout here: far above what the streams need
ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def _terminate(dep, name: str, times: int = 1) -> None:
    rec = chaos.record(dep, name)
    assert launcher._is_ours(rec), f"{name} is not running"
    for i in range(times):
        if i:  # the second signal once the first one's drain runs (the instance has left the registry)
            assert system.wait_for(lambda: name not in chaos.instances(dep), timeout=60, period=0.05)
        chaos._signal(dep, name, signal.SIGTERM)


def _exits_zero(dep, name: str, within_s: float) -> None:
    code = system.wait_for(lambda: chaos.exit_code(dep, name) is not None, timeout=within_s + 60, period=0.1)
    assert code, f"{name} still runs {within_s:.0f}s after SIGTERM\n" + chaos.log_tail(dep, name)
    assert chaos.exit_code(dep, name) == 0, chaos.log_tail(dep, name)


def _restart(dep, name: str, addr: dict) -> None:
    chaos.restart(dep, name)
    ok = system.wait_for(lambda: name in chaos.instances(dep), timeout=240, period=0.5)
    assert ok, f"{name} did not come back\n" + chaos.log_tail(dep, name)


def _no_state_held(addr: dict, names) -> None:
    """No KV block (prefill leases included) and no HiSparse page or hot row held by any engine left."""
    chaos.assert_blocks_freed([addr[n] for n in names], timeout=30)
    for n in names:
        if n.startswith("decode"):
            placed = lambda n=n: system.metric(addr[n], "pdserve:hisparse_requests_placed") == 0
            assert system.wait_for(placed, timeout=30), f"{n} still holds HiSparse rows"


def _streams(addr: dict, bodies: list[dict], want: list[str], during) -> list:
    """Run the streams, apply `during()` once every stream has text (mid-stream), check every one is
    complete and token-exact: a greedy or seeded stream may part from the reference only at a near-tie
    (chaos.assert_stream_matches)."""
    for b in bodies:
        b["return_token_ids"] = True
    load = chaos.Load(addr["url"], bodies, CLIENT_TIMEOUT_S * 3).start()
    assert load.wait_started(120), "streams did not start"
    during()
    results = load.join()
    for r, text, body in zip(results, want, bodies):
        assert r.ok, r
        if r.text != text:
            chaos.assert_stream_matches(addr["offline"], body, r.token_ids)
    return results


def _migrations(addr: dict) -> float:
    return system.metric(addr["router"], "pdserve:request_migrations_total")


def _busier_decode(addr: dict) -> str:
    """The decode holding more of the streams once most of them are decoding (a stream's first token comes
    from prefill, so text alone does not say it reached a decode): the one whose stop moves something."""
    def running() -> dict[str, float]:
        return {n: system.metric(addr[n], "pdserve:num_requests_running") for n in ("decode-0", "decode-1")}

    assert system.wait_for(lambda: sum(running().values()) >= STREAMS // 2, timeout=60, period=0.05), \
        f"the streams did not reach the decodes: {running()}"
    now = running()
    return max(now, key=now.get)


def _phase_decode_drains(dep, addr, bodies, want):
    """SIGTERM: the decode leaves the registry at once and finishes its own streams (a request reaching it
    after the signal is refused before any work and taken by the other decode)."""
    stopped = []
    _streams(addr, bodies, want, lambda: (stopped.append(_busier_decode(addr)), _terminate(dep, stopped[0])))
    _exits_zero(dep, stopped[0], SHUTDOWN_TIMEOUT_S)
    _restart(dep, stopped[0], addr)


def _phase_decode_drain_cut_short_migrates(dep, addr, bodies, want):
    """SIGTERM twice: the drain ends at once, the streams still there move to the other decode."""
    before, stopped = _migrations(addr), []
    _streams(addr, bodies, want,
             lambda: (stopped.append(_busier_decode(addr)), _terminate(dep, stopped[0], times=2)))
    _exits_zero(dep, stopped[0], 120)
    assert _migrations(addr) > before, "the cut streams must have been migrated"
    _restart(dep, stopped[0], addr)


def _phase_decode_killed_migrates(dep, addr, bodies, want):
    """SIGKILL: the streams move. Half of them sample with a seed: their tokens after the move are those of
    an undisturbed seeded run too (a seeded draw is keyed on the seed and the position alone)."""
    before, killed = _migrations(addr), []
    _streams(addr, bodies, want, lambda: (killed.append(_busier_decode(addr)), chaos.kill(dep, killed[0])))
    assert _migrations(addr) > before
    _restart(dep, killed[0], addr)


def _seeded_half(bodies: list[dict], offline) -> list[str]:
    """Every other body sampled with a seed of its own (temperature 1); the undisturbed texts of all."""
    for i, b in enumerate(bodies):
        if i % 2:
            b.update(temperature=1.0, seed=1000 + i)
    params = [SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"], seed=b.get("seed"),
                             ignore_eos=True) for b in bodies]
    return [o.text for o in offline.generate([b["prompt"] for b in bodies], params)]


def _phase_prefill_drains(dep, addr, bodies, want):
    """SIGTERM to a prefill: its exported KV stays until every decode pulled it, then it exits 0."""
    _streams(addr, bodies, want, lambda: _terminate(dep, "prefill-0"))
    _exits_zero(dep, "prefill-0", SHUTDOWN_TIMEOUT_S)
    _restart(dep, "prefill-0", addr)


def _phase_kvstore_drains(dep, addr, bodies, want):
    _streams(addr, bodies, want, lambda: _terminate(dep, "kvstore-0"))
    _exits_zero(dep, "kvstore-0", SHUTDOWN_TIMEOUT_S)
    _restart(dep, "kvstore-0", addr)


def test_no_request_lost_when_a_service_stops(tmp_path_factory, offline, corpus):
    shutdown = {"shutdown-timeout": SHUTDOWN_TIMEOUT_S}
    topo = system.topology(tmp_path_factory.mktemp("drain"), router={"stream-idle-timeout-s": 20},
                           prefill=shutdown, decode=shutdown, kvstore=shutdown)
    for kind in ("prefill", "decode"):
        topo["services"][kind]["replicas"] = 2
    dep = system.launch(topo)
    try:
        addr = {i.instance_id: i.metrics_address for i in chaos.instances(dep).values()}
        addr["url"], addr["offline"] = dep.url, offline
        addr["router"] = next(a for n, a in addr.items() if n.startswith("router"))
        phases = (_phase_decode_drains, _phase_decode_drain_cut_short_migrates, _phase_decode_killed_migrates,
                  _phase_prefill_drains, _phase_kvstore_drains)
        for i, phase in enumerate(phases):
            bodies = chaos.bodies(corpus, STREAMS, MAX_TOKENS, start=2000 * i)
            if phase is _phase_decode_killed_migrates:
                want = _seeded_half(bodies, offline)
            else:
                want = chaos.expected(offline, bodies)
            t0 = time.monotonic()
            phase(dep, addr, bodies, want)
            _no_state_held(addr, ENGINES)
            print(f"{phase.__name__}: {time.monotonic() - t0:.1f}s")
    finally:
        launcher.down(dep)
