"""DCP kvstore staging (`services.transfer.staging`) with fp8 KV over real ranks (gloo).

Its own module: a process holds one multi-rank engine at a time, and the module-scoped engines of
test_cp_engine live until that module ends."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.parallel.spawn import RankPool
from kernels.formats import read_index_rows
from services.transfer import staging as kv_staging_rpc
from tests.engine.parallel.test_cp_engine import _ids, _prefill_held
from tests.helpers.kv_pages import rank_kv_rows

pytestmark = pytest.mark.xdist_group("cp")  # one process group per process: keep these on one worker


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool()
    yield pool
    pool.close()


def test_fp8_keys_staged_through_rank0_move_by_token(tiny_ckpt, rank_pool):
    """DCP = 2 with fp8 KV, whose indexer keys are block-major (a token's key is not the [block, :, token] entry):
    `gather` puts every token's MLA row and key, read on the rank that holds it, at the token's position in rank
    0's staging blocks, and `scatter` puts staged rows back at the ranks' slots, byte for byte."""
    llm = LLM(str(tiny_ckpt), rank_pool=rank_pool, prefill_context_parallel_size=2, decode_context_parallel_size=2,
              cp_kv_cache_interleave_size=1, device="cpu", dtype="float32", kv_cache_dtype="fp8_ds_mla",
              num_blocks=96)
    try:
        core = llm.core
        assert core.runner.kv_cache.spec.index_key_layout == "block-major"
        n = 3 * 64
        pos = torch.arange(n)
        _prefill_held(core, _ids(n, seed=97), "kv-held")
        blocks = core.kv.block_ids("kv-held")
        assert core.collective_rpc(kv_staging_rpc.ensure, 4) == [4, 4]
        staging = core.runner.kv_staging
        core.collective_rpc(kv_staging_rpc.gather, blocks, 0, n)
        staged_keys = read_index_rows(staging.index, pos // 64, pos % 64)
        staged_mla = staging.mla[pos // 64, :, pos % 64]
        held = rank_kv_rows(core, "kv-held")
        assert sorted(p for r in held for p in r["positions"]) == pos.tolist()
        for r in held:
            assert torch.equal(staged_keys[r["positions"]], r["index"]), f"rank {r['rank']}: gathered keys"
            assert torch.equal(staged_mla[r["positions"]], r["mla"]), f"rank {r['rank']}: gathered MLA rows"

        gen = torch.Generator().manual_seed(5)  # other bytes in the staged blocks -> the ranks' slots
        staging.index.copy_(torch.randint(0, 256, staging.index.shape, generator=gen, dtype=torch.uint8))
        staging.mla.copy_(torch.randint(0, 256, staging.mla.shape, generator=gen, dtype=torch.uint8))
        core.collective_rpc(kv_staging_rpc.scatter, blocks, 0, n)
        staged_keys = read_index_rows(staging.index, pos // 64, pos % 64)
        staged_mla = staging.mla[pos // 64, :, pos % 64]
        for r in rank_kv_rows(core, "kv-held"):
            assert torch.equal(r["index"], staged_keys[r["positions"]]), f"rank {r['rank']}: scattered keys"
            assert torch.equal(r["mla"], staged_mla[r["positions"]]), f"rank {r['rank']}: scattered MLA rows"
        core.release_held("kv-held")
    finally:
        llm.core.shutdown()
