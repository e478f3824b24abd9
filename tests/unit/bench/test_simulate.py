"""`pdserve simulate` (bench/simulate/): the virtual clock, the same result files as `bench agentx`, determinism,
the production scheduler's behaviour showing through (prefix hits, MTP tokens per step, KV admission), and the
refusals: a profile without an entry the topology needs, a trace over the context limit, weights over HBM."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.simulate import cli, clock
from bench.simulate.profile import Profile, ProfileError, StepCost
from services import cli as pdserve
from tests.helpers import ROOT
from tests.helpers.agent_traces import write_traces

CPU_TOPOLOGY = str(ROOT / "configs" / "topology.cpu.yaml")
PROFILE = {"version": 1, "hardware": "test", "commit": "", "date": "", "model": "tiny-code",
           "engines": {"prefill/pcp1-dcp1": {"step_s": 0.01, "token_s": 2e-5, "token_ctx_s": 1e-9, "request_s": 5e-4},
                       "decode/dp1-hisparse": {"step_s": 0.02, "token_s": 1e-4, "token_ctx_s": 1e-9,
                                               "request_s": 5e-4}},
           "transfer": {"latency_s": 0.002, "gbs": 1.0}, "kvstore": {"latency_s": 0.002, "gbs": 1.0},
           "request_overhead_s": {"value": 0.003},
           "mtp_acceptance_length": 2.5}


@pytest.fixture
def traces(tmp_path):
    """Two sessions of growing prompts (shared prefixes); the second with a subagent; outputs x 4."""
    return write_traces(tmp_path / "traces", out_scale=4)


def _profile(tmp_path, **changes):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({**PROFILE, **changes}))
    return p


def _prefill_phases(traces, tmp_path, served: dict, name: str, *extra) -> list[dict]:
    """Each level's simulated prefill phase (mean, p50, p90) with `prefill_served` = served."""
    out = tmp_path / name
    assert cli.main(_argv(traces, _profile(tmp_path, prefill_served=served), out, *extra)) == 0
    return [lv["sim"]["time_by_phase_s"]["prefill"] for lv in json.loads((out / "result.json").read_text())["levels"]]


def _argv(traces, profile, out, *extra):
    return ["--config", CPU_TOPOLOGY, "--profile", str(profile), "--traces", str(traces), "--concurrency", "2,6",
            "--duration", "150", "--warmup", "20", "--think-time-scale", "0.5", "--seed", "3", "--output-dir",
            str(out), *extra]


def test_the_virtual_clock_jumps_to_the_next_timer():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        return loop.time()

    assert clock.run(main()) == pytest.approx(3600.0)


def test_a_cancelled_timer_costs_no_real_wait():
    """A cancelled timer at the head of the loop's queue is dropped, not jumped to: the clock moves to the next
    live timer at once (jumping to the dead one left the base loop a real select() until the live one)."""
    import time

    async def main():
        loop = asyncio.get_running_loop()
        for _ in range(3):
            loop.call_later(1.0, lambda: None).cancel()
            await asyncio.sleep(2.0)
        return loop.time()

    t0 = time.perf_counter()
    assert clock.run(main()) == pytest.approx(6.0)
    assert time.perf_counter() - t0 < 1.0  # the three 1 s real waits of the bug would take 3 s


def test_simulate_writes_agentx_results_and_is_deterministic(traces, tmp_path):
    prof = _profile(tmp_path)
    assert pdserve.main(["simulate", *_argv(traces, prof, tmp_path / "a")]) == 0
    assert cli.main(_argv(traces, prof, tmp_path / "b")) == 0
    a = json.loads((tmp_path / "a" / "result.json").read_text())
    b = json.loads((tmp_path / "b" / "result.json").read_text())
    for f in ("result.json", "levels.csv", "interactivity_vs_throughput.png", "ttft_cdf.png"):
        assert (tmp_path / "a" / f).stat().st_size > 0
    assert a["simulated"] and [lv["concurrency"] for lv in a["levels"]] == [2, 6]
    strip = [{k: v for k, v in lv.items() if k != "sim"} for lv in a["levels"]]
    assert strip == [{k: v for k, v in lv.items() if k != "sim"} for lv in b["levels"]]  # same inputs, same run
    for lv in a["levels"]:
        assert lv["valid"] and lv["completed"] > 10
        sim = lv["sim"]
        assert sim["simulated_s"] >= 170  # 3 simulated minutes (their wall time is a benchmark figure, not tested)
        assert 0 < sim["busy_fraction"]["decode"] < 1 and sim["bottleneck"]
        assert max(v for v in sim["prefix_hit_rate"].values() if v is not None) > 0.3  # growing prompts hit
        assert {"service", "prefill", "decode"} <= set(sim["time_by_phase_s"])  # where the requests' time went
    # MTP with acceptance length 2.5: well over one token per decode step (a step costs at least 20 ms here)
    assert a["levels"][0]["p50_tpot_ms"] < 20.0 / 1.5


