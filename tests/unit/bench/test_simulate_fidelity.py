"""bench.simulate.fidelity: a measured agentx run set beside the simulation of the same run."""

from __future__ import annotations

import json

import pytest

from bench.simulate import cli, fidelity
from tests.helpers import ROOT
from tests.helpers.agent_traces import write_traces
from tests.unit.bench.test_simulate import CPU_TOPOLOGY, _argv, _profile


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """(profile, result.json) of one simulated run, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("fidelity")
    prof = _profile(tmp)
    assert cli.main(_argv(write_traces(tmp / "traces", out_scale=4), prof, tmp / "sim")) == 0
    return prof, tmp / "sim" / "result.json"


def _as_measured(sim: dict, scale: dict[str, float]) -> dict:
    """A simulated result dressed as `bench agentx --fresh-server`'s, each named figure multiplied by `scale`."""
    real = json.loads(json.dumps(sim))
    real.pop("simulated")
    real["config"]["fresh_server"] = real["config"].pop("config")[0]
    for lv in real["levels"]:
        lv.pop("sim")
        for k, f in scale.items():
            lv[k] *= f
    return real


def _compared(real: dict, prof, tmp_path) -> list[dict]:
    """`fidelity` of a dressed measured run against the profile: the comparison's rows."""
    real_path, out = tmp_path / "real.json", tmp_path / "cmp.json"
    real_path.write_text(json.dumps(real))
    assert fidelity.main(["--real", str(real_path), "--profile", str(prof), "--out", str(out)]) == 0
    return json.loads(out.read_text())["levels"]


