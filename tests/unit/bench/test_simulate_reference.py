"""The reference deployment in the simulator: its two host files simulated as one deployment, the sparse
attention term of a step cost, and the shipped H200 profile (bench/simulate/reference_profile.py) rebuilt from
the recorded measurements it names, and agreeing with the steps it was made from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.simulate import cli
from bench.simulate.profile import Profile, ProfileError, selected
from bench.simulate.system import PHASES, services_of
from tests.helpers import ROOT
from tests.helpers.agent_traces import write_traces

HOSTS = ROOT / "configs" / "h200x16"
PREFILL_HOST, DECODE_HOST = str(HOSTS / "prefill-host.yaml"), str(HOSTS / "decode-host.yaml")
H200 = ROOT / "configs" / "profiles" / "h200-glm5.3-fp8.json"


def n_blocks(tokens: int) -> int:
    return tokens // 64  # full blocks of the reference deployment's 64-token blocks


def _chunk(start: int, n: int):
    return SimpleNamespace(start=start, token_ids=[0] * n)


@pytest.mark.parametrize("start,n,k", [(0, 1, 4), (0, 10, 4), (2, 5, 4), (3, 1, 4), (100, 7, 4), (0, 5000, 2048),
                                       (2040, 20, 2048), (0, 0, 8)])
def test_selected_keys_match_the_row_by_row_count(start, n, k):
    assert selected(start, n, k) == sum(min(start + i, k) for i in range(1, n + 1))


def test_the_sparse_attention_term_stops_growing_past_top_k():
    prof = Profile({"version": 1, "engines": {"decode/dp1": {
        "step_s": 0.0, "token_s": 0.0, "token_ctx_s": 0.0, "request_s": 0.0, "token_sel_s": 1.0, "index_topk": 100}}})
    cost = prof.engine("decode/dp1")
    assert cost([_chunk(10, 1)]) == 11 and cost([_chunk(99, 4)]) == 400 and cost([_chunk(10**6, 4)]) == 400
    bad = Profile({"version": 1, "engines": {"decode/dp1": {
        "step_s": 0.0, "token_s": 0.0, "token_ctx_s": 0.0, "request_s": 0.0, "token_sel_s": 1e-6}}})
    with pytest.raises(ProfileError, match="index_topk a positive integer"):
        bad.engine("decode/dp1")


def test_a_deployment_of_one_file_per_host_is_one_system(tmp_path):
    model, _, services, _, _ = services_of([PREFILL_HOST, DECODE_HOST])
    assert model.endswith("GLM-5.3-FP8") and set(services) == {"kvstore", "prefill", "decode"}
    assert services["decode"].extra["data_parallel_size"] == 8
    with pytest.raises(ValueError, match="decode service appears in two topology files"):
        services_of([PREFILL_HOST, DECODE_HOST, str(HOSTS / "decode-host-offload.yaml")])
    with pytest.raises(ValueError, match="has no decode service"):
        services_of([PREFILL_HOST])
    other = tmp_path / "other.yaml"
    other.write_text((HOSTS / "decode-host.yaml").read_text().replace("/models/GLM-5.3-FP8", "/models/other"))
    with pytest.raises(ValueError, match="different models"):
        services_of([PREFILL_HOST, str(other)])


def test_the_reference_deployment_simulates_with_the_shipped_profile(tmp_path):
    traces = write_traces(tmp_path / "traces", out_scale=8)
    out = tmp_path / "out"
    argv = ["--config", PREFILL_HOST, "--config", DECODE_HOST, "--model", "glm-5.3-fp8", "--profile", str(H200),
            "--traces", str(traces), "--concurrency", "4", "--duration", "120", "--warmup", "10", "--seed", "1",
            "--output-dir", str(out)]
    assert cli.main(argv) == 0
    level = json.loads((out / "result.json").read_text())["levels"][0]
    assert level["valid"] and level["completed"] > 5
    assert level["sim"]["steps"]["decode-0-dp7"] >= 0 and len(level["sim"]["steps"]) == 9  # 1 prefill + 8 ranks
    # a decode step of this profile costs ~45 ms or more, and MTP3 emits ~3 tokens a step
    assert 10.0 < level["p50_tpot_ms"] < 45.0


def _same(a, b, where="profile"):
    """Equal JSON, numbers to 1e-9 relative (a least-squares solve may differ in its last bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-15), where
    else:
        assert a == b, where