def test_refusals_name_what_is_missing(traces, tmp_path):
    no_decode = _profile(tmp_path, engines={"prefill/pcp1-dcp1": PROFILE["engines"]["prefill/pcp1-dcp1"]})
    with pytest.raises(ProfileError, match=r"no step costs for decode/dp1-hisparse.*it has: prefill/pcp1-dcp1"):
        cli.run(cli.build_parser().parse_args(_argv(traces, no_decode, tmp_path / "x")))
    assert cli.main(_argv(traces, no_decode, tmp_path / "x")) == 2
    no_transfer = {k: v for k, v in PROFILE.items() if k != "transfer"}
    (tmp_path / "nt.json").write_text(json.dumps(no_transfer))
    with pytest.raises(ProfileError, match="no transfer entry"):
        cli.run(cli.build_parser().parse_args(_argv(traces, tmp_path / "nt.json", tmp_path / "x")))
    with pytest.raises(ProfileError, match="not a version-1 profile"):
        Profile.load(_profile(tmp_path, version=2))
    # every trace needs more than the context limit: refused, with the limit named
    with pytest.raises(ValueError, match="no trace fits in 200 tokens"):
        cli.run(cli.build_parser().parse_args(_argv(traces, _profile(tmp_path), tmp_path / "x", "--max-context",
                                                    "200", "--fit-traces")))
    # the profile's GPU cannot hold the model's weights: GLM-5.3 on a 16 GiB card
    small = _profile(tmp_path, hbm_gib=16)
    with pytest.raises(ValueError, match=r"GiB of weights per GPU leave no KV block in 16 GiB"):
        cli.run(cli.build_parser().parse_args(_argv(traces, small, tmp_path / "x", "--model", "glm-5.3")))


def test_calibration_fit_recovers_its_terms_and_keeps_them_non_negative():
    from bench.simulate.calibrate import nnls_fit, served_decode_rows

    true = [0.01, 2e-4, 3e-8, 1e-3]
    rows = [([1.0, n, n * c, b], sum(t * f for t, f in zip(true, [1.0, n, n * c, b])))
            for n, c, b in [(4, 100, 1), (64, 300, 8), (256, 2000, 16), (16, 50, 4), (128, 900, 2)]]
    for relative in (False, True):
        coef, err = nnls_fit(rows, relative=relative)
        assert coef == pytest.approx(true, rel=1e-6) and err < 1e-9
    # relative: the steps' relative errors, not the longest step's seconds, lead; the total stays the measured one
    off = [([1.0, n], t) for n, t in ((10, 0.010), (20, 0.011), (40, 0.012), (80, 0.014), (1000, 1.0))]
    _, err = nnls_fit(off)
    (a, b), rel_err = nnls_fit(off, relative=True)
    assert rel_err < err
    assert a * 5 + b * 1150 == pytest.approx(1.047, rel=1e-3)  # the measured seconds in all
    # a term the data would make negative is dropped (set to 0) and the rest refitted
    coef, _ = nnls_fit([([1.0, n, 0.0, 0.0], 0.05 - 1e-4 * n) for n in (1, 10, 100)])
    assert min(coef) >= 0.0
    # a served step of B requests at k = 3: B x 4 rows, TPOT x tokens per step seconds
    (feat, t), = served_decode_rows({8: 0.02}, 3, 2.0, 100)
    assert feat == [1.0, 32.0, 32 * 102.0, 8.0, 8 * 104.0, 3.0] and t == pytest.approx(0.04)  # 3 draft passes


def test_a_step_pays_for_the_draft_passes_it_runs_not_the_drafts_it_verifies():
    """draft_pass_s: one MTP forward per draft the step proposes, as many as its chunk proposing the most; fitted
    apart from the tokens on the engine alone (a request's last steps propose fewer), and taken from there by the
    served fit, whose steady-state steps all propose k."""
    from bench.simulate.calibrate import FIT_TERMS, _Chunk, _features, nnls_fit, served_decode_fit
    from bench.simulate.profile import StepCost

    assert FIT_TERMS[-1] == "draft_pass_s"
    cost = StepCost(0.004, 1e-4, 0.0, 0.0, draft_pass_s=0.001)
    tail = [_Chunk(100, [0] * 4, 2), _Chunk(100, [0] * 2, 0)]  # verifies 3 and 1 drafts, proposes 2 and 0
    assert cost(tail) == pytest.approx(0.004 + 6 * 1e-4 + 2 * 0.001)
    assert cost([_Chunk(100, [0])]) == pytest.approx(0.004 + 1e-4)  # a last step: no drafts proposed
    assert cost([_Chunk(100, [0], 3)]) == pytest.approx(0.004 + 1e-4 + 0.003)  # a first one: k drafts
    # a decode's steps down to its requests' last drafts (B requests in step, tokens 1 + the drafts verified)
    true = {"step_s": 0.004, "token_s": 1e-4, "draft_pass_s": 0.001}
    steps = [[_Chunk(200, [0] * (1 + v), d)] * b for b in (1, 4, 16) for v, d in ((3, 3), (3, 2), (2, 1), (1, 0))]
    rows = [(_features(ch), sum(true.get(t, 0.0) * f for t, f in zip(FIT_TERMS, _features(ch)))) for ch in steps]
    coef, err = nnls_fit(rows, relative=True)
    assert dict(zip(FIT_TERMS, coef)) == pytest.approx({t: true.get(t, 0.0) for t in FIT_TERMS}, abs=1e-9)
    # the served fit keeps the engine-alone draft term and fits the rest to its (all k-draft) steps
    served = [(_features([_Chunk(152, [0] * 4, 3)] * b), 0.0062 + 4e-4 * b) for b in (1, 4, 16)]
    coef, _ = served_decode_fit(served, dict(zip(FIT_TERMS, [0.0] * len(FIT_TERMS)), draft_pass_s=0.001))
    got = dict(zip(FIT_TERMS, coef))
    assert got["draft_pass_s"] == 0.001 and got["step_s"] == pytest.approx(0.0032, rel=1e-6)
    # a profile written before the term: its steps' rows have no drafts column, and still give the spread
    from bench.simulate.profile import Profile
    entry = {"step_s": 0.004, "token_s": 1e-4, "token_ctx_s": 0.0, "request_s": 0.0,
             "measured": [[1.0, 4.0, 0.0, 1.0, 0.0, 0.0044], [1.0, 4.0, 0.0, 1.0, 0.0, 0.0088]]}
    assert Profile({"version": 1, "engines": {"decode/dp1": entry}}).dispersion("decode/dp1") == \
        pytest.approx([2 / 3, 4 / 3])


