"""`pdserve bench restart`'s pure parts: the growing sessions and their reference, the check of each stream
against it, throughput per second and its dips, TTFT inside and outside restarts, the router's migration lines
and the stall a migration adds, the topology it starts, the log lines it quotes, the result of a synthetic run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.serving import restart_report as report
from bench.serving.restart import RestartConfig, _session_turn, topology
from bench.serving.restart_control import lines_between
from bench.serving.restart_figures import Schedule, figures
from bench.serving.restart_workload import Stream, Turn, Workload, build_sessions
from services.launch.topology import ROOT
from services.router.extra_api import new_api_request_id


def _fake_generate(calls: list):
    """A deterministic stand-in for the offline engine: answer = the prompt's last ids + 1, max_tokens of them."""
    def generate(prompts, max_tokens):
        calls.append(len(prompts))
        out = []
        for p, n in zip(prompts, max_tokens):
            ids = [(p[-1 - i % len(p)] + 1) % 1000 for i in range(n)]
            out.append((ids, " ".join(map(str, ids))))
        return out
    return generate


def test_sessions_grow_by_the_reference_answer_and_a_user_message_each_turn():
    w = Workload(sessions=5, turns=3, min_tokens=4, max_tokens=9, system_len=70, user_len=(8, 12), seed=3)
    calls: list = []
    sessions = build_sessions(w, vocab_size=1000, generate=_fake_generate(calls))
    assert calls == [5, 5, 5]  # one batch per turn index, every session in it
    assert sessions == build_sessions(w, 1000, _fake_generate([]))  # seeded
    assert sessions != build_sessions(Workload(sessions=5, turns=3, seed=4), 1000, _fake_generate([]))
    system = sessions[0][0].prompt[:70]
    for s, turns in enumerate(sessions):
        assert [(t.session, t.turn) for t in turns] == [(s, 0), (s, 1), (s, 2)]
        assert turns[0].prompt[:70] == system and 78 <= len(turns[0].prompt) <= 82
        for a, b in zip(turns, turns[1:]):
            grown = b.prompt[len(a.prompt) + len(a.want_ids):]
            assert b.prompt[:len(a.prompt) + len(a.want_ids)] == a.prompt + a.want_ids and 8 <= len(grown) <= 12
        assert all(4 <= t.max_tokens <= 9 and len(t.want_ids) == t.max_tokens for t in turns)
    assert all(16 <= x < 1000 for x in system)
    with pytest.raises(ValueError):
        Workload(min_tokens=10, max_tokens=5)


def _stream(req_id, ids, text=None, session=0, turn=0, start=0.0, first=None, chunks=(), error=None) -> Stream:
    s = Stream(req_id, session, turn, worker=0, t_start=start, t_first=first if first is not None else start + 0.5,
               t_end=start + 2.0, chunks=list(chunks), token_ids=list(ids), error=error)
    s.text = text if text is not None else " ".join(map(str, ids))
    return s


def test_check_counts_errors_lost_duplicated_and_different_tokens():
    want = [5, 6, 7, 8]
    turns = {(0, 0): Turn(0, 0, [1, 2], 4, want, "5 6 7 8"), (1, 0): Turn(1, 0, [3], 2, [9, 9], "9 9")}
    streams = [_stream("a", want), _stream("b", [9, 9], session=1),
               _stream("c", [5, 6, 7]),  # the last token lost
               _stream("d", [5, 6, 6, 7, 8]),  # one repeated
               _stream("e", [5, 6, 1, 8]),  # same length, one different
               _stream("f", want, text="5 6 7 9"),  # ids right, text wrong
               _stream("g", [5], error="stream error: upstream")]
    c = report.check_streams(streams, turns)
    assert (c["streams"], c["errors"], c["lost_tokens"], c["duplicated_tokens"]) == (7, 1, 1, 1)
    assert c["different_streams"] == 4 and c["text_only_differences"] == 1
    assert [d.get("first_difference") for d in c["differences"]] == [3, 2, 2, None]
    assert c["error_list"] == [{"req_id": "g", "error": "stream error: upstream", "tokens_received": 1}]
    clean = report.check_streams(streams[:2], turns)
    assert clean["errors"] == clean["lost_tokens"] == clean["duplicated_tokens"] == clean["different_streams"] == 0