def test_the_shipped_h200_profile_is_what_its_builder_makes_of_the_recorded_data():
    from bench.simulate import reference_profile

    built, shipped = reference_profile.build(), json.loads(H200.read_text())
    for k in ("commit", "date"):
        built.pop(k), shipped.pop(k)
    _same(json.loads(json.dumps(built)), shipped)  # rebuild: `python -m bench.simulate.reference_profile --out ...`
    # each decode point it was made from is reproduced by its step costs within 10% (a linear model of a step whose
    # expert reads saturate once every local expert is touched, B >= 16: B = 1 comes out 9.5% high)
    prof = Profile.load(H200)
    cost = prof.engine("decode/dp8")
    for p in shipped["engines"]["decode/dp8"]["points"]:
        rows = [_chunk(p["prompt"] + reference_profile.CTX_DURING_STEPS, 1 + reference_profile.MTP_K)] * p["batch"]
        assert cost(rows) == pytest.approx(p["rank_step_s"], rel=0.10), p
    # HiSparse adds its measured extra on top; the prefill of a fresh 128K prompt on PCP8 takes seconds, not minutes
    assert prof.engine("decode/dp8-hisparse")([_chunk(4096, 4)]) > cost([_chunk(4096, 4)])
    pre = prof.engine("prefill/pcp8-dcp8")
    ttft = sum(pre([_chunk(s, 16384)]) for s in range(0, 131072, 16384))
    assert 2.0 < ttft < 15.0


def test_a_prompt_of_several_chunks_gets_its_first_token_after_its_last_chunk(tmp_path):
    """A prefill chunk before the last one emits an output without tokens: the first token (and the KV handoff)
    waits for the last chunk, and the prefill keeps no KV once the decode has it."""
    from bench.serving.client import RequestRecord
    from bench.simulate import clock
    from bench.simulate.system import SimSystem, engine_specs

    prof = Profile.load(H200)

    async def main():
        specs = engine_specs([PREFILL_HOST, DECODE_HOST], prof, "glm-5.3-fp8", tmp_path)
        system = SimSystem(specs, prof, seed=0)
        pre = next(s for s in specs if s.role == "prefill")
        n = 2 * pre.cfg.scheduler.max_num_batched_tokens + 100
        try:
            rec = await system.send(list(range(1, n + 1)), 4, RequestRecord(prompt_len=n, max_tokens=4))
        finally:
            await system.close()
        return rec, n, system.engines[pre.instance_id], system.phases

    rec, n, prefill, phases = clock.run(main())
    cost = prof.engine("prefill/pcp8-dcp8")
    assert prefill.num_steps == 3 and rec.output_tokens == 4 and not prefill.scheduler.held
    assert rec.t_first - rec.t_start >= 3 * cost.step_s + cost.token_s * n
    # where its time went: every phase, adding up to its latency; its prefill is its three steps, unqueued
    (_, p), = phases
    assert set(p) == set(PHASES) and sum(p.values()) == pytest.approx(rec.t_end - rec.t_start)
    assert p["prefill_queue"] == 0 and p["prefill"] >= 3 * cost.step_s and p["kvstore_load"] == 0


def test_a_prompt_no_decode_pool_can_hold_is_refused_and_holds_nothing(tmp_path):
    """Offload-only decode ranks keep a request's whole KV on the device (about 408K tokens per rank here): a
    500K-token prompt is prefilled, then refused by the decode as the router would report it, and the prefill
    keeps none of its KV once the kvstore has read it."""
    import asyncio

    from bench.serving.client import RequestRecord
    from bench.simulate import clock
    from bench.simulate.system import SimSystem, engine_specs

    prof = Profile.load(H200)

    async def main():
        specs = engine_specs([PREFILL_HOST, str(HOSTS / "decode-host-offload.yaml")], prof, "glm-5.3-fp8", tmp_path)
        system = SimSystem(specs, prof, seed=0)
        n = 500_000
        try:
            rec = await system.send(list(range(1, n + 1)), 8, RequestRecord(prompt_len=n, max_tokens=8))
            await asyncio.sleep(60.0)  # the prompt's offload to the kvstore ends (the prefill holds it till then)
        finally:
            await system.close()
        return rec, system

    rec, system = clock.run(main())
    assert rec.error and "INVALID_ARGUMENT" in rec.error and "more KV blocks than the engine has" in rec.error
    assert rec.t_first > rec.t_start and system.refusals == 1
    assert not system.engines["prefill-0"].scheduler.held and system.engines["prefill-0"].kv.usage() == 0
    assert system.stores["kvstore-0"].offloaded_blocks == n_blocks(500_000)


