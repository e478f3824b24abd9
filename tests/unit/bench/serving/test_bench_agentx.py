"""End to end against a fake OpenAI-compatible server on loopback: `bench agentx` (given URL and
fresh server per level), `bench compare`, `bench serve`, and the `pdserve` dispatcher."""

from __future__ import annotations

import csv
import json
import sys
import types

import pytest

from bench.serving import agentx, compare, serve
from bench.serving.synth import PromptSynth
from services import cli
from tests.helpers.agent_traces import write_traces
from tests.helpers.fake_openai import FakeOpenAI, RunningFake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def trace_dir(tmp_path):
    """Two small sessions; the second has a subagent. Growing prompts share their prefixes."""
    return write_traces(tmp_path / "traces")


def _argv(url_args, trace_dir, out_dir, *extra):
    return [*url_args, "--traces", str(trace_dir), "--concurrency", "2,4", "--duration", "1.2", "--warmup", "0.3",
            "--think-time-scale", "0.02", "--drain-timeout", "5", "--seed", "7", "--output-dir", str(out_dir),
            "--no-progress", "--label", "fake", *extra]


def test_agentx_writes_json_csv_and_plots(trace_dir, tmp_path):
    fake = FakeOpenAI(vocab_size=1000)
    out_dir = tmp_path / "out"
    with RunningFake(fake) as srv:
        assert cli.main(["bench", "agentx", *_argv(["--url", srv.url], trace_dir, out_dir, "--num-gpus", "2")]) == 0
    result = json.loads((out_dir / "result.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [2, 4] and result["valid"]
    for lv in result["levels"]:
        assert lv["throughput_per_gpu"] > 0 and lv["interactivity"] > 0 and lv["num_gpus"] == 2
        assert lv["throughput_per_gpu"] == pytest.approx(
            (lv["total_input_tokens"] + lv["total_output_tokens"]) / lv["duration"] / 2)
        assert 0.2 < lv["prefix_cache_hit_rate"] < 1.0  # later turns reuse their session's prefix
        assert len(lv["ttft_s"]) == lv["completed"] > 0 and lv["max_context"] == 8192
    rows = list(csv.DictReader((out_dir / "levels.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == [2, 4] and float(rows[0]["throughput_per_gpu"]) > 0
    for png in ("interactivity_vs_throughput.png", "ttft_cdf.png"):
        assert (out_dir / png).read_bytes()[:8] == PNG_MAGIC
    # what the server saw: exact lengths from the traces, max_tokens = out, ids inside the vocabulary
    lengths = {700: 8, 900: 5, 1000: 9, 500: 7, 300: 6, 420: 4, 650: 6}
    assert fake.log and all(lengths[len(e.prompt)] == e.max_tokens for e in fake.log)
    assert all(16 <= t < 1000 for e in fake.log for t in e.prompt)
    firsts = {tuple(e.prompt[:64]) for e in fake.log if len(e.prompt) == 700}
    assert len(firsts) >= 2  # several copies of trace_a, each with its own first block


def test_agentx_overflow_and_chunk_counting(trace_dir, tmp_path):
    fake = FakeOpenAI(usage=False, max_model_len=None)
    with RunningFake(fake) as srv:
        out = agentx.run(agentx.build_parser().parse_args(
            _argv(["--url", srv.url], trace_dir, tmp_path / "o", "--max-context", "800", "--concurrency", "2")))
    lv = out["levels"][0]
    assert lv["num_overflow"] > 0 and not lv["valid"] and "overflow" in lv["invalid_reasons"][0]
    assert all(len(e.prompt) + e.max_tokens <= 800 for e in fake.log)
    assert lv["prefix_cache_hit_rate"] is None  # the server sent no usage
    assert lv["total_output_tokens"] > 0  # counted from streamed chunks instead


def test_fresh_server_per_level(trace_dir, tmp_path, monkeypatch):
    events = []

    class Handle:
        def __init__(self, running):
            self.running, self.url, self.num_gpus = running, running.url, 4

    def up(topology):
        events.append(("up", topology))
        return Handle(RunningFake(FakeOpenAI()).__enter__())

    def down(handle):
        events.append(("down",))
        handle.running.__exit__(None, None, None)

    monkeypatch.setitem(sys.modules, "services.launch.launcher", types.SimpleNamespace(up=up, down=down))
    argv = _argv(["--fresh-server", "topo.yaml"], trace_dir, tmp_path / "f")
    out = agentx.run(agentx.build_parser().parse_args(argv))
    assert events == [("up", "topo.yaml"), ("down",)] * 2
    assert all(lv["num_gpus"] == 4 for lv in out["levels"]) and out["label"] == "fake"


def test_levels_and_seeds_get_disjoint_session_copies():
    args = agentx.build_parser().parse_args(["--seed", "1"])
    offsets = set()
    for seed in (1, 2):
        args.seed = seed
        offsets |= {agentx.level_config(args, level, 4, {}).copy_offset for level in (0, 1)}
    assert len(offsets) == 4 and min(b - a for a, b in zip(sorted(offsets), sorted(offsets)[1:])) >= 1 << 24
    blocks = {PromptSynth("t", off, vocab_size=4096).block(1)[0:8] == PromptSynth("t", 0, vocab_size=4096).block(1)[0:8]
              for off in offsets}
    assert blocks == {False}


def test_compare_reports_ratio_at_equal_throughput(trace_dir, tmp_path):
    base = {"label": "A", "levels": [{"concurrency": c, "throughput_per_gpu": x, "interactivity": y, "valid": True}
                                     for c, x, y in [(8, 100.0, 50.0), (16, 200.0, 40.0), (32, 300.0, 20.0)]]}
    other = json.loads(json.dumps(base))
    other["label"] = "B"
    for lv in other["levels"]:
        lv["throughput_per_gpu"] *= 1.5  # B's curve: 150 -> 50, 300 -> 40, 450 -> 20
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps(other))
    plot = tmp_path / "cmp.png"
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output", str(plot)]) == 0
    assert plot.read_bytes()[:8] == PNG_MAGIC
    points = json.loads(plot.with_suffix(".json").read_text())["comparisons"][0]["points"]
    # baseline x = 100 lies outside B's range [150, 450]; at 200: B = 50 + (40-50)·(50/150), A = 40
    assert [p["throughput_per_gpu"] for p in points] == [200.0, 300.0]
    assert points[0]["ratio"] == pytest.approx((50 - 10 / 3) / 40) and points[1]["ratio"] == pytest.approx(2.0)


def test_bench_serve(tmp_path):
    fake = FakeOpenAI(vocab_size=500)
    result_file = tmp_path / "serve.json"
    with RunningFake(fake) as srv:
        rc = serve.main(["--url", srv.url, "--num-prompts", "12", "--input-len", "100", "--output-len", "6",
                         "--max-concurrency", "3", "--goodput", "ttft:60000", "--result-file", str(result_file),
                         "--no-progress"])
    assert rc == 0
    out = json.loads(result_file.read_text())
    assert out["completed"] == 12 and out["total_output_tokens"] == 72 and out["total_input_tokens"] == 1200
    assert out["request_goodput"] == pytest.approx(out["request_throughput"])
    assert {"mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms"} <= set(out)
    assert fake.max_in_flight <= 3 and all(len(e.prompt) == 100 for e in fake.log)
    assert len({tuple(e.prompt[:64]) for e in fake.log}) == 12  # random prompts share nothing


def test_cli_missing_module_is_a_clear_error(monkeypatch):
    for name in ("services.launch.commands", "services.launch.launcher"):  # importing them fails (cached or not)
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit, match="not available"):
        cli.main(["up", "topo.yaml"])
    with pytest.raises(SystemExit):
        cli.main(["bench"])  # a group needs a subcommand


def test_a_fresh_servers_levels_record_the_mtp_acceptance_and_the_services_figures(trace_dir, tmp_path, monkeypatch):
    """With the deployment's Redis on the handle, each level reads the decode engines' MTP counters before and
    after its replay and records the acceptance between them (the simulator's input in bench.simulate.fidelity),
    and the services' own figures between two reads of their metrics (where the TTFT went)."""
    from bench.serving.engine_counters import MTP_COUNTERS

    class Handle:
        def __init__(self, running):
            self.running, self.url, self.redis_url = running, running.url, "redis://x"

    def down(handle):
        handle.running.__exit__(None, None, None)

    reads = iter([(0, 0), (40, 100), (0, 0), (10, 20)])  # (rounds, tokens): two levels, before and after each

    def counters(redis_url, names):
        assert redis_url == "redis://x" and names == MTP_COUNTERS
        r, t = next(reads)
        return {"decode": {MTP_COUNTERS[0]: float(r), MTP_COUNTERS[1]: float(t)}, "prefill": {}}

    monkeypatch.setitem(sys.modules, "services.launch.launcher", types.SimpleNamespace(
        up=lambda topology: Handle(RunningFake(FakeOpenAI()).__enter__()), down=down))
    monkeypatch.setattr(agentx, "engine_counters", counters)
    # the services' own TTFT histograms and step counters: before and after each level
    scrapes = iter([(0, 0.0), (10, 0.3), (10, 0.3), (30, 0.7)])

    def services(redis_url, router_url):
        assert redis_url == "redis://x" and router_url.startswith("http://")
        n, s = next(scrapes)
        ttft = {"pdserve:time_to_first_token_seconds_count": n, "pdserve:time_to_first_token_seconds_sum": s}
        # two engine steps a request: its prefill, and one that only hands it (finished) to the runner
        return {"prefill": {**ttft, "pdserve:engine_steps_total": 2 * n, "pdserve:engine_step_seconds_total": s / 2},
                "router": {"pdserve:time_to_first_token_seconds_count": n,
                           "pdserve:time_to_first_token_seconds_sum": s * 1.5}}

    monkeypatch.setattr(agentx, "scrape_services", services)
    out = agentx.run(agentx.build_parser().parse_args(_argv(["--fresh-server", "t.yaml"], trace_dir, tmp_path / "f")))
    assert [lv["decode_mtp"]["acceptance_length"] for lv in out["levels"]] == [2.5, 2.0]
    assert out["levels"][0]["decode_mtp"]["full_rounds"] == 40
    first, second = (lv["server"] for lv in out["levels"])
    assert first["prefill_mean_ttft_ms"] == pytest.approx(30.0)
    assert second["prefill_mean_ttft_ms"] == pytest.approx(20.0)
    assert first["router_mean_ttft_ms"] == pytest.approx(45.0) and second["prefill_mean_step_ms"] == pytest.approx(5.0)
    assert second["prefill_requests"] == 20 and second["prefill_step_ms_per_request"] == pytest.approx(10.0)