def test_a_chunk_reads_its_context_once_whatever_its_rows():
    """chunk_ctx_s: per token of context (cached and new) each chunk reads; fitted apart from the rows' terms when
    the calibration has short turns after long cached prefixes."""
    from bench.simulate.calibrate import FIT_TERMS, _features, nnls_fit

    def chunk(start, n):
        return type("Chunk", (), {"start": start, "token_ids": [0] * n})

    cost = Profile({"version": 1, "engines": {"prefill/pcp1-dcp1": {
        "step_s": 0.01, "token_s": 1e-4, "token_ctx_s": 0.0, "request_s": 0.0, "chunk_ctx_s": 1e-5}}}
    ).engine("prefill/pcp1-dcp1")
    assert cost([chunk(1000, 32)]) == pytest.approx(0.01 + 32e-4 + 1032e-5)
    assert cost([chunk(1000, 32), chunk(0, 8)]) == pytest.approx(0.01 + 40e-4 + 1040e-5)
    with pytest.raises(ProfileError, match="chunk_ctx_s must be >= 0"):
        Profile({"version": 1, "engines": {"prefill/pcp1-dcp1": {
            "step_s": 0.0, "token_s": 0.0, "token_ctx_s": 0.0, "request_s": 0.0, "chunk_ctx_s": -1.0}}}
        ).engine("prefill/pcp1-dcp1")
    # the calibration grid's shapes (fresh prompts, a quarter more after them, then 32 more; three fresh prompts in
    # one step) separate the terms
    true = dict(zip(FIT_TERMS, (0.02, 1e-4, 2e-8, 1e-3, 3e-5, 0.0)))  # no drafts in a prefill step
    lens = (64, 256, 1024, 2048)
    shapes = [[chunk(0, n)] for n in lens] + [[chunk(n, n // 4)] for n in lens] + \
        [[chunk(n + n // 4, 32)] for n in lens] + [[chunk(0, n // 2 + 8)] * 3 for n in lens]
    rows = [(_features(s), StepCost(**true)(s)) for s in shapes]
    coef, err = nnls_fit(rows)
    assert coef == pytest.approx(list(true.values()), rel=1e-6) and err < 1e-9



def _ranks(spec, cost, loop, n: int, grouped: bool) -> list:
    """n simulated prefill engines of `spec` at `cost`, stepping as one DP group (engines.LockStep) or alone."""
    from bench.simulate.engines import LockStep, SimEngine

    ranks = [SimEngine(f"r{i}", spec.cfg, spec.num_blocks, cost, loop, seed=i) for i in range(n)]
    if grouped:
        group = LockStep(loop)
        for r in ranks:
            group.add(r)
    return ranks


def test_the_ranks_of_a_dp_group_step_together(tmp_path):
    """engines.LockStep: a short prompt added to one rank while another rank's long prompt is in its step waits for
    that step (the group's next step starts when the whole group's ends); a rank without work runs a dummy pass
    each step. Ranks stepping alone serve the short prompt at once."""
    from bench.simulate.system import engine_specs
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams

    prof = Profile.load(_profile(tmp_path))
    spec = next(s for s in engine_specs(CPU_TOPOLOGY, prof, None, tmp_path) if s.role == "prefill")
    cost = prof.engine(spec.key)

    async def run(grouped: bool):
        loop = asyncio.get_running_loop()
        ranks = _ranks(spec, cost, loop, 3, grouped)
        done: dict[str, float] = {}
        for rank, rid, n in ((ranks[0], "long", 200), (ranks[1], "short", 5)):
            sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            rank.add(Request(rid, list(range(16, 16 + n)), sp),
                     lambda o, rid=rid: o.finish_reason is None or done.setdefault(rid, loop.time()))
        while len(done) < 2 and loop.time() < 60:
            await asyncio.sleep(0.001)
        return ranks, done

    ranks, done = clock.run(run(True))
    assert done["short"] > done["long"] > 0
    assert ranks[2].num_steps == ranks[0].num_steps >= 1  # the idle rank's dummy passes
    assert ranks[2].busy_s == pytest.approx(ranks[0].busy_s)
    _, alone = clock.run(run(False))
    assert alone["short"] < alone["long"] < done["short"] and alone["long"] == pytest.approx(done["long"])


def test_a_dp_groups_routed_expert_work_is_spread_over_its_ranks(tmp_path):
    """`group_token_s` (a DP x EP rank's routed experts): charged per token of the whole group over its ranks, so a
    rank alone with a long prompt in a group of 4 pays a quarter of that prompt's expert work, not all of it."""
    import dataclasses
    from types import SimpleNamespace

    from bench.simulate.system import engine_specs
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams

    cost = StepCost(step_s=0.01, token_s=1e-4, token_ctx_s=0.0, request_s=0.0, group_token_s=1e-3)
    chunk = SimpleNamespace(start=0, token_ids=[0] * 100)
    assert cost([chunk]) == pytest.approx(0.01 + 0.01 + 0.1)  # alone: its own tokens
    assert cost([chunk], 25.0) == pytest.approx(0.01 + 0.01 + 0.025)
    prof = Profile.load(_profile(tmp_path))
    spec = next(s for s in engine_specs(CPU_TOPOLOGY, prof, None, tmp_path) if s.role == "prefill")
    cost = dataclasses.replace(prof.engine(spec.key), group_token_s=1e-3)

    async def run(grouped: bool):
        loop = asyncio.get_running_loop()
        ranks = _ranks(spec, cost, loop, 4, grouped)
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ranks[0].add(Request("long", list(range(16, 16 + 64)), sp), lambda o: None)
        while ranks[0].num_steps == 0 or ranks[0].busy and loop.time() < 60:
            await asyncio.sleep(0.0001)
        return ranks[0].busy_s

    alone, grouped = clock.run(run(False)), clock.run(run(True))
    assert alone - grouped == pytest.approx(1e-3 * 64 * (1 - 1 / 4))


def test_engines_sharing_a_gpu_count_it_once(tmp_path):
    """Throughput per GPU divides by the GPUs the topology places its engines on (the one-GPU topology's prefill
    and decode share GPU 0, as `bench agentx --num-gpus 1` counts it); without placements, by the engines' ranks."""
    from bench.simulate.system import engine_specs

    prof = Profile.load(_profile(tmp_path, hbm_gib=80.0))  # a GPU profile: the pools from HBM, not the device
    one_gpu = engine_specs(str(ROOT / "configs" / "topology.gpu-1.yaml"), prof, None, tmp_path)
    assert one_gpu[0].deployment_gpus == 1 and sum(s.gpus for s in one_gpu) == 2
    assert engine_specs(CPU_TOPOLOGY, prof, None, tmp_path)[0].deployment_gpus is None


def test_engines_sharing_a_device_take_turns_on_it():
    """engines.SharedDevice, processor sharing: a prefill step of 1 s alone starts at 0, a decode step of 1 s at 0.5;
    while both run, the prefill goes at 1/2 and the decode at 1/1.5 of their alone speed, so the prefill ends at
    0.5 + 0.5 * 2 = 1.5 and the decode, 2/3 done by then, alone again at 1.5 + 1/3."""
    from types import SimpleNamespace

    from bench.simulate.engines import SharedDevice

    async def main():
        loop = asyncio.get_running_loop()
        device = SharedDevice(loop, {"prefill": 2.0, "decode": 1.5})
        pre, dec = SimpleNamespace(instance_id="p"), SimpleNamespace(instance_id="d")
        device.add(pre, "prefill")
        device.add(dec, "decode")
        ends: dict[str, float] = {}
        device.start(pre, 1.0, lambda: ends.setdefault("prefill", loop.time()))
        await asyncio.sleep(0.5)
        device.start(dec, 1.0, lambda: ends.setdefault("decode", loop.time()))
        await asyncio.sleep(10.0)
        alone: dict[str, float] = {}
        device.start(dec, 1.0, lambda: alone.setdefault("decode", loop.time()))  # nothing else on it: at full speed
        await asyncio.sleep(10.0)
        return ends, alone

    ends, alone = clock.run(main())
    assert ends["prefill"] == pytest.approx(1.5) and ends["decode"] == pytest.approx(1.5 + 1 / 3)
    assert alone["decode"] == pytest.approx(10.5 + 1.0)


def test_a_prefill_and_decode_on_one_device_share_it_in_the_simulation(traces, tmp_path):
    """The one-GPU and the CPU topologies place both engines on one device, the two-host reference does not; with
    the profile's measured slowdowns the shared device lengthens the decode's steps (TPOT), without them the result
    says the sharing was not modelled; a slowdown under 1 is refused."""
    from bench.simulate.system import engine_specs

    prof = Profile.load(_profile(tmp_path, hbm_gib=80.0))
    assert all(s.shared_device for s in engine_specs(str(ROOT / "configs" / "topology.gpu-1.yaml"), prof, None,
                                                      tmp_path) if s.role != "kvstore")
    assert all(s.shared_device for s in engine_specs(CPU_TOPOLOGY, prof, None, tmp_path) if s.role != "kvstore")
    hosts = ROOT / "configs" / "h200x16"
    from bench.simulate.system import services_of
    assert services_of([str(hosts / "prefill-host.yaml"), str(hosts / "decode-host.yaml")])[4] is False

    def tpot(profile, out):
        argv = _argv(traces, profile, out)
        argv[argv.index("2,6")] = "4"
        assert cli.main(argv) == 0
        level = json.loads((out / "result.json").read_text())["levels"][0]
        return level, level["median_tpot_ms"]

    alone, t_alone = tpot(_profile(tmp_path), tmp_path / "alone")
    assert alone["sim"]["shared_device"]["slowdown"] is None
    assert sorted(alone["sim"]["shared_device"]["engines"]) == ["decode-0", "prefill-0"]
    shared = {"prefill": 1.5, "decode": 3.0, "source": "test"}
    both, t_shared = tpot(_profile(tmp_path, shared_device=shared), tmp_path / "shared")
    assert both["sim"]["shared_device"]["slowdown"] == {"prefill": 1.5, "decode": 3.0}
    assert t_shared > 1.05 * t_alone  # the decode is slowed only while a prefill step overlaps it
    with pytest.raises(ProfileError, match="shared_device"):
        _ = Profile.load(_profile(tmp_path, shared_device={"prefill": 0.5, "decode": 1.0})).shared_device


def test_a_shared_devices_slowdown_is_read_back_from_its_measured_steps():
    """calibrate.sharing_slowdown inverts the processor-sharing model: a step of 1 s alone that took 1.5 s while the
    other engine was always busy -> 1.5; the same 1.5 s with the other busy half the time -> 3 (1 / (0.5 + 0.5 / 3)
    = 1.5); the other never busy, or the step no slower -> 1; more slowdown than sharing can explain -> the cap."""
    from bench.simulate.calibrate import sharing_slowdown

    assert sharing_slowdown(1.0, 1.5, 1.0) == pytest.approx(1.5)
    assert sharing_slowdown(1.0, 1.5, 0.5) == pytest.approx(3.0)
    assert sharing_slowdown(1.0, 1.5, 0.0) == 1.0 and sharing_slowdown(1.0, 0.9, 0.8) == 1.0
    assert sharing_slowdown(1.0, 5.0, 0.5) == 10.0


def test_the_service_overhead_grows_with_the_streams_the_calibration_measured_it_under(traces, tmp_path):
    """request_overhead_s.by_streams: measured points joined linearly from the idle value, flat past the last;
    the simulation charges a request the overhead of the streams live at its arrival, so a busier level spends
    more per request before its prefill; points out of order or at zero streams are refused."""
    entry = {"value": 0.003, "by_streams": [[4, 0.005], [16, 0.011]]}
    prof = Profile.load(_profile(tmp_path, request_overhead_s=entry))
    assert [prof.request_overhead(k) for k in (0, 2, 4, 10, 16, 64)] == pytest.approx(
        [0.003, 0.004, 0.005, 0.008, 0.011, 0.011])
    assert Profile.load(_profile(tmp_path)).request_overhead(50) == 0.003  # no points: the idle value
    for bad in ([[0, 0.004]], [[8, 0.005], [4, 0.006]], [[4, -1.0]], [4, 0.005]):
        with pytest.raises(ProfileError, match="by_streams"):
            Profile.load(_profile(tmp_path, request_overhead_s={"value": 0.003, "by_streams": bad})).request_overhead(1)

    def service_ms(profile, out):
        assert cli.main(_argv(traces, profile, out)) == 0
        return [1e3 * lv["sim"]["time_by_phase_s"]["service"]["mean"]
                for lv in json.loads((out / "result.json").read_text())["levels"]]

    assert service_ms(_profile(tmp_path), tmp_path / "idle") == pytest.approx([3.0, 3.0])
    low, high = service_ms(_profile(tmp_path, request_overhead_s=entry), tmp_path / "loaded")
    assert 3.0 < low < high < 11.0  # c = 2 meets fewer live streams than c = 6


def test_the_kv_handoff_latency_grows_with_the_streams_the_calibration_measured_it_under(traces, tmp_path, capsys):
    """transfer.by_streams: the handoff's latency at each measured stream count, joined linearly from the idle
    latency_s and flat past the last, plus the bytes at the bandwidth; the simulation takes it at the other
    requests streaming when a request's handoff starts, so a busier level's handoff (its first gap after the first
    token) is longer; malformed points are refused before anything runs."""
    transfer = dict(PROFILE["transfer"], latency_s=0.002, by_streams=[[2, 0.012], [8, 0.05]])
    prof = Profile.load(_profile(tmp_path, transfer=transfer))
    per_byte = 1 / (transfer["gbs"] * 1e9)
    assert [prof.transfer_s(0, k) for k in (0, 1, 2, 5, 8, 20)] == pytest.approx(
        [0.002, 0.007, 0.012, 0.031, 0.05, 0.05])
    assert prof.transfer_s(1e6, 8) == pytest.approx(0.05 + 1e6 * per_byte)
    assert prof.transfer_s(0) == 0.002
    for bad in ([[0, 0.004]], [[8, 0.005], [4, 0.006]], [[4, -1.0]]):
        with pytest.raises(ProfileError, match="transfer.by_streams"):
            Profile.load(_profile(tmp_path, transfer=dict(transfer, by_streams=bad))).transfer_s(0)
    bad = _profile(tmp_path, transfer=dict(transfer, by_streams=[[0, 1.0]]))
    assert cli.main(_argv(traces, bad, tmp_path / "bad")) == 2  # refused before the simulation starts
    assert "transfer.by_streams" in capsys.readouterr().err and not (tmp_path / "bad" / "result.json").exists()

    def handoff_ms(profile, out):
        assert cli.main(_argv(traces, profile, out)) == 0
        return [lv["p50_handoff_ms"] for lv in json.loads((out / "result.json").read_text())["levels"]]

    idle = handoff_ms(_profile(tmp_path, transfer=dict(transfer, by_streams=[])), tmp_path / "idle")
    loaded = handoff_ms(_profile(tmp_path, transfer=transfer), tmp_path / "loaded")
    assert all(b > a for a, b in zip(idle, loaded))
    assert loaded[1] - idle[1] > loaded[0] - idle[0]  # c = 6 meets more live streams than c = 2


def test_with_busy_handoff_a_handoff_behind_prefill_work_costs_the_busy_latency(traces, tmp_path, capsys):
    """transfer.busy_s: a handoff measured while the prefill was kept busy. `--busy-handoff` costs a handoff at it
    when its prefill engine has a step under way or requests waiting or running as the handoff starts (the other
    handoffs as before), counts those handoffs, and leaves a profile without it as it was; a non-positive one is
    refused before anything runs."""
    transfer = dict(PROFILE["transfer"], latency_s=0.002, busy_s=0.040)
    prof = Profile.load(_profile(tmp_path, transfer=transfer))
    assert prof.busy_handoff_s == 0.040
    assert prof.transfer_s(0, 3) == 0.002 and prof.transfer_s(0, 3, prefill_busy=True) == 0.040
    assert Profile.load(_profile(tmp_path)).transfer_s(0, prefill_busy=True) == 0.002  # not measured: as before
    bad = _profile(tmp_path, transfer=dict(transfer, busy_s=0))
    assert cli.main(_argv(traces, bad, tmp_path / "bad")) == 2
    assert "transfer.busy_s" in capsys.readouterr().err and not (tmp_path / "bad" / "result.json").exists()

    def run(out, *extra):
        assert cli.main(_argv(traces, _profile(tmp_path, transfer=transfer), out, *extra)) == 0
        return json.loads((out / "result.json").read_text())["levels"]

    plain, busy = run(tmp_path / "plain"), run(tmp_path / "busy", "--busy-handoff")
    assert [lv["sim"]["busy_handoffs"] for lv in plain] == [None, None]
    counted = [lv["sim"]["busy_handoffs"] for lv in busy]
    assert counted[1] > counted[0] > 0, counted  # c = 6 finds its prefill busy more often than c = 2
    for p, b, n in zip(plain, busy, counted):  # each of those handoffs took 38 ms more, the others the same
        assert b["sim"]["transfer_s"] - p["sim"]["transfer_s"] == pytest.approx(n * 0.038, rel=0.05)
        assert b["mean_handoff_ms"] > p["mean_handoff_ms"]


def test_a_handoffs_own_latency_is_its_second_token_less_the_decode_steps_it_waited_for():
    """calibrate.handoff_latency: a probe's second-token delay less (1 + u) mean decode steps (u: the decode's busy
    fraction over the probe's window), never below 0; the whole delay when the decode did not step."""
    from bench.simulate.calibrate import handoff_latency

    # 40 steps of 10 ms in a 2-s window: u = 0.2, so 1.2 steps = 12 ms come off a 30-ms delay
    assert handoff_latency(0.030, 0.4, 40, 2.0) == pytest.approx(0.018)
    assert handoff_latency(0.030, 0.0, 0, 2.0) == 0.030
    assert handoff_latency(0.005, 2.0, 100, 2.0) == 0.0  # a busy decode's 2 steps exceed the delay


def test_steps_can_be_drawn_around_their_cost_as_the_measured_steps_spread(traces, tmp_path):
    """Profile.dispersion: each kept step's seconds over its fitted cost, scaled to mean 1; `--step-dispersion`
    draws every step of an engine whose entry kept steps from them, seeded (the same run twice), adding spread to
    the TTFTs but not time on average; entries without steps keep one cost per shape."""
    from bench.simulate.profile import DispersedCost

    pre = dict(PROFILE["engines"]["prefill/pcp1-dcp1"], token_ctx_s=0.0, chunk_ctx_s=0.0)  # 10 ms + 20 us a row
    # features: 1, rows, rows x mean context, requests, context read; then seconds (fitted 12.5 ms: 0.48 / 1.44 /
    # 0.96 of it, i.e. 0.5 / 1.5 / 1 of their mean)
    pre["measured"] = [[1, 100, 0, 1, 100, 0.006], [1, 100, 0, 1, 100, 0.018], [1, 100, 0, 1, 100, 0.012]]
    prof_path = _profile(tmp_path, engines={**PROFILE["engines"], "prefill/pcp1-dcp1": pre})
    prof = Profile.load(prof_path)
    assert prof.dispersion("prefill/pcp1-dcp1") == pytest.approx([0.5, 1.5, 1.0])
    assert prof.dispersion("decode/dp1-hisparse") is None  # no steps kept
    from bench.simulate.calibrate import _Chunk

    chunk = [_Chunk(0, [1] * 100)]
    draws = [[DispersedCost(prof.engine("prefill/pcp1-dcp1"), [0.5, 1.5, 1.0], 7)(chunk) for _ in range(5)]
             for _ in range(2)]
    # the same seed, the same draws; each the step's cost (12.5 ms with its request term) times a ratio
    assert draws[0] == draws[1] and {round(d, 6) for d in draws[0]} <= {0.00625, 0.01875, 0.0125}

    def run(out, *extra):
        assert cli.main(_argv(traces, prof_path, out, *extra)) == 0
        return json.loads((out / "result.json").read_text())["levels"]

    plain, a, b = run(tmp_path / "p", "--no-step-dispersion"), run(tmp_path / "a"), run(tmp_path / "b",
                                                                                      "--step-dispersion")
    assert [lv["ttft_s"] for lv in a] == [lv["ttft_s"] for lv in b]
    assert [lv["ttft_s"] for lv in a] != [lv["ttft_s"] for lv in plain]
    with pytest.raises(ProfileError, match="measured rows"):
        bad = dict(pre, measured=[[1, 2, 0.01]])
        Profile.load(_profile(tmp_path / "p", engines={**PROFILE["engines"], "prefill/pcp1-dcp1": bad})).dispersion(
            "prefill/pcp1-dcp1")


def test_a_call_into_an_engine_waits_for_the_step_in_progress(tmp_path):
    """SimEngine.between_steps, as AsyncEngine.call runs a service's call between two steps: at once on an idle
    engine, else when the step in progress ends (the decode's reservation of an imported request waits so)."""
    from bench.simulate.system import SimSystem, engine_specs
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams

    prof = Profile.load(_profile(tmp_path))

    async def main():
        loop = asyncio.get_running_loop()
        system = SimSystem(engine_specs(CPU_TOPOLOGY, prof, None, tmp_path), prof, seed=0)
        eng = next(e for e in system.engines.values() if e.instance_id.startswith("prefill"))
        t0 = loop.time()
        await eng.between_steps()
        idle = loop.time() - t0
        eng.add(Request("r", list(range(1, 101)), SamplingParams(max_tokens=1, ignore_eos=True)), lambda o: None)
        assert eng.busy
        await eng.between_steps()
        waited = loop.time() - t0
        await system.close()
        return idle, waited

    idle, waited = clock.run(main())
    step = prof.engine("prefill/pcp1-dcp1")
    assert idle == 0.0 and waited == pytest.approx(step.step_s + 100 * step.token_s + step.request_s
                                                    + step.token_ctx_s * 100 * 50)


def test_a_prefill_step_costs_what_the_running_services_took_for_it_beyond_its_fit(traces, tmp_path, capsys):
    """prefill_served: a probe's prefill step in the services (idle, under streams) beside the engine-alone fit of
    that step; each simulated prefill step adds the difference for the streams live at its start (linear between
    the points, flat past the last, never negative); malformed entries are refused before anything runs."""
    entry = {"alone_s": 0.010, "by_streams": [[0, 0.015], [8, 0.035]]}
    prof = Profile.load(_profile(tmp_path, prefill_served=entry))
    assert [prof.served_prefill_extra(k) for k in (0, 4, 8, 20)] == pytest.approx([0.005, 0.015, 0.025, 0.025])
    below = Profile.load(_profile(tmp_path, prefill_served={"alone_s": 0.02, "by_streams": [[0, 0.015]]}))
    assert below.served_prefill_extra(3) == 0.0
    assert Profile.load(_profile(tmp_path)).served_prefill_extra(5) == 0.0  # no entry: the fit alone
    for bad in ({"alone_s": 0.01, "by_streams": [[4, 0.02]]}, {"alone_s": 0.01, "by_streams": [[0, 0.02], [0, 0.03]]},
                {"alone_s": -1, "by_streams": [[0, 0.02]]}, {"by_streams": [[0, 0.02]]}, [0, 0.02]):
        with pytest.raises(ProfileError, match="prefill_served"):
            Profile.load(_profile(tmp_path, prefill_served=bad)).served_prefill_extra(1)
    bad = _profile(tmp_path, prefill_served={"alone_s": 0.01, "by_streams": []})
    assert cli.main(_argv(traces, bad, tmp_path / "x")) != 0  # the simulation refuses it up front
    assert "prefill_served" in capsys.readouterr().err and not (tmp_path / "x" / "result.json").exists()

    def prefill_ms(profile, out, *extra):
        assert cli.main(_argv(traces, profile, out, *extra)) == 0
        return [1e3 * lv["sim"]["time_by_phase_s"]["prefill"]["mean"]
                for lv in json.loads((out / "result.json").read_text())["levels"]]

    alone = prefill_ms(_profile(tmp_path), tmp_path / "alone")
    served = prefill_ms(_profile(tmp_path, prefill_served=entry), tmp_path / "served")
    left_out = prefill_ms(_profile(tmp_path, prefill_served=entry), tmp_path / "left-out", "--no-served-prefill")
    assert left_out == pytest.approx(alone)  # --no-served-prefill: the engine-alone fit only
    assert all(s > a + 4.0 for a, s in zip(alone, served)), (alone, served)  # at least the idle 5 ms a step
    assert served[1] - alone[1] > served[0] - alone[0]  # c = 6 meets more live streams than c = 2


def test_with_a_busy_window_a_prefill_step_costs_the_services_share_under_load(traces, tmp_path):
    """prefill_served.busy_s / busy_alone_s: the prefill's mean step while the calibration kept it busy through the
    services, beside the same turns' step on the engine alone. Each simulated prefill step then adds that difference
    whatever the streams (measured runs' steps are as long as the busy window's); `--served-prefill-by-streams`
    keeps the lone probes' points; a half-given or non-positive window is refused."""
    entry = {"alone_s": 0.010, "by_streams": [[0, 0.012], [8, 0.016]], "busy_s": 0.030, "busy_alone_s": 0.012}
    prof = Profile.load(_profile(tmp_path, prefill_served=entry))
    assert prof.served_prefill_busy == (0.030, 0.012)
    assert [prof.served_prefill_extra(k) for k in (0, 4, 20)] == pytest.approx([0.018] * 3)
    assert prof.served_prefill_extra(4, by_streams=True) == pytest.approx(0.004)
    assert prof.served_prefill_extra(0, 0.5) == pytest.approx(0.003)  # a drawn ratio scales the served step
    assert Profile.load(_profile(tmp_path, prefill_served={**entry, "busy_s": 0.001})).served_prefill_extra(0) == 0
    for bad in ({"busy_s": 0.03}, {"busy_alone_s": 0.01}, {"busy_s": 0.03, "busy_alone_s": -1.0},
                {"busy_s": "x", "busy_alone_s": 0.01}):
        with pytest.raises(ProfileError, match="busy_s"):
            Profile.load(_profile(tmp_path, prefill_served={"alone_s": 0.01, "by_streams": [[0, 0.012]], **bad})) \
                .served_prefill_extra(0)

    def run(out, *extra):
        assert cli.main(_argv(traces, _profile(tmp_path, prefill_served=entry), out, *extra)) == 0
        levels = json.loads((out / "result.json").read_text())["levels"]
        return [1e3 * lv["sim"]["time_by_phase_s"]["prefill"]["mean"] for lv in levels], levels

    busy, levels = run(tmp_path / "busy")
    streams, levels_s = run(tmp_path / "streams", "--served-prefill-by-streams")
    alone, _ = run(tmp_path / "alone", "--no-served-prefill")
    assert levels[0]["sim"]["shared_device"]["served_prefill"] == "busy"
    assert levels_s[0]["sim"]["shared_device"]["served_prefill"] == "by streams"
    for a, b, s in zip(alone, busy, streams):  # at least the 18 ms a step beyond the fit; the probes' 2-6 ms less
        assert b > a + 17.0 and a + 1.5 < s < b - 10.0, (alone, busy, streams)


def test_the_busy_window_leaves_the_decodes_share_of_the_device_to_the_sharing(traces, tmp_path):
    """The served prefill step of the busy window was measured with the decode idle, so the decode's share of a
    shared device still slows the simulated prefill's steps (the profile's `shared_device` prefill slowdown); the
    probes' points under streams (`--served-prefill-by-streams`) already hold it, and the sharing leaves the
    prefill at 1 there."""
    entry = {"alone_s": 0.010, "by_streams": [[0, 0.012], [8, 0.016]], "busy_s": 0.030, "busy_alone_s": 0.012}

    def run(name, shared, *extra):
        out = tmp_path / name
        prof = _profile(tmp_path, prefill_served=entry, **({"shared_device": shared} if shared else {}))
        assert cli.main(_argv(traces, prof, out, "--no-step-dispersion", *extra)) == 0
        levels = json.loads((out / "result.json").read_text())["levels"]
        return [lv["sim"]["time_by_phase_s"]["prefill"]["mean"] for lv in levels], levels[0]["sim"]["shared_device"]

    shared = {"prefill": 2.0, "decode": 1.0, "source": "test"}
    alone, _ = run("alone", None)
    busy, dev = run("busy", shared)
    assert dev["slowdown"] == {"prefill": 2.0, "decode": 1.0} and dev["served_prefill"] == "busy"
    assert all(b > a for a, b in zip(alone, busy)), (alone, busy)  # the decode's streams slow its steps
    _, dev_s = run("streams", shared, "--served-prefill-by-streams")
    assert dev_s["slowdown"] == {"prefill": 1.0, "decode": 1.0} and dev_s["served_prefill"] == "by streams"


def test_with_dispersion_the_served_prefill_step_spreads_as_the_probes_did(traces, tmp_path):
    """prefill_served.probe_steps_s: each probe's own served step; `--step-dispersion` draws each prefill step's
    served part at one of their ratios to their stream count's median (scaled to mean 1), seeded: the prefill's
    time spreads further (a longer p90 over p50), the same run twice gives the same figures."""
    entry = {"alone_s": 0.010, "by_streams": [[0, 0.030]],
             "probe_steps_s": {"0": [0.015, 0.030, 0.030, 0.030, 0.075]}}
    prof = Profile.load(_profile(tmp_path, prefill_served=entry))
    assert prof.served_prefill_spread() == pytest.approx([0.5 / 1.2, 1 / 1.2, 1 / 1.2, 1 / 1.2, 2.5 / 1.2])
    assert prof.served_prefill_extra(0, 2.0) == pytest.approx(0.05)
    assert Profile.load(_profile(tmp_path, prefill_served={"alone_s": 0.01, "by_streams": [[0, 0.02]]})) \
        .served_prefill_spread() is None  # no probe's own step kept
    with pytest.raises(ProfileError, match="probe_steps_s"):
        Profile.load(_profile(tmp_path, prefill_served={**entry, "probe_steps_s": {"0": [0.01, -1]}})) \
            .served_prefill_spread()

    plain = _prefill_phases(traces, tmp_path, entry, "plain", "--no-step-dispersion")
    spread = _prefill_phases(traces, tmp_path, entry, "spread")  # the default
    assert spread == _prefill_phases(traces, tmp_path, entry, "again", "--step-dispersion")
    for p, s in zip(plain, spread):
        assert s["p90"] / s["p50"] > p["p90"] / p["p50"], (plain, spread)


def test_with_dispersion_a_busy_served_step_spreads_as_the_busy_windows_histogram(traces, tmp_path, capsys):
    """prefill_served.busy_step_buckets: the busy window's step histogram. Where the busy window is the served step,
    `--step-dispersion` draws each served step at one of 40 equally likely quantiles of it (linear within a bucket)
    over their mean, seeded; `--served-prefill-by-streams` keeps the probes' spread; malformed buckets are refused
    before anything runs."""
    # 5 steps in (0, 0.02], 25 in (0.02, 0.03], 6 in (0.03, 0.05], 4 in (0.05, 0.1], none past it
    buckets = [[0.02, 5], [0.03, 30], [0.05, 36], [0.1, 40], [None, 40]]
    entry = {"alone_s": 0.010, "by_streams": [[0, 0.012]], "busy_s": 0.030, "busy_alone_s": 0.012,
             "probe_steps_s": {"0": [0.010, 0.012, 0.014]}, "busy_step_buckets": buckets}
    prof = Profile.load(_profile(tmp_path, prefill_served=entry))
    spread = prof.served_prefill_spread()
    assert len(spread) == 40 and sum(spread) / 40 == pytest.approx(1.0)
    # the first draw at rank 0.5 of the 5 in (0, 0.02], the last at rank 3.5 of the 4 in (0.05, 0.1]
    assert max(spread) / min(spread) == pytest.approx((0.05 + 0.05 * 3.5 / 4) / (0.02 * 0.5 / 5))
    assert prof.served_prefill_spread(by_streams=True) == pytest.approx([0.010 / 0.012, 1.0, 0.014 / 0.012])
    for bad in ([[0.03, 10], [0.02, 20]], [[0.02, 10], [0.03, 5]], [[0.02, 0]], [["x", 1]], []):
        with pytest.raises(ProfileError, match="busy_step_buckets"):
            Profile.load(_profile(tmp_path, prefill_served={**entry, "busy_step_buckets": bad})).served_prefill_spread()
    bad = _profile(tmp_path, prefill_served={**entry, "busy_step_buckets": [[0.02, 0]]})
    assert cli.main(_argv(traces, bad, tmp_path / "bad")) == 2
    assert "busy_step_buckets" in capsys.readouterr().err and not (tmp_path / "bad" / "result.json").exists()

    plain = _prefill_phases(traces, tmp_path, entry, "plain", "--no-step-dispersion")
    spread_run = _prefill_phases(traces, tmp_path, entry, "spread")  # the default
    assert spread_run == _prefill_phases(traces, tmp_path, entry, "again", "--step-dispersion")
    for p, s in zip(plain, spread_run):  # a longer tail than without dispersion, about the same mean
        assert s["p90"] > p["p90"] * 1.2 and s["mean"] == pytest.approx(p["mean"], rel=0.3), (plain, spread_run)