def test_a_prefix_the_prefill_evicted_comes_back_from_the_kvstore(tmp_path):
    """The prefill offloads each prompt's full blocks to the kvstore; once its own cache lost them, the router hints
    the kvstore and the next turn loads the prefix (production BlockPool lease) instead of computing it."""
    import asyncio

    from bench.serving.client import RequestRecord
    from bench.simulate import clock
    from bench.simulate.system import SimSystem, engine_specs

    prof = Profile.load(H200)
    turn1 = list(range(1, 40_001))
    turn2 = turn1 + list(range(50_001, 51_001))

    async def main():
        specs = engine_specs([PREFILL_HOST, DECODE_HOST], prof, "glm-5.3-fp8", tmp_path)
        system = SimSystem(specs, prof, seed=0)
        prefill = system.engines["prefill-0"]
        try:
            first = await system.send(turn1, 4, RequestRecord(prompt_len=len(turn1), max_tokens=4))
            await asyncio.sleep(10.0)  # the offload ends
            assert prefill.kv.pool.reset_prefix_cache()  # the prefill's own copy is gone
            await asyncio.sleep(1.0)  # the router's view of the prefix caches refreshes
            computed = prefill.tokens
            second = await system.send(turn2, 4, RequestRecord(prompt_len=len(turn2), max_tokens=4))
            return first, second, prefill.tokens - computed, system.stores["kvstore-0"]
        finally:
            await system.close()

    first, second, computed, store = clock.run(main())
    assert store.offloaded_blocks >= n_blocks(len(turn1)) and store.loaded_blocks == n_blocks(len(turn1))
    assert computed == len(turn2) - n_blocks(len(turn1)) * 64  # only what the kvstore did not hold
    assert second.ttft_s < first.ttft_s / 4


def test_what_ifs_change_the_topology_before_it_is_simulated(tmp_path):
    """--set: a larger HiSparse host pool per decode rank holds more, a smaller GPU share leaves less device room;
    the topology's own checks still apply; a setting of a service no file has, or a path through a scalar, is
    refused with the reason."""
    from bench.simulate.system import engine_specs

    prof = Profile.load(H200)
    hosts = [PREFILL_HOST, DECODE_HOST]

    def decodes(*settings):
        return [s for s in engine_specs(hosts, prof, "glm-5.3-fp8", tmp_path, list(settings)) if s.role == "decode"]

    base = decodes()
    bigger = decodes("services.decode.args.attention-config.hisparse_config.host_pool_gib=96")
    assert len(base) == 8 and bigger[0].num_blocks == pytest.approx(2 * base[0].num_blocks, rel=0.01)
    smaller = decodes("services.decode.args.gpu-memory-utilization=0.85")
    assert smaller[0].device_room[0] < base[0].device_room[0]
    with pytest.raises(ValueError, match="lists 8 GPUs for 16 processes"):  # a second group needs its GPUs too
        decodes("services.decode.replicas=2")
    with pytest.raises(ValueError, match="no topology file has that service"):
        decodes("services.router2.port=1")
    with pytest.raises(ValueError, match="services.decode.replicas is not a mapping"):
        decodes("services.decode.replicas.x=1")
    with pytest.raises(ValueError, match="expected PATH=VALUE"):
        decodes("services.decode.replicas")


def test_an_engine_host_kv_tier_keeps_evicted_prefixes_and_its_copies_cost_time(tmp_path):
    """--kv-offloading-size in the simulator: the decode ranks of the reference deployment get the tier their
    engines would size (16 GiB of blocks); an engine with one keeps evicted prefix blocks in it (the production
    OffloadTier in its KV manager), loads a later turn's prefix back instead of computing it, and every copy is
    paid in the step that runs it."""
    import asyncio

    from bench.simulate import clock
    from bench.simulate.engines import SimEngine
    from bench.simulate.system import engine_specs
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.kv.offload import OffloadTier

    prof = Profile.load(H200)
    specs = engine_specs([PREFILL_HOST, DECODE_HOST], prof, "glm-5.3-fp8", tmp_path)
    dec = next(s for s in specs if s.role == "decode")
    blocks, block_bytes = dec.offload
    assert block_bytes > 0 and blocks == 16 * 2**30 // block_bytes  # decode-host.yaml: kv-offloading-size 16
    assert next(s for s in specs if s.role == "prefill").offload is None  # the prefill host has none
    copy_s, step_s = 0.5, 0.01

    async def main(tier):
        loop = asyncio.get_running_loop()
        e = SimEngine("d", dec.cfg, 24, lambda chunks: step_s, loop, 0, None, tier, copy_s)

        async def run(rid, prompt):
            done = loop.create_future()
            e.add(Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)),
                  lambda o: o.finish_reason is not None and not done.done() and done.set_result(o))
            await done

        await run("a", list(range(1, 641)))  # 10 blocks, cached when it ends
        await run("b", list(range(2000, 2000 + 64 * 20)))  # 20 more: the pool of 24 evicts a's
        tokens, busy, steps = e.tokens, e.busy_s, e.num_steps
        await run("c", list(range(1, 641)) + [5, 6, 7])  # a's prefix again
        return e, e.tokens - tokens, e.busy_s - busy, e.num_steps - steps

    e, computed, busy, steps = clock.run(main(OffloadTier(64, block_bytes)))
    st = e.kv.offload_stats()
    # a's blocks the pool evicted went to the tier and came back for c (the rest were still on the device)
    assert st.num_stored >= 5 and st.num_loaded == st.hits // 64 >= 5
    assert e.offload_copies == st.num_stored + st.num_loaded  # every copy run in a step, none lost
    assert computed < 64 + 3  # the prefix came from the device pool and the tier, not the forward
    assert busy >= steps * step_s + st.num_loaded * copy_s  # c's steps paid for its loads
    without, computed_without, _, _ = clock.run(main(None))
    # no tier: what the pool evicted is computed again
    assert without.kv.offload_stats() is None and computed_without >= computed + 64 * st.num_loaded


