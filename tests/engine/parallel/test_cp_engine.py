"""PCP x DCP x EP over real ranks (gloo, one process per rank) against the single-rank engine.

One engine per configuration serves every test of that configuration (spawning ranks costs seconds).
Exact mode (fp32 weights, cache and indexer): logits within the oracle test's tolerance, greedy tokens
equal, and the persistent KV of all ranks, put back in token order, equal to the single-rank cache bit
for bit (every rank computes >= 4 rows of each GEMM in those prompts: MKL's small-M kernels round
differently below that, which the logit tolerance absorbs but bit equality would not).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.prefill.ranks import rank_stats, reset_comm_counters, set_kv_prefetch
from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.parallel.dcp import num_local
from engine.parallel.pcp import dualchunk_ranges
from engine.parallel.spawn import RankPool
from kernels.formats import read_index_rows
from services.transfer import staging as kv_staging_rpc
from tests.helpers import ROOT, cp_checks, kv_pages
from tests.helpers.kv_pages import kv_page_map, rank_kv_rows

pytestmark = pytest.mark.xdist_group("cp")  # one process group per process: keep these on one worker

EXACT = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32", num_blocks=96)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIGS = {
    "pcp2-dcp1": dict(pcp=2, dcp=1, ep=False, merge="ag_rs", interleave=1),
    "pcp2-dcp1-ep": dict(pcp=2, dcp=1, ep=True, merge="ag_rs", interleave=1),
    "pcp2-dcp2": dict(pcp=2, dcp=2, ep=False, merge="ag_rs", interleave=1),
    "pcp2-dcp2-ep-a2a-mtp": dict(pcp=2, dcp=2, ep=True, merge="a2a", interleave=16, mtp=2, long=True),
    "pcp4-dcp4-a2a": dict(pcp=4, dcp=4, ep=False, merge="a2a", interleave=1),
    "pcp4-dcp4-ep": dict(pcp=4, dcp=4, ep=True, merge="ag_rs", interleave=64, long=True),
}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def refs(tiny_ckpt):
    """Single-rank engines: plain, and with MTP (2 drafts)."""
    return {0: LLM(str(tiny_ckpt), **EXACT), 2: LLM(str(tiny_ckpt), num_speculative_tokens=2, **EXACT)}


@pytest.fixture(scope="module")
def rank_pool():
    """Spawned ranks outlive one configuration: the next configuration of the same size reuses them."""
    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=list(CONFIGS))
def cp(request, tiny_ckpt, refs, rank_pool):
    c = CONFIGS[request.param]
    kw = dict(EXACT, num_speculative_tokens=c["mtp"]) if c.get("mtp") else EXACT
    llm = LLM(str(tiny_ckpt), rank_pool=rank_pool, prefill_context_parallel_size=c["pcp"],
              decode_context_parallel_size=c["dcp"],
              enable_expert_parallel=c["ep"], dcp_comm_backend=c["merge"],
              cp_kv_cache_interleave_size=c["interleave"], **kw)
    llm.core.check_outputs = True  # every step: all ranks sampled the same tokens
    yield c, llm, refs[c.get("mtp", 0)]
    llm.core.shutdown()  # its ranks go back to rank_pool


def _prefill_held(core, ids: list[int], req_id: str) -> torch.Tensor:
    """Prefill with prompt logits, keeping the KV (as the prefill service does) -> logits [len, vocab]."""
    core.add_request(Request(req_id, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                             return_prompt_logits=True, hold_kv_on_finish=True))
    parts = []
    while core.has_unfinished():
        parts += [o.prompt_logits for o in core.step() if o.prompt_logits is not None]
    return torch.cat(parts)


def _ref_rows(ref_core, req_id: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.tensor(ref_core.kv.block_ids(req_id))
    pos = torch.arange(n)
    s = blocks[pos // 64] * 64 + pos % 64
    cache = ref_core.runner.kv_cache
    return cache.mla[s // 64, :, s % 64], read_index_rows(cache.index, s // 64, s % 64)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    err = (a - b).abs().max().item()
    assert err <= 1e-4 * b.abs().max().item(), f"{what}: max|diff| {err:.3g}"


def test_prompt_logits_match_single_rank(cp):
    c, llm, ref = cp
    N = c["pcp"]
    for n in (1, 3, 2 * N - 1, 127):
        ids = _ids(n, seed=n)
        _close(llm.prompt_logits(ids), ref.prompt_logits(ids), f"prompt of {n}")


def test_kv_export_bit_exact_and_split_by_dcp(cp):
    """Prefill held for export: logits, the ranks' KV re-assembled in token order (bit for bit), the
    per-rank bytes (1/DCP of the single-rank bytes), the export map, and the indexer's 1/PCP rows."""
    c, llm, ref = cp
    N, D = c["pcp"], c["dcp"]
    for n in ((127, 1000) if c.get("long") else (127,)):
        rid = f"held-{n}"
        before = [s["indexer_rows_scored"] for s in rank_stats(llm.core)]
        ref_before = ref.core.runner.backend.indexer_rows_scored
        ids = _ids(n, seed=1000 + n)
        _close(_prefill_held(llm.core, ids, rid), _prefill_held(ref.core, ids, rid), f"held prompt of {n}")
        after = [s["indexer_rows_scored"] for s in rank_stats(llm.core)]
        _check_indexer_split(c, n, [a - b for a, b in zip(after, before)],
                             ref.core.runner.backend.indexer_rows_scored - ref_before)
        ref_mla, ref_index = _ref_rows(ref.core, rid, n)
        parts = rank_kv_rows(llm.core, rid)
        page_map = kv_page_map(llm.core, rid)
        copies = torch.zeros(n, dtype=torch.int64)  # DCP = N: one rank per token; DCP = 1: a full replica each
        for part in parts:
            pos = torch.tensor(part["positions"], dtype=torch.int64)
            assert pos.tolist() == page_map.rank_tokens(part["rank"])[0].tolist()
            assert part["block_ids"] == page_map.rank_blocks(part["rank"])
            if D > 1:
                assert len(pos) == num_local(n, part["rank"], D, c["interleave"])
            assert torch.equal(part["mla"], ref_mla[pos]), f"rank {part['rank']}: MLA rows differ (prompt of {n})"
            assert torch.equal(part["index"], ref_index[pos]), f"rank {part['rank']}: indexer keys differ"
            copies[pos] += 1
        assert torch.all(copies == (1 if D > 1 else N)), "the ranks' pages do not cover the request exactly"
        block_bytes = llm.core.runner.spec.block_bytes
        per_rank = len(llm.core.kv.block_ids(rid)) * block_bytes
        single = len(ref.core.kv.block_ids(rid)) * block_bytes
        assert abs(per_rank - single / D) <= block_bytes, (per_rank, single, D)
        for core in (llm.core, ref.core):
            assert core.scheduler.release_held(rid)
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_blocks


