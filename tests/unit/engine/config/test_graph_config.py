"""Capture sizes (vLLM's convention), the --enforce-eager / --cuda-graph-sizes flags, when the static
decode path is on, and --async-scheduling."""

from __future__ import annotations

import argparse

import pytest

from engine.config.arg_utils import EngineArgs
from engine.config.engine import GraphConfig


def test_default_capture_sizes_follow_vllm():
    sizes = GraphConfig().capture_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert GraphConfig().capture_sizes(8) == [1, 2, 4, 8]
    assert GraphConfig().capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest batch always has a bucket
    assert GraphConfig().capture_sizes(1) == [1]
    assert GraphConfig().capture_sizes(3) == [1, 2, 3]


def test_cuda_graph_sizes_override():
    g = GraphConfig(cuda_graph_sizes=(8, 2, 2, 1))
    assert g.cuda_graph_sizes == (1, 2, 8)
    assert g.capture_sizes(256) == [1, 2, 8]
    assert g.capture_sizes(4) == [1, 2]
    for bad in ((), (0,), (2, -1)):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            GraphConfig(cuda_graph_sizes=bad)


def test_when_the_static_path_runs():
    assert not GraphConfig().use_static_path("cpu") and GraphConfig().use_static_path("cuda")
    assert GraphConfig().use_static_path("cuda:1")
    assert GraphConfig(enforce_eager=False).use_static_path("cpu")
    assert not GraphConfig(enforce_eager=True).use_static_path("cuda")


def test_cli_flags(tiny_code):
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--model", str(tiny_code), "--enforce-eager", "--cuda-graph-sizes", "4", "1", "2"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.graphs.enforce_eager is True and cfg.graphs.cuda_graph_sizes == (1, 2, 4)
    cfg = EngineArgs.from_cli_args(p.parse_args(["--model", str(tiny_code)])).create_engine_config()
    assert cfg.graphs.enforce_eager is None and cfg.graphs.cuda_graph_sizes is None


def test_graphs_by_default_on_cuda_only(tiny_code):
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    cfg = EngineArgs.from_cli_args(p.parse_args(["--model", str(tiny_code), "--cuda-graphs"])).create_engine_config()
    assert cfg.graphs.enforce_eager is False and cfg.graphs.use_static_path("cpu")
    cfg = EngineArgs.from_cli_args(p.parse_args(["--model", str(tiny_code)])).create_engine_config()
    assert cfg.graphs.use_static_path("cuda") and not cfg.graphs.use_static_path("cpu")


def test_async_scheduling_flag(tiny_code):
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--model", str(tiny_code), "--async-scheduling"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.scheduler.async_scheduling is True
    assert EngineArgs(model=str(tiny_code)).create_engine_config().scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling runs single-rank engines"):
        EngineArgs(model=str(tiny_code), async_scheduling=True, prefill_context_parallel_size=2,
                   decode_context_parallel_size=2).create_engine_config()
    dp = EngineArgs(model=str(tiny_code), async_scheduling=True, data_parallel_size=2).create_engine_config()
    assert dp.scheduler.async_scheduling  # a DP group schedules ahead too (engine/parallel/dp.py)