def test_throughput_per_second_and_the_dip_of_a_restart():
    # 10 tokens/s for 20 s, except nothing from 8 s to 12 s: a service away from 7.5 s to 12.5 s
    chunks = [(100.0 + t + 0.5, 10) for t in range(20) if not 8 <= t < 12]
    bins = report.timeline([_stream("a", [], chunks=chunks)], t0=100.0, t1=120.0)
    assert bins == [0.0 if 8 <= t < 12 else 10.0 for t in range(20)]
    away = report.Restart("kill", "decode-0", t_signal=107.5, t_exited=107.6, exit_code=-9, t_ready=112.5,
                          migrations=3)
    assert report.rate(bins, 100.0, away.window) == 0.0  # whole bins 8..11 only
    assert report.rate(bins, 100.0, (100.0, 108.0)) == 10.0
    assert report.lowest(bins, 100.0, away.window, span=5) == 2.0  # 8..12 s: four silent seconds and one of 10
    assert report.lowest(bins, 100.0, away.window, span=2) == 0.0
    (d,) = report.dips(bins, 100.0, [away], steady_rate=10.0)
    assert d == {"mode": "kill", "service": "decode-0", "away_s": 5.0, "drain_s": 0.1, "exit_code": -9,
                 "tok_s": 0.0, "lowest_5s_tok_s": 2.0, "of_steady": 0.0, "migrations": 3}


def test_ttft_of_requests_started_while_a_service_was_away_against_the_steady_windows():
    streams = [_stream(str(i), [1], start=float(i), first=i + (2.0 if 10 <= i < 20 else 0.1)) for i in range(30)]
    streams.append(_stream("x", [1], start=12.0, error="HTTP 503"))  # failed: no TTFT
    restart = report.Restart("term", "prefill-0", t_signal=10.0, t_ready=20.0)
    split = report.ttft_split(streams, [restart], steady=[(0.0, 10.0), (20.0, 30.0)])
    assert split["restarting"]["requests"] == 10 and split["restarting"]["p50_ttft_ms"] == 2000.0
    assert split["steady"]["requests"] == 20 and split["steady"]["p90_ttft_ms"] == 100.0


def test_migrations_are_read_from_the_routers_log_lines():
    # the id the router makes of a client's X-Request-Id, then "-<choice>", as services/router/flow.py logs it
    rid = f"{new_api_request_id('cmpl', 's3t1n42')}-0"
    log = (f"2026-12-05 10:00:00,000 INFO services.router.http_api: {rid[:-2]}: POST /v1/completions\n"
           f"2026-12-05 10:00:01,000 WARNING services.router.flow: {rid}: decode decode-0 failed: StatusCode."
           f"UNAVAILABLE; migrating with 17 tokens streamed (1 of at most 3)\n"
           f"2026-12-05 10:00:02,000 WARNING services.router.flow: prefill prefill-1 unavailable (x); trying another\n")
    why = "decode decode-0 failed: StatusCode.UNAVAILABLE"
    assert report.migrated(log) == {"s3t1n42": [{"streamed": 17, "why": why}]}


def test_a_migration_adds_the_gap_at_the_move_less_the_streams_usual_gap():
    # chunks of 2 tokens every 0.1 s; after token 6 (the third chunk) the stream stalls 1.5 s
    times = [0.0, 0.1, 0.2, 1.7, 1.8, 1.9]
    s = _stream("m", [1] * 12, chunks=[(t, 2) for t in times])
    assert report.migration_delay(s, 6) == pytest.approx(1.4)
    assert report.migration_delay(s, 5) is None  # no chunk ends there
    r = report.migration_report([s], {"m": [{"streamed": 6, "why": ""}], "gone": [{"streamed": 1, "why": ""}]})
    assert r["migrated_requests"] == 2 and r["added_ms"]["measured"] == 1
    assert r["added_ms"]["p50"] == pytest.approx(1400.0)


def test_the_summary_table_reads_every_mode_and_restart():
    streams = [_stream("a", [1], start=0.0)]
    turns = {(0, 0): Turn(0, 0, [1], 1, [1], "1")}
    r = report.Restart("term", "decode-1", 0.0, 1.0, 0, 2.0, 1.0)
    result = {"steady_tok_s": 10.0, "restarts": report.dips([10.0, 10.0], 0.0, [r], 10.0), "failure": "",
              "check": report.check_streams(streams, turns),
              "migrated": report.migration_report(streams, {}),
              "modes": {"term": {"check": report.check_streams(streams, turns), "migrations": 1.0, "tok_s_away": 9.5,
                                 "ttft": report.ttft_split(streams, [r], [(5.0, 6.0)])}}}
    text = report.format_summary(result)
    assert "term" in text and "decode-1" in text and "9.5 /   10.0" in text and "1 requests: 0 errors" in text