def _check_indexer_split(c: dict, n: int, per_rank: list[int], single: int) -> None:
    """Each rank scored only its own DualChunkSwap rows (the single-rank count split N ways)."""
    N = c["pcp"]
    assert sum(per_rank) == single > 0
    if c.get("mtp"):  # the MTP catch-up rows are split the same way, one more indexer layer
        assert max(per_rank) <= single / N + 2 * 3 * 2
        return
    full_layers = single // n
    for r, got in enumerate(per_rank):
        own = sum(hi - lo for lo, hi in dualchunk_ranges(n, N, r))
        assert got == own * full_layers, f"rank {r} scored {got} rows, owns {own} x {full_layers} layers"


def test_generation_batch_chunked_and_second_turn(cp):
    c, llm, ref = cp
    N = c["pcp"]
    prompts = [_ids(n, seed=50 + n) for n in (1, 3, 2 * N - 1, 127, 90)]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in ref.generate(prompts, GREEDY)]
    # sampling runs on every rank from the same bits and generators (check_outputs compares them)
    sampled = llm.generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9))
    assert all(len(o.token_ids) >= 1 for o in sampled)
    # chunked prefill: a small token budget cuts the prompts into several steps (same on both engines)
    for core in (llm.core, ref.core):
        core.scheduler.cfg = dataclasses.replace(core.scheduler.cfg, max_num_batched_tokens=40)
    try:
        prompts = [_ids(n, seed=70 + n) for n in (100, 61)]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [
            o.token_ids for o in ref.generate(prompts, GREEDY)]
    finally:
        for core in (llm.core, ref.core):
            core.scheduler.cfg = dataclasses.replace(core.scheduler.cfg, max_num_batched_tokens=8192)
    # a second turn reuses the cached prefix (virtual blocks of 64 * DCP tokens)
    first = _ids(64 * c["dcp"] * 2 + 10, seed=99)
    (turn1,) = llm.generate([first], GREEDY)
    second = first + turn1.token_ids + _ids(20, seed=98)
    (warm,) = llm.generate([second], GREEDY)
    assert warm.num_cached_tokens >= 64 * c["dcp"] * 2 and warm.num_cached_tokens % (64 * c["dcp"]) == 0
    assert warm.token_ids == ref.generate([second], GREEDY)[0].token_ids
    if c.get("mtp"):
        assert llm.get_stats().spec_drafts > 0


