"""`python -m bench.simulate.step_gap`: a lone prompt's prefill step on the topology's prefill engine, alone, after
idle, through the engine thread and with a polling event loop, each the core's own step seconds over the probe."""

from __future__ import annotations

import json

from bench.simulate import step_gap

CPU_TOPOLOGY = "configs/topology.cpu.yaml"


def test_every_mode_times_each_probe_by_the_cores_own_step_seconds(tmp_path):
    out = tmp_path / "gap.json"
    assert step_gap.main(["--config", CPU_TOPOLOGY, "--out", str(out), "--prompt-len", "24", "--probes", "2",
                          "--gap-s", "0.01", "--poll-s", "0.001"]) == 0
    got = json.loads(out.read_text())
    assert list(got["modes"]) == list(step_gap.MODES) and got["prompt_len"] == 24
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