def test_topology_has_two_of_each_engine_on_free_ports_with_a_private_redis(tmp_path: Path):
    topo = topology(str(ROOT / "configs" / "topology.cpu.yaml"), tmp_path, RestartConfig(shutdown_timeout_s=90))
    assert topo["run_dir"] == str(tmp_path) and not topo["redis_url"].endswith(":6379/0")
    for kind, spec in topo["services"].items():
        assert spec["port"] == spec["metrics_port"] == 0
        assert spec.get("replicas", 1) == (2 if kind in ("prefill", "decode") else 1)
        assert (spec.get("args") or {}).get("shutdown-timeout") == (None if kind == "router" else 90)
    with pytest.raises(ValueError):
        RestartConfig(modes=("term", "stop"))


def test_log_lines_of_a_time_span_keep_their_tracebacks():
    def stamp(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + ",000"

    t = 1_800_000_000.0
    failed = [f"{stamp(t + 5)} ERROR a: failed", "Traceback (most recent call last):", '  File "x.py"']
    log = "\n".join([f"{stamp(t)} INFO a: before", *failed, f"{stamp(t + 20)} INFO a: after"])
    assert lines_between(log, t + 4, t + 6) == failed
    assert lines_between(log, t + 30, t + 40) == []


def test_the_result_splits_a_run_by_mode_and_quotes_the_logs_around_an_incident():
    t0, wall = 1000.0, time.time() - time.perf_counter()
    turns = {(0, 0): Turn(0, 0, [1], 4, [5, 6, 7, 8], "5 6 7 8")}
    term = report.Restart("term", "decode-0", t_signal=t0 + 10, t_exited=t0 + 12, exit_code=0, t_ready=t0 + 20)
    kill = report.Restart("kill", "decode-0", t_signal=t0 + 40, t_exited=t0 + 40.5, exit_code=-9, t_ready=t0 + 50,
                          migrations=1)
    sched = Schedule(t0, steady=[(t0, t0 + 10), (t0 + 25, t0 + 40), (t0 + 55, t0 + 60)], restarts=[term, kill],
                     t_stop=t0 + 60)
    chunks = [(t0 + 41.0, 2), (t0 + 41.1, 2)]
    streams = [_stream("s0t0n1", [5, 6, 7, 8], start=t0 + 1, chunks=[(t0 + 1.5, 4)]),
               _stream("s0t0n2", [5, 6, 7, 8], start=t0 + 12),
               _stream("s0t0n3", [5, 6, 9, 8], start=t0 + 40, chunks=chunks)]
    # a log stamp has whole seconds: one second after the kill's signal, it falls between the signal and 41 s
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0 + 41.0 + wall)) + ",000"
    logs = {"router": f"{stamp} WARNING flow: cmpl-s0t0n3-0123abcd-0: decode gone; migrating with 2 tokens streamed\n"
                      f"{stamp} WARNING flow: prefill prefill-1 unavailable (Socket closed); trying another\n",
            "decode-0": f"{stamp} INFO decode: started\n"}
    out = figures(streams, turns, sched, logs, ("term", "kill"), settle_s=2.0)
    assert out["check"]["streams"] == 3 and out["check"]["different_streams"] == 1
    assert out["modes"]["term"]["check"]["different_streams"] == 0 and out["modes"]["term"]["check"]["streams"] == 1
    assert out["modes"]["kill"]["check"]["different_streams"] == 1 and out["modes"]["kill"]["migrations"] == 1
    assert out["migrated"]["migrated_requests"] == 1 and out["restarts"][1]["exit_code"] == -9
    (incident,) = out["incidents"]
    assert incident["req_id"] == "s0t0n3" and incident["restarts"] == ["kill decode-0"]
    assert incident["router_lines"] == logs["router"].splitlines()[:1]
    assert [r["prefill_retries"] for r in out["restarts"]] == [0, 1]
    assert incident["service_lines"] == {"decode-0": logs["decode-0"].splitlines()}
    assert incident["without_a_restart"] == 1 and incident["same_ids_without_a_restart"] == 0
    assert out["per_request"]["rows"][2][6] is False and out["per_request"]["rows"][0][6] is True
    text = report.format_summary({**out, "diagnosis": [
        {"prompt": "s0t0", "position": 2, "served_token": 9, "reference_token": 7,
         "offline_logits": {"9": 11.682, "7": 11.683}, "replayed_error": None, "replayed_equals_served": True,
         "replayed_equals_reference": False}]})
    assert "s0t0 differs at token 2: served 9, reference 7; offline logits 11.682 vs 11.683" in text
    assert "served again undisturbed: the disturbed stream's ids" in text
    assert _session_turn("s12t3n456") == (12, 3)