def test_context_prefetch_switch_gives_same_bits(cp):
    """Chunked prefill gathers the prior context per layer: overlapped (prefetch) or not, same logits."""
    c, llm, _ = cp
    if c["dcp"] == 1:
        pytest.skip("DCP = 1 keeps the whole context on every rank: nothing to gather")
    core = llm.core
    core.scheduler.cfg = dataclasses.replace(core.scheduler.cfg, max_num_batched_tokens=40)
    try:
        ids = _ids(100, seed=7)
        results, volumes = [], []
        for prefetch in (True, False):
            set_kv_prefetch(core, prefetch)
            reset_comm_counters(core)
            results.append(llm.prompt_logits(ids))
            volumes.append([s["comm_bytes"].get("dcp_ctx", 0) for s in rank_stats(core)])
    finally:
        set_kv_prefetch(core, True)
        core.scheduler.cfg = dataclasses.replace(core.scheduler.cfg, max_num_batched_tokens=8192)
    assert torch.equal(results[0], results[1])
    assert volumes[0] == volumes[1] and min(volumes[0]) > 0


def test_dcp_merges_match_reference(cp):
    c, llm, _ = cp
    if c["dcp"] == 1:
        pytest.skip("no DCP merge with DCP = 1")
    for rank, res in enumerate(llm.core.collective_rpc(cp_checks.check_merges, 5)):
        for (dtype, backend), (err, inf_ok, lse_err, shape) in res.items():
            tol = 1e-5 if dtype == "torch.float32" else 3e-2
            assert err <= tol and lse_err <= 1e-5 and inf_ok, (rank, dtype, backend, err, lse_err)
            assert shape[0] == (3, 0, 5, 2)[rank], "each rank gets exactly its own rows"


