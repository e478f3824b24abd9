"""The start-up warm-up (engine/core/warmup.py): it meets every size class, leaves nothing behind, and changes
no answer."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import pytest
import torch

from engine import SamplingParams
from engine.config.arg_utils import EngineArgs
from engine.core.request import Request
from engine.core.warmup import size_classes, warm_up, warmup_shapes
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.core_factory import make_engine_core

ARGS = dict(kv_cache_dtype="fp8_ds_mla", num_blocks=256, device="cpu", hisparse={"host_pool_blocks": 48},
            num_speculative_tokens=3, max_num_batched_tokens=80, max_num_seqs=9)


def _ints(n: int) -> str:
    return "1" if n == 1 else "D" if n % 16 == 0 else ""


def test_size_classes_meet_each_integer_class_in_each_power_of_two_bucket():
    for limit in (1, 9, 16, 80, 8192):
        sizes = size_classes(limit)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and max(sizes) <= limit
        buckets = {}
        for n in range(1, limit + 1):  # the (class, power-of-two bucket) pairs of every size up to the limit
            buckets.setdefault((_ints(n), (n - 1).bit_length()), n)
        met = {(_ints(n), (n - 1).bit_length()) for n in sizes}
        assert met == set(buckets), (limit, set(buckets) - met)
    assert size_classes(80) == [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 79, 80]


def _core(tiny_code, **extra):
    return make_engine_core(EngineArgs(model=str(tiny_code), **{**ARGS, **extra}).create_engine_config())


def _greedy(core, prompt, n=8):
    core.add_request(Request("probe", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    out = []
    while core.has_unfinished():
        out += [o for o in core.step() if o.req_id == "probe"]
    return [t for o in out for t in o.new_token_ids], out[-1].num_cached_tokens if out else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_warm_up_runs_every_shape_and_leaves_nothing_behind(tiny_code, async_scheduling):
    core = _core(tiny_code, async_scheduling=async_scheduling)
    lengths, batches = warmup_shapes(core.cfg)
    assert lengths == size_classes(80) and batches == size_classes(9)
    if async_scheduling:  # the steps in flight are what differs: a few shapes show it
        lengths, batches = size_classes(20), size_classes(3)
    report = warm_up(core, max_tokens=lengths[-1], max_batch=batches[-1], long_context=False)  # long: next test
    assert report.prefill_lengths == lengths and report.decode_batches == batches  # every shape fitted here
    assert report.long_decode_batches == []
    assert report.requests == 2 * len(lengths) + sum(batches) and report.steps > report.requests // 9
    kv = core.kv
    assert kv.num_free_blocks == kv.num_blocks and not core.has_unfinished() and not core.has_finished_to_drop()
    assert core.drain_kv_events() == []  # no router hears of the warm-up's blocks
    hs = core.stats().hisparse
    assert (hs.num_resident, hs.num_mixed, hs.num_host) == (0, 0, 0)
    assert hs.num_free_device_blocks == hs.num_device_blocks

    # the same greedy answer as an engine that never warmed up, and nothing cached from the warm-up's prompts
    prompt = list(range(40, 40 + 70))
    after, cached = _greedy(core, prompt)
    fresh, fresh_cached = _greedy(_core(tiny_code), prompt)
    assert after == fresh and len(after) == 8
    assert cached == fresh_cached == 0


@pytest.mark.timeout(300)
def test_long_context_decodes_pass_the_top_k_and_give_back_their_pages(tiny_code):
    """A decode past the indexer's top-k (2,048 + 33 tokens: the indexer scores and selects at a decode shape), then
    every KV block and HiSparse page back. (tiny-code's contexts, at most 4,096, all fit one hot buffer of
    (1 + 3) x 2,048 rows, so HiSparse never misses here.)"""
    core = _core(tiny_code, max_num_batched_tokens=4096)
    report = warm_up(core, max_tokens=20, max_batch=1)
    assert report.long_decode_batches == [1]
    assert report.requests == 2 * len(report.prefill_lengths) + 1 + 1
    hs = core.stats().hisparse
    assert (hs.num_resident, hs.num_mixed, hs.num_host) == (0, 0, 0)
    assert hs.num_free_device_blocks == hs.num_device_blocks
    assert core.kv.num_free_blocks == core.kv.num_blocks and core.drain_kv_events() == []
    no_long = warm_up(_core(tiny_code, max_model_len=2048 + 33 + 4), max_tokens=20, max_batch=1)
    assert no_long.long_decode_batches == []  # no room past the top-k within max_model_len: none run


def test_a_busy_engine_is_not_warmed_up(tiny_code):
    core = _core(tiny_code)
    core.add_request(Request("r", [20, 21, 22], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="before an engine serves"):
        warm_up(core)


@pytest.mark.timeout(300)
def test_async_engine_warms_up_with_the_flag(tiny_code):
    async def run():
        # contexts of at most 1,024 tokens: no long-context decodes (their own test above)
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), **ARGS, max_model_len=1024, warmup=True))
        st = engine.stats()
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outs = [o async for o in engine.generate(list(range(30, 60)), params)]
        finally:
            await engine.shutdown()
        return st, outs

    st, outs = asyncio.run(run())
    assert st.num_steps > 0 and st.num_running == st.num_waiting == 0  # it ran before the first request
    assert st.num_free_blocks == st.num_blocks
    assert outs and outs[-1].finished


def test_the_flag_reaches_the_engine_config(tiny_code):
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args(["--model", str(tiny_code), "--warmup"])).create_engine_config().warmup
    assert not EngineArgs.from_cli_args(p.parse_args(["--model", str(tiny_code)])).create_engine_config().warmup


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(900)
def test_after_the_warm_up_traffic_compiles_no_kernel_on_cuda(tiny_code, tmp_path, monkeypatch):
    """On a GPU: after the warm-up, a mix of prompt lengths, batch sizes and contexts past the indexer's top-k
    compiles no new Triton variant (a fresh TRITON_CACHE_DIR gets one metadata file per compile), and the answer
    is a cold engine's."""
    from bench.serving.cold_start import compiled_variants  # a bench helper: only this GPU test uses it

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    gpu_args = dict(ARGS, device="cuda", num_blocks=1024, max_num_batched_tokens=512, max_num_seqs=16,
                    hisparse={"host_pool_blocks": 256})
    core = make_engine_core(EngineArgs(model=str(tiny_code), **gpu_args).create_engine_config())
    report = warm_up(core)
    assert report.long_decode_batches[:3] == [1, 2, 3]  # as many as the KV pool holds at once
    before = compiled_variants(tmp_path / "triton")
    for p in (tmp_path / "triton").rglob("*.json"):  # the warm-up's variants: older than traffic's
        os.utime(p, (0, 0))
    rng = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for wave, (n_req, lo, hi) in enumerate([(1, 3, 40), (5, 40, 500), (13, 3, 300), (16, 20, 120), (3, 2100, 2600),
                                            (11, 2100, 2300)]):
        for j in range(n_req):  # arrivals within a wave: prefill chunks mix with decodes
            n = int(torch.randint(lo, hi, (1,), generator=rng))
            prompt = torch.randint(20, 1000, (n,), generator=rng).tolist()
            core.add_request(Request(f"w{wave}-{j}", prompt, params))
            core.step()
        while core.has_unfinished():
            core.step()
    after = compiled_variants(tmp_path / "triton")
    assert after == before, f"compiled under traffic: {dict(after - before)}; new variants: {_new_variants(tmp_path)}"
    prompt = list(range(40, 40 + 70))
    assert _greedy(core, prompt)[0] == _greedy(
        make_engine_core(EngineArgs(model=str(tiny_code), **gpu_args).create_engine_config()), prompt)[0]


def _new_variants(tmp_path) -> list[dict]:
    """What specialised each variant compiled under traffic (its metadata less the binary's parts): which
    constexpr or argument class the warm-up did not meet."""
    drop = ("shared", "target", "hash", "global_scratch_size", "profile_scratch_size", "tmem_size")
    return [{k: v for k, v in json.loads(p.read_text()).items() if k not in drop}
            for p in (tmp_path / "triton").rglob("*.json")
            if not p.name.startswith("__grp__") and p.stat().st_mtime > 0]
