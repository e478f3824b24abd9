"""bench.serving.gpu_system's topology rewrite: fresh ports and Redis, the model and memory share, and a
decode without HiSparse on request (other attention settings kept)."""

from __future__ import annotations

from pathlib import Path

from bench.serving.gpu_system import topology

GPU1 = Path(__file__).resolve().parents[4] / "configs" / "topology.gpu-1.yaml"


def test_rewrites_ports_share_and_hisparse(tmp_path):
    topo = topology(GPU1, tmp_path, "m", dummy=True, share=0.2)
    dec = topo["services"]["decode"]["args"]
    assert "hisparse_config" in dec["attention-config"] and dec["gpu-memory-utilization"] == 0.2
    assert topo["model"] == "m" and dec["load-format"] == "dummy" and topo["run_dir"] == str(tmp_path)
    assert all(s["port"] == 0 for s in topo["services"].values())
    plain = topology(GPU1, tmp_path, None, dummy=False, share=None, hisparse=False)
    assert "attention-config" not in plain["services"]["decode"]["args"]
    assert plain["services"]["decode"]["args"]["speculative-config"]["num_speculative_tokens"] == 3


def test_async_scheduling_reaches_the_decode_only(tmp_path):
    topo = topology(GPU1, tmp_path, None, dummy=False, share=None, async_scheduling=True)
    assert topo["services"]["decode"]["args"]["async-scheduling"] is True
    assert "async-scheduling" not in topo["services"]["prefill"].get("args", {})


def test_split_from_the_services_counters():
    """The decode step by phase, its host time, and the per-delta delays of the decode service and the router,
    read from /metrics as the benchmark reads them."""
    from bench.serving.engine_counters import metric_values as _counters
    from bench.serving.gpu_system import server_side, split_line
    from services.rpc.metrics import ServiceMetrics

    dec, router = ServiceMetrics("decode"), ServiceMetrics("router")
    ports = dec.serve(), router.serve()
    try:
        before = {"decode": _counters(f"127.0.0.1:{ports[0]}"), "router": _counters(f"127.0.0.1:{ports[1]}")}
        dec.engine_steps.inc(10)
        dec.engine_step_seconds.inc(0.1)
        for phase, secs in (("schedule", 0.01), ("launch", 0.02), ("device_wait", 0.05), ("read_back", 0.005),
                            ("update", 0.015)):
            dec.engine_step_phase_seconds.labels(phase=phase).inc(secs)
        dec.engine_step_phase_cpu_seconds.labels(phase="launch").inc(0.012)
        for _ in range(4):
            dec.token_delta_delay_seconds.observe(0.002)
            router.token_delta_delay_seconds.observe(0.001)
        after = {"decode": _counters(f"127.0.0.1:{ports[0]}"), "router": _counters(f"127.0.0.1:{ports[1]}")}
    finally:
        dec.close()
        router.close()
    sv = server_side(before, after)
    assert sv["decode_mean_step_ms"] == 10.0 and abs(sv["decode_host_ms"] - 5.0) < 1e-9
    assert abs(sv["decode_phase_ms"]["launch"] - 2.0) < 1e-9
    # the engine thread ran 1.2 of the launch's 2.0 ms a step; no CPU time counted in the other phases
    assert abs(sv["decode_phase_cpu_ms"]["launch"] - 1.2) < 1e-9 and sv["decode_phase_cpu_ms"]["update"] == 0.0
    assert abs(sv["decode_delta_delay_ms"] - 2.0) < 1e-9 and abs(sv["router_delta_delay_ms"] - 1.0) < 1e-9
    line = split_line({"concurrency": 32, "median_tpot_ms": 14.0, "server": sv})
    assert "device wait 5.00 + host 5.00" in line and "router 1.00 ms per chunk" in line


def test_the_steps_spread_comes_from_the_services_histograms():
    """The decode's step and between-steps quantiles over a window: the histograms' bucket differences, read from
    /metrics as the benchmark reads them, interpolated within a bucket as Prometheus does; steps before the window
    do not count."""
    from bench.serving.engine_counters import histogram_quantile, metric_values, server_side
    from services.rpc.metrics import ServiceMetrics

    dec = ServiceMetrics("decode")
    port = dec.serve()
    try:
        for _ in range(50):  # before the window
            dec.engine_step_duration_seconds.observe(0.9)
        before = {"decode": metric_values(f"127.0.0.1:{port}")}
        for secs in [0.004] * 8 + [0.04] * 2:  # 8 steps in (0.003, 0.005], 2 in (0.03, 0.05]
            dec.engine_step_duration_seconds.observe(secs)
        dec.engine_step_gap_seconds.observe(0.0001)
        after = {"decode": metric_values(f"127.0.0.1:{port}")}
    finally:
        dec.close()
    sv = server_side(before, after)
    assert abs(sv["decode_step_p50_ms"] - (3.0 + 2.0 * 5 / 8)) < 1e-9  # rank 5 of the 8 in (3, 5] ms
    assert abs(sv["decode_step_p90_ms"] - 40.0) < 1e-9  # rank 9: half way through (30, 50] ms
    assert abs(sv["decode_gap_p50_ms"] - 0.1) < 1e-9  # rank 0.5 of 1 in (0, 0.2] ms
    assert sv["prefill_step_p50_ms"] is None  # no prefill engine read
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 3.0)]) == 0.1  # past the last finite bound


def test_the_calibrations_windows_read_each_roles_step_histogram_summed_over_its_instances(monkeypatch):
    """engine_counters.step_histograms: the step-duration buckets of every registered engine, summed per role (two
    decode ranks here; the router left out); histogram_quantiles of two such reads gives the window's quantiles."""
    import types

    from bench.serving.engine_counters import STEP_HISTOGRAMS, histogram_quantiles, step_histograms
    from services.cluster import redis_state
    from services.rpc.metrics import ServiceMetrics

    engines = [ServiceMetrics("decode"), ServiceMetrics("decode"), ServiceMetrics("prefill")]
    ports = [m.serve() for m in engines]
    insts = [types.SimpleNamespace(role=r, metrics_address=f"127.0.0.1:{p}")
             for p, r in zip(ports, ("decode", "decode", "prefill"))]
    insts.append(types.SimpleNamespace(role="router", metrics_address="127.0.0.1:1"))  # never read
    monkeypatch.setattr(redis_state, "registered_instances", lambda url: insts)
    try:
        before = step_histograms("redis://x")
        for secs in [0.004] * 4:
            engines[0].engine_step_duration_seconds.observe(secs)
        for secs in [0.004] * 4 + [0.04] * 2:
            engines[1].engine_step_duration_seconds.observe(secs)
        engines[2].engine_step_duration_seconds.observe(0.2)
        after = step_histograms("redis://x")
    finally:
        for m in engines:
            m.close()
    assert set(after) == {"decode", "prefill"}
    got = histogram_quantiles(before["decode"], after["decode"], STEP_HISTOGRAMS[0][0])
    assert abs(got[50] - (0.003 + 0.002 * 5 / 8)) < 1e-12  # rank 5 of the 8 in (3, 5] ms, both ranks' steps
    assert abs(got[90] - 0.04) < 1e-12  # rank 9 of 10: half way through (30, 50] ms
    assert histogram_quantiles(before["prefill"], after["prefill"], STEP_HISTOGRAMS[0][0], (50,))[50] == \
        0.1 + 0.15 * 0.5  # the one prefill step, in (0.1, 0.25]