def test_torchrun_launch_matches_single_rank(tiny_ckpt, refs, tmp_path):
    """torchrun starts both ranks (torchrun's rendezvous store, RANK/WORLD_SIZE/...): same tokens."""
    import json
    import subprocess
    import sys

    from engine.parallel.dist import free_port

    prompts = [_ids(n, seed=300 + n) for n in (3, 70)]
    out = tmp_path / "tokens.json"
    driver = ROOT / "tests" / "helpers" / "cp_torchrun_driver.py"
    root = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(driver), str(tiny_ckpt), json.dumps(prompts), str(out)]
    proc = subprocess.run(cmd, cwd=root, env={**__import__("os").environ, "PYTHONPATH": root},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == [
        o.token_ids for o in refs[0].generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]


def _whole_blocks(ref_core, ids: list[int], n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-rank engine's cache blocks of a prompt: what a kvstore holds for it."""
    _prefill_held(ref_core, ids, "kv-src")
    blocks = ref_core.kv.block_ids("kv-src")[:n_blocks]
    cache = ref_core.runner.kv_cache
    out = cache.mla[blocks].clone(), cache.index[blocks].clone()
    ref_core.release_held("kv-src")
    return out


def _decode_imported(core, ref, ids: list[int], n_tokens: int, write) -> None:
    """Admit `ids` with its first n_tokens' KV written by `write(block_ids)`; it must decode like `ref`."""
    req = Request("kv-imp", ids, dataclasses.replace(GREEDY, max_tokens=6))
    block_ids, n_cached = core.reserve_import(req, n_tokens)
    assert n_cached == 0
    write(block_ids)
    core.import_done("kv-imp", ok=True, num_tokens=n_tokens)
    got = []
    while core.has_unfinished():
        got += [t for o in core.step() if o.req_id == "kv-imp" for t in o.new_token_ids]
    (want,) = ref.generate([ids], dataclasses.replace(GREEDY, max_tokens=6))
    assert got == list(want.token_ids)


def test_kv_staged_through_rank0_for_dcp(cp):
    """DCP > 1, the prefill service's kvstore path: `services.transfer.staging.gather` assembles a held request's whole
    blocks on rank 0 (what is offloaded), and `scatter` hands whole blocks (what is loaded) to the ranks that
    hold their tokens; the request then decodes like the single-rank engine."""
    c, llm, ref = cp
    core = llm.core
    if c["dcp"] == 1:
        pytest.skip("DCP = 1 ranks hold full replicas (test_kv_written_on_rank0_replicates_to_every_rank)")
    prefix, tail = _ids(3 * 64, seed=93), _ids(29, seed=94)
    mla, index = _whole_blocks(ref.core, prefix, 3)
    assert core.collective_rpc(kv_staging_rpc.ensure, 4) == [4] * c["pcp"]
    staging = core.runner.kv_staging
    _prefill_held(core, prefix, "kv-held")
    core.collective_rpc(kv_staging_rpc.gather, core.kv.block_ids("kv-held"), 0, 3 * 64)
    core.release_held("kv-held")
    _close(staging.mla[:3], mla, "gathered mla blocks")
    _close(staging.index[:3], index, "gathered index blocks")

    other = _ids(3 * 64, seed=95)  # not in the prefix cache now
    mla, index = _whole_blocks(ref.core, other, 3)

    def write(block_ids):
        staging.mla.zero_()
        staging.index.zero_()
        staging.mla[:3], staging.index[:3] = mla, index
        core.collective_rpc(kv_staging_rpc.scatter, block_ids, 0, 3 * 64)
    _decode_imported(core, ref, other + tail, 3 * 64, write)


def test_kv_written_on_rank0_replicates_to_every_rank(cp):
    """The prefill service's kvstore load: a prefix's KV lands in rank 0's cache alone (one NIXL READ), then
    `replicate_blocks` copies it to every rank's replica (DCP = 1); the request then decodes exactly like
    the single-rank engine computing everything. With DCP > 1 blocks are sharded: replication refuses."""
    c, llm, ref = cp
    core = llm.core
    if c["dcp"] > 1:
        with pytest.raises(RuntimeError, match="shards every block"):
            core.collective_rpc("replicate_blocks", [0])
        return
    prefix, tail = _ids(3 * 64, seed=91), _ids(37, seed=92)
    mla, index = _whole_blocks(ref.core, prefix, 3)

    def write(block_ids):
        cache = core.runner.kv_cache  # rank 0 is this process
        cache.mla[block_ids[:3]], cache.index[block_ids[:3]] = mla, index
        before = core.collective_rpc(kv_pages.read_kv_rows, block_ids[:3], 3 * 64)
        assert not torch.equal(before[1]["mla"], before[0]["mla"]), "rank 1 must not hold the prefix before"
        assert core.collective_rpc("replicate_blocks", block_ids[:3]) == [3] * c["pcp"]
        after = core.collective_rpc(kv_pages.read_kv_rows, block_ids[:3], 3 * 64)
        for r in after[1:]:
            assert torch.equal(r["mla"], after[0]["mla"]) and torch.equal(r["index"], after[0]["index"])
    _decode_imported(core, ref, prefix + tail, 3 * 64, write)


def test_ep_dispatch_moves_one_copy_per_token_and_rank(cp):
    """PCP x EP prefill: the dispatcher's rows over all MoE layers = the (token, destination rank) pairs of
    the single-rank engine's routing of the same prompt (its tokens split over the ranks)."""
    from tests.helpers.ep_counts import dispatched_rows, reset_counters, routed_pairs

    c, llm, ref = cp
    if not c["ep"]:
        pytest.skip("no expert parallelism")
    ids = _ids(127, seed=5)
    reset_counters(llm.core)
    with routed_pairs(ref, c["pcp"]) as pairs:
        ref.prompt_logits(ids)
    llm.prompt_logits(ids)
    assert pairs[0] > 0 and dispatched_rows(llm.core, llm.config.model.hidden_size) == pairs[0]



def test_the_start_up_warm_up_runs_on_a_cp_engine(cp):
    """engine/core/warmup.py on a PCP x DCP x EP engine (the prefill host's): its pool free and its prefix cache empty
    afterwards, no KV event left, and the engine's greedy tokens still the single-rank engine's."""
    from engine.core.warmup import warm_up

    c, llm, ref = cp
    if not (c["dcp"] == 2 and c["ep"]):
        pytest.skip("one configuration with DCP, EP and MTP covers the multi-rank core")
    report = warm_up(llm.core, max_tokens=70, max_batch=3, long_context=False)
    assert 70 >= max(report.prefill_lengths) >= 65 and report.decode_batches == [1, 2, 3]
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks
    assert llm.core.drain_rank_kv_events() == [[]]
    prompts = [_ids(n, seed=300 + n) for n in (5, 129)]
    (first, second) = llm.generate(prompts, GREEDY)
    want = ref.generate(prompts, GREEDY)
    assert [first.token_ids, second.token_ids] == [w.token_ids for w in want]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