DP8_PREFILL = ["services.prefill.data_parallel_size=8", "services.prefill.prefill_context_parallel_size=1",
               "services.prefill.decode_context_parallel_size=1"]


def test_a_dp_prefill_group_is_one_instance_per_rank_with_its_own_pool(tmp_path):
    """The DP8 x EP8 prefill what-if (the launcher does not run it): eight one-GPU prefill instances costed by the
    profile's prefill/dp8 entry, each holding its requests' whole KV (an eighth of the DCP8 engine's pool in the
    same HBM share); PCP or DCP with it, a bad size or a profile without its entry is refused by name."""
    from bench.simulate.system import engine_specs

    prof, hosts = Profile.load(H200), [PREFILL_HOST, DECODE_HOST]

    def prefills(profile, *settings):
        return [s for s in engine_specs(hosts, profile, "glm-5.3-fp8", tmp_path, list(settings)) if s.role == "prefill"]

    pcp, dp = prefills(prof), prefills(prof, *DP8_PREFILL)
    assert len(pcp) == 1 and pcp[0].gpus == 8 and pcp[0].key == "prefill/pcp8-dcp8"
    assert [s.instance_id for s in dp] == [f"prefill-0-dp{r}" for r in range(8)]
    assert all(s.key == "prefill/dp8" and s.gpus == 1 for s in dp)
    assert dp[0].num_blocks == pytest.approx(pcp[0].num_blocks / 8, rel=0.01)
    assert 300_000 < dp[0].num_blocks * 64 < 1_000_000  # a rank's pool of 64-token blocks: no 1M-token prompt
    # a chunk all on one rank costs several times what the same chunk split over PCP8's ranks does
    one, split = prof.engine("prefill/dp8")([_chunk(0, 8192)]), prof.engine("prefill/pcp8-dcp8")([_chunk(0, 8192)])
    assert one > 4 * split
    with pytest.raises(ValueError, match="one GPU per rank"):
        prefills(prof, "services.prefill.data_parallel_size=8")
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        prefills(prof, "services.prefill.data_parallel_size=0")
    no_dp = Profile({**prof.raw, "engines": {k: v for k, v in prof.raw["engines"].items() if k != "prefill/dp8"}},
                    "no-dp.json")
    with pytest.raises(ProfileError, match="no step costs for prefill/dp8"):
        prefills(no_dp, *DP8_PREFILL)


def test_a_dp_prefill_group_spreads_prompts_over_its_ranks_and_serves_them(tmp_path):
    traces = write_traces(tmp_path / "traces", out_scale=8)
    out = tmp_path / "out"
    argv = ["--config", PREFILL_HOST, "--config", DECODE_HOST, "--model", "glm-5.3-fp8", "--profile", str(H200),
            "--traces", str(traces), "--concurrency", "8", "--duration", "120", "--warmup", "10", "--seed", "1",
            "--output-dir", str(out)] + [a for s in DP8_PREFILL for a in ("--set", s)]
    assert cli.main(argv) == 0
    level = json.loads((out / "result.json").read_text())["levels"][0]
    assert level["valid"] and level["completed"] > 5 and not level["sim"]["refused"]
    ranks = [i for i, n in level["sim"]["steps"].items() if i.startswith("prefill-0-dp") and n > 0]
    assert len(ranks) >= 4  # the router places sessions over the ranks (least work ahead, prefix-aware)
    assert len(level["sim"]["steps"]) == 16  # 8 prefill ranks + 8 decode ranks