def test_the_comparison_replays_the_measured_runs_flags_and_bounds_each_figure(simulated, tmp_path):
    prof, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    real_path = tmp_path / "real.json"
    real_path.write_text(json.dumps(_as_measured(sim, {"p90_ttft_ms": 1.3, "throughput_per_gpu": 0.9})))

    out = tmp_path / "cmp.json"
    assert fidelity.main(["--real", str(real_path), "--profile", str(prof), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    argv = got["simulate_argv"]
    for flag, value in (("--config", CPU_TOPOLOGY), ("--seed", "3"), ("--duration", "150.0"), ("--warmup", "20.0"),
                        ("--think-time-scale", "0.5"), ("--concurrency", "2,6")):
        assert argv[argv.index(flag) + 1] == value
    assert [row["concurrency"] for row in got["levels"]] == [2, 6]
    for row in got["levels"]:
        f = row["figures"]
        # the same inputs and seed: the simulation repeats itself, so only the perturbed figures differ
        assert f["p50_ttft_ms"]["ratio"] == pytest.approx(1.0) and f["p50_ttft_ms"]["within"]
        assert f["p90_ttft_ms"]["ratio"] == pytest.approx(1 / 1.3) and not f["p90_ttft_ms"]["within"]
        assert f["throughput_per_gpu"]["ratio"] == pytest.approx(1 / 0.9) and f["throughput_per_gpu"]["within"]
        assert (row["within"], row["of"]) == (4, 5)


def test_a_simulated_run_or_missing_traces_is_refused(simulated, tmp_path, capsys):
    prof, sim_path = simulated
    assert fidelity.main(["--real", str(sim_path), "--profile", str(prof)]) == 2
    assert "is a simulated run" in capsys.readouterr().err
    real = _as_measured(json.loads(sim_path.read_text()), {})
    real["config"]["traces"] = str(tmp_path / "gone")
    (tmp_path / "real.json").write_text(json.dumps(real))
    assert fidelity.main(["--real", str(tmp_path / "real.json"), "--profile", str(prof)]) == 2
    assert "not found" in capsys.readouterr().err


def test_the_measured_runs_mtp_acceptance_is_the_simulations(simulated, tmp_path):
    """A run that recorded its decode's acceptance (`decode_mtp`, per level) is simulated with that acceptance,
    weighted by each level's rounds; the simulated decode then emits that many tokens per round."""
    prof, sim_path = simulated
    real = _as_measured(json.loads(sim_path.read_text()), {})
    real["levels"][0]["decode_mtp"] = {"full_rounds": 100.0, "tokens": 300.0, "acceptance_length": 3.0}
    real["levels"][1]["decode_mtp"] = {"full_rounds": 300.0, "tokens": 1000.0, "acceptance_length": 10 / 3}
    real_path = tmp_path / "real.json"
    real_path.write_text(json.dumps(real))
    assert fidelity.measured_acceptance(real) == pytest.approx(1300 / 400)
    out = tmp_path / "cmp.json"
    assert fidelity.main(["--real", str(real_path), "--profile", str(prof), "--out", str(out),
                          "--sim-output-dir", str(tmp_path / "sim")]) == 0
    got = json.loads(out.read_text())
    argv = got["simulate_argv"]
    assert argv[argv.index("--set") + 1] == "services.decode.args.speculative-config.synthetic_acceptance_length=3.2500"
    assert got["mtp_acceptance"]["measured_run"] == pytest.approx(3.25)
    # more tokens per decode step than the run simulated with the profile's acceptance
    base = json.loads(sim_path.read_text())["levels"][-1]
    assert got["simulated"]["levels"][-1]["p50_tpot_ms"] < base["p50_tpot_ms"]
    assert fidelity.measured_acceptance(_as_measured(json.loads(sim_path.read_text()), {})) is None


def test_where_the_mean_ttft_went_is_set_beside_the_simulations_phases(simulated, tmp_path, capsys):
    """With the services' figures a measured level recorded (`server`), the comparison splits the mean TTFT: before
    the prefill service (the client's mean less the prefill service's) against the simulated service overhead and
    kvstore load, the prefill service's own against the simulated queue and steps; without them, no split."""
    prof, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    real = _as_measured(sim, {})
    for lv in real["levels"]:
        lv["server"] = {"prefill_mean_ttft_ms": lv["mean_ttft_ms"] - 9.0, "prefill_mean_step_ms": 20.0,
                        "prefill_step_ms_per_request": 40.0,
                        "router_mean_ttft_ms": lv["mean_ttft_ms"] - 2.0}
    rows = _compared(real, prof, tmp_path)
    assert "mean TTFT ms, real / sim: before prefill 9.0 / 3.0" in capsys.readouterr().out
    for row, lv in zip(rows, sim["levels"]):
        split, phases = row["ttft_split"], lv["sim"]["time_by_phase_s"]
        assert split["before_prefill"] == {"real": pytest.approx(9.0), "sim": pytest.approx(3.0)}  # 3 ms overhead
        assert split["prefill_service"]["sim"] == pytest.approx(
            1e3 * (phases["prefill_queue"]["mean"] + phases["prefill"]["mean"]))
        per_request = split["prefill_steps_per_request"]
        assert per_request["real"] == 40.0  # not the mean step: the engine counts steps that compute nothing
        assert per_request["sim"] == pytest.approx(1e3 * lv["sim"]["prefill_busy_s"] / lv["sim"]["prefill_requests"])
        assert 0 < per_request["sim"] < 1e3 * lv["sim"]["prefill_busy_s"]
    assert all(r["ttft_split"] is None for r in fidelity.compare_levels(_as_measured(sim, {})["levels"],
                                                                        sim["levels"], 0.15))


def test_the_tpot_is_split_into_the_handoff_and_the_decodes_own_gaps(simulated, tmp_path, capsys):
    """Both runs record each request's first gap after the first token (the KV handoff and the decode's first step)
    apart from the decode's later gaps; the comparison sets them side by side, and leaves them out for a measured
    run that predates them."""
    prof, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    for lv in sim["levels"]:
        assert 0 < lv["p50_handoff_ms"] <= lv["p90_handoff_ms"] and 0 < lv["p50_decode_itl_ms"]
    rows = _compared(_as_measured(sim, {"p90_handoff_ms": 2.0}), prof, tmp_path)
    assert "TPOT's parts ms, real / sim: p50 handoff" in capsys.readouterr().out
    for row, lv in zip(rows, sim["levels"]):
        split = row["tpot_split"]
        assert split["p90_handoff"] == {"real": pytest.approx(2 * lv["p90_handoff_ms"]), "sim": lv["p90_handoff_ms"]}
        assert split["p50_decode_itl"]["real"] == pytest.approx(split["p50_decode_itl"]["sim"])
    old = _as_measured(sim, {})
    for lv in old["levels"]:
        for k in fidelity.TPOT_PARTS:
            lv.pop(k)
    assert all(r["tpot_split"] is None for r in fidelity.compare_levels(old["levels"], sim["levels"], 0.15))


def test_several_measured_runs_of_one_command_are_compared_by_their_median(simulated, tmp_path, capsys):
    """--real with several runs: each figure against their median, with the runs' own spread beside it; runs of
    different commands are refused."""
    prof, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    paths = []
    for i, f in enumerate((1.0, 1.2, 1.5)):
        paths.append(tmp_path / f"real{i}.json")
        paths[-1].write_text(json.dumps(_as_measured(sim, {"p90_ttft_ms": f})))
    out = tmp_path / "cmp.json"
    assert fidelity.main(["--real", *map(str, paths), "--profile", str(prof), "--out", str(out)]) == 0
    assert "runs' spread" in capsys.readouterr().out
    for row in json.loads(out.read_text())["levels"]:
        p90 = row["figures"]["p90_ttft_ms"]
        assert p90["ratio"] == pytest.approx(1 / 1.2) and p90["spread"] == pytest.approx(1.5)  # median: x1.2
        assert row["figures"]["p50_tpot_ms"]["spread"] == pytest.approx(1.0)
    other = _as_measured(sim, {})
    other["config"]["seed"] = 4
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert fidelity.main(["--real", str(paths[0]), str(tmp_path / "other.json"), "--profile", str(prof)]) == 2
    assert "not of one command (they differ in seed)" in capsys.readouterr().err


def test_the_engines_steps_spread_is_set_beside_the_simulated_steps(simulated, tmp_path, capsys):
    """The simulation keeps each engine's forward steps in the measured window (`sim.step_ms`: p50 <= p90 <= p99);
    the comparison sets them beside the services' step histograms a measured level recorded (`server`)."""
    prof, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    for lv in sim["levels"]:
        for role in ("prefill", "decode"):
            q = lv["sim"]["step_ms"][role]
            assert 0 < q["p50"] <= q["p90"] <= q["p99"]
    real = _as_measured(sim, {})
    for lv in real["levels"]:
        lv["server"] = {"decode_step_p50_ms": 3.0, "decode_step_p90_ms": 21.0, "prefill_step_p50_ms": None}
    rows = _compared(real, prof, tmp_path)
    assert "engine steps ms, real / sim: prefill p50 - / " in capsys.readouterr().out
    for row, lv in zip(rows, sim["levels"]):
        steps = row["steps"]
        assert steps["decode_p90"] == {"real": 21.0, "sim": lv["sim"]["step_ms"]["decode"]["p90"]}
        assert steps["prefill_p50"]["real"] is None
    assert all(r["steps"] is None for r in fidelity.compare_levels(_as_measured(sim, {})["levels"], sim["levels"],
                                                                   0.15))


def test_throughput_per_gpu_is_compared_over_the_measured_runs_gpu_count(simulated):
    """A measured run counts the GPUs its `--num-gpus` says; the simulation those its topology places the engines
    on (two CPU engines: 2). The simulated total is set over the measured run's count, and the table says so."""
    _, sim_path = simulated
    sim = json.loads(sim_path.read_text())
    real = _as_measured(sim, {})
    for lv in real["levels"]:
        lv["throughput_per_gpu"] *= lv["num_gpus"]  # the same tokens over one GPU
        lv["num_gpus"] = 1
    rows = fidelity.compare_levels(real["levels"], sim["levels"], 0.15)
    for row, lv in zip(rows, sim["levels"]):
        f = row["figures"]["throughput_per_gpu"]
        assert lv["num_gpus"] == 2 and f["gpus"] == {"real": 1, "sim": 2}
        assert f["ratio"] == pytest.approx(1.0) and f["sim"] == pytest.approx(2 * lv["throughput_per_gpu"])
    assert "over the measured run's 1 GPU(s)" in fidelity.table(rows, 0.15)
    same = fidelity.compare_levels(_as_measured(sim, {})["levels"], sim["levels"], 0.15)
    assert all("gpus" not in row["figures"]["throughput_per_gpu"] for row in same)
    assert "GPU(s)" not in fidelity.table(same, 0.15)


@pytest.mark.parametrize("pair, profile", [("cpu-synthetic-2026-12-07-draft-passes", "profile.json"),
                                           ("cpu-synthetic-2026-12-07-draft-passes", "profile-served-single.json"),
                                           ("cpu-synthetic-2026-12-08-lone-step", "profile.json")])
def test_a_recorded_cpu_run_is_simulated_within_the_cpu_bound(tmp_path, pair, profile):
    """The CPU comparison, in CI: a measured `bench agentx --fresh-server configs/topology.cpu.yaml` run (c = 1, 2,
    45 s a level, the tests' synthetic traces) and the profile `bench calibrate --through-services` measured on the
    same machine just before it (bench/data/simulate/cpu-synthetic-2026-12-07-draft-passes/), simulated here with
    the shipped defaults: every figure within 25% of the measured one. The measured side is recorded, not measured
    again (a calibration and a run on this machine take minutes, and hold only for that machine's speed). The
    2026-12-07 pair with both served decode fits: as calibrated (the draft passes' cost the engine alone's) and as
    `bench calibrate` fits it now, with the lone request's served step (`profile-served-single.json`,
    refit_served_single.py); and a 2026-12-08 pair calibrated by today's `bench calibrate` itself."""
    data = ROOT / "bench" / "data" / "simulate" / pair
    out = tmp_path / "cmp.json"
    assert fidelity.main(["--real", str(data / "real.json"), "--profile", str(data / profile),
                          "--traces", str(write_traces(tmp_path / "traces", out_scale=4)),
                          "--config", CPU_TOPOLOGY, "--bound", "0.25", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["levels"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    missed = {(r["concurrency"], k): f["ratio"] for r in rows for k, f in r["figures"].items() if not f["within"]}
    assert not missed, missed
