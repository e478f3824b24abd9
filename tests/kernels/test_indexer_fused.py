"""Fused indexer: the score kernel's group maxima, decode-shaped batches, exact ties, the graph-safe path.

The scores themselves are checked against `index_scores_ref` in test_indexer.py (both implementations);
here the maxima must equal the kernel's own scores bit for bit, and every selection must be exactly the
stable descending sort of the scores the kernel computed (same tiling: one row per tile).
"""

from __future__ import annotations

import pytest
import torch

from kernels.formats import read_index_rows, write_index_rows
from kernels.indexer import _prepare, index_scores, indexer_topk, topk_positions_ref
from kernels.indexer_fused import INTERPRETED, PREFILL, FusedConfig, fused_scores, tile_tensor
from kernels.topk_threshold import SelectConfig, num_maxima
from tests.helpers.kernel_inputs import as_sets, gpu, interp
from tests.kernels.test_indexer import make_batch, ref_scores


def check_maxima(device, seq_lens, rows, H, D, block_size, cfg: FusedConfig, eps: float) -> torch.Tensor:
    """Host-layout tiles of up to cfg.block_t rows: scores close to the reference, maxima exact, and nothing
    written past a row's position (sentinels stay). Returns the scores."""
    bt = make_batch("fp8", seq_lens, rows, H, D, block_size, spare_blocks=3, device=device)
    S = max(seq_lens)
    q, w, _ = _prepare(bt.q, bt.w, bt.cache, None)
    sentinel = 12345.0
    scores = torch.full((len(bt.pos), S), sentinel, device=device)
    gmax = torch.full((len(bt.pos), num_maxima(S, cfg.select)), sentinel, device=device)
    tiles = tile_tensor(0, len(bt.pos), bt.qsl, None, 0, cfg.block_t, torch.device(device))
    assert int(tiles[:, 1].max()) > 1, "no multi-row tile: the case does not test the N = rows x heads layout"
    fused_scores(q, w, bt.cache, bt.table, bt.req, bt.pos, tiles, scores, gmax, 0, cfg.block_t, cfg)
    want = ref_scores(bt, S)
    live = torch.isfinite(want)
    assert torch.all(scores[~live] == sentinel), "scores written past a row's position"
    scale = want.masked_fill(~live, 0).abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    err = ((scores - want).masked_fill(~live, 0).abs() / scale).max().item()
    assert err <= eps, f"scores differ by {err:.3g} of the row scale"
    G = cfg.select.group
    cols = gmax.shape[1]
    padded = torch.full((len(bt.pos), cols * G), float("-inf"), device=device)
    padded[:, :S] = scores.masked_fill(~live, float("-inf"))
    expect = padded.view(len(bt.pos), cols, G).amax(dim=2)
    written = torch.arange(cols, device=device)[None, :] * G <= bt.pos[:, None]
    assert torch.equal(gmax[written], expect[written]), "group maxima differ from the kernel's own scores"
    assert torch.all(gmax[~written] == sentinel), "maxima written past a row's groups"
    return scores


def decode_batch(device, seq_lens: list[int], H: int, D: int, block_size: int, dup_every: int):
    """One query row per request at its last position; every `dup_every`-th key copies an earlier one, so
    equal scores (exact ties) are common."""
    bt = make_batch("fp8", seq_lens, [[S - 1] for S in seq_lens], H, D, block_size, spare_blocks=5, device=device)
    bs = block_size
    for b, S in enumerate(seq_lens):
        dst = torch.arange(dup_every, S, dup_every, device=device)
        src = dst // 3
        tb = bt.table[b].long()
        write_index_rows(bt.cache, tb[dst // bs], dst % bs, read_index_rows(bt.cache, tb[src // bs], src % bs))
    return bt


def check_decode(device, seq_lens, H, D, topk, block_size, config: FusedConfig | None) -> None:
    bt = decode_batch(device, seq_lens, H, D, block_size, dup_every=5)
    S = max(seq_lens)
    scores = index_scores(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, S, impl="fused", config=config)
    want = as_sets(topk_positions_ref(scores, bt.pos, topk))
    flat = scores[torch.isfinite(scores)]
    assert flat.numel() - torch.unique(flat).numel() > 0, "no exact ties: the case does not test tie-breaking"
    common = dict(return_slots=False, impl="fused", config=config)
    runner = indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, max_seq_len=S,
                          query_start_loc_cpu=bt.qsl, seq_lens_cpu=bt.seq_lens, **common)
    assert as_sets(runner) == want, "decode (host layout) differs from the exact top-k of the kernel's scores"
    bound = S + 3 * block_size  # graph-safe: sized by a bound, no host layout, padded width
    graph = indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, max_seq_len=bound,
                         out_width=min(topk, bound), **common)
    assert as_sets(graph) == want and graph.shape[1] == min(topk, bound)
    short = [(t, n) for t, n in enumerate(seq_lens) if n < topk]
    assert short and all(bool(torch.all(runner[t, n:] == -1)) for t, n in short), "rows short of k: -1 padding"


@interp
def test_fused_maxima_interp():
    rows = [[5, 40, 41, 42, 43, 119], [20, 21, 22, 23], [7]]
    check_maxima("cpu", [120, 24, 8], rows, H=16, D=32, block_size=16, cfg=INTERPRETED, eps=1e-5)


@interp
@pytest.mark.parametrize("programs", [1, 4])
def test_fused_decode_interp(programs):
    cfg = FusedConfig(block_t=1, block_n=16, num_stages=1, keys_per_prog=32,
                      select=SelectConfig(group=4, sum_cap=64, gcap=64, cap=64, scan=32, block=32, programs=programs))
    check_decode("cpu", [300, 37, 180, 9, 250], H=16, D=32, topk=24, block_size=16, config=cfg)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_fused_maxima_gpu(mark):
    rows = [list(range(60_000 - 8, 60_000)), [9_000, 9_001, 9_002], [500]]
    check_maxima("cuda", [60_000, 9_003, 501], rows, H=32, D=128, block_size=64, cfg=PREFILL, eps=1e-2)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_fused_decode_gpu(mark):
    # a decode batch over a 128K context and shorter ones (threshold, direct and all-positions rows)
    check_decode("cuda", [131_072, 100_000, 7_000, 1_500, 65_536, 2_049], H=32, D=128, topk=2048, block_size=64,
                 config=None)


@interp
def test_fused_rejects_bad_input_interp():
    bt = make_batch("fp32", [40], [[39]], H=16, D=32, block_size=16, spare_blocks=1, device="cpu")
    with pytest.raises(ValueError, match="fp32 index cache"):
        indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, 8, impl="fused")
    with pytest.raises(ValueError, match="impl must be"):
        indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, 8, impl="bitonic")
    with pytest.raises(ValueError, match="power of two"):
        SelectConfig(cap=1000)
    with pytest.raises(ValueError, match="must divide"):
        FusedConfig(block_n=16, select=SelectConfig(group=32))
