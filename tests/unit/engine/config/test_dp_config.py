"""DP x EP flags: `--data-parallel-size D --enable-expert-parallel` -> the config of a D-rank group; the
combinations refused with a reason, and those allowed (replicated experts, HiSparse per DP rank)."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.config.arg_utils import EngineArgs
from engine.config.presets import preset_dict


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny")))  # 8 routed experts
    return str(tmp_path)


def _cfg(argv: list[str]):
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    return EngineArgs.from_cli_args(ns).create_engine_config()


def test_flags_make_a_dp_ep_group(tiny):
    pc = _cfg(["--model", tiny, "--device", "cpu", "--data-parallel-size", "4", "--enable-expert-parallel"]).parallel
    assert (pc.data_parallel_size, pc.enable_expert_parallel, pc.world_size) == (4, True, 4)
    assert _cfg(["--model", tiny, "--device", "cpu"]).parallel.world_size == 1


def test_dp_must_divide_the_routed_experts(tiny):
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) divisible by --data-parallel-size \(3\)"):
        _cfg(["--model", tiny, "--device", "cpu", "--data-parallel-size", "3", "--enable-expert-parallel"])


def test_allowed_combinations(tiny):
    # replicated experts: any D (the engine logs that every rank holds all of them)
    assert _cfg(["--model", tiny, "--device", "cpu", "--data-parallel-size", "3"]).parallel.world_size == 3
    # HiSparse on every DP rank
    cfg = _cfg(["--model", tiny, "--device", "cpu", "--data-parallel-size", "2", "--enable-expert-parallel",
                "--hisparse-config", '{"host_pool_blocks": 8}'])
    assert cfg.hisparse.host_pool_blocks == 8


@pytest.mark.parametrize("argv,match", [
    (["--data-parallel-size", "0"], "data_parallel_size must be >= 1"),
    (["--data-parallel-size", "2", "--prefill-context-parallel-size", "2"], "without the context parallel sizes"),
    (["--prefill-context-parallel-size", "2", "--hisparse-config", "{}"], "single-rank decode engines and DP"),
])
def test_refused_combinations(tiny, argv, match):
    with pytest.raises(ValueError, match=match):
        _cfg(["--model", tiny, "--device", "cpu", *argv])
