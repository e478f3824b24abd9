"""`python -m bench.simulate.step_gap`: a lone prompt's prefill step on the topology's prefill engine, alone, after
idle, through the engine thread, with a polling event loop, beside the started topology, and as a request through
it, each the engine's own step seconds over the probe."""

from __future__ import annotations

import json

import yaml

from bench.simulate import step_gap
from tests.helpers import ROOT, system

CPU_TOPOLOGY = "configs/topology.cpu.yaml"


def test_every_mode_times_each_probe_by_the_cores_own_step_seconds(tmp_path):
    out = tmp_path / "gap.json"
    in_process = [m for m in step_gap.MODES if m not in step_gap.SERVICE_MODES]
    assert step_gap.main(["--config", CPU_TOPOLOGY, "--out", str(out), "--prompt-len", "24", "--probes", "2",
                          "--gap-s", "0.01", "--poll-s", "0.001", "--modes", ",".join(in_process)]) == 0
    got = json.loads(out.read_text())
    assert list(got["modes"]) == in_process and got["prompt_len"] == 24
    for mode in got["modes"].values():
        steps = mode["steps_ms"]
        assert len(steps) == 2 and steps == sorted(steps) and all(0 < s < 10_000 for s in steps)
        assert mode["min_ms"] <= mode["median_ms"] <= mode["max_ms"]


def test_bad_flags_are_refused_with_a_reason(tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert step_gap.main(["--config", CPU_TOPOLOGY, "--out", str(out), "--probes", "0"]) == 2
    assert "--probes must be at least 1" in capsys.readouterr().err
    assert step_gap.main(["--config", CPU_TOPOLOGY, "--out", str(out), "--probes", "1", "--prompt-len", "8",
                          "--modes", "back_to_back,sideways"]) == 2
    assert "unknown mode 'sideways'" in capsys.readouterr().err and not out.exists()


def test_the_service_modes_time_the_probe_beside_and_through_the_running_topology(tmp_path):
    """The topology started once: the engine alone beside it, then requests through its router, each timed by the
    prefill service's own step counters and split by phase (the phases add up to the step)."""
    topo = system.topology(tmp_path / "run")  # free ports and a Redis of its own, beside other tests
    topo["model"] = str(ROOT / "checkpoints" / "tiny-code")
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(topo))
    out = tmp_path / "gap.json"
    assert step_gap.main(["--config", str(config), "--out", str(out), "--prompt-len", "24", "--probes", "2",
                          "--gap-s", "0.01", "--modes", "beside_services,served"]) == 0
    got = json.loads(out.read_text())["modes"]
    assert list(got) == ["beside_services", "served"]
    for mode in got.values():
        assert len(mode["steps_ms"]) == 2 and all(0 < s < 10_000 for s in mode["steps_ms"])
    phases = got["served"]["phases_ms"]
    assert set(phases) == {"schedule", "launch", "device_wait", "read_back", "update"}
    assert phases["launch"] > 0 and sum(phases.values()) <= got["served"]["max_ms"] * 1.01
