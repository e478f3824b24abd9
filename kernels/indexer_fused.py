"""The fused indexer score kernel (fp8 keys): every index head in one fp8 MMA per key tile, the head sum on
chip, and per-group maxima that let the top-k skip its radix passes (`kernels.topk_threshold`).

Per program (tile of BLOCK_T query rows of one request, range of KEYS_PER_PROG keys), for each tile of
BLOCK_N keys:

    logits [BLOCK_N, N] = K [BLOCK_N, D] fp8  @  Q^T [D, N] fp8        N = BLOCK_T * H_PAD, column n = (t, h)
    score  [BLOCK_N, BLOCK_T] = sum_h  w[t, h] * ReLU(logits[:, (t, h)])  * k_scale
    gmax   [BLOCK_N / GROUP, BLOCK_T] = max of score over each GROUP of consecutive positions

and writes `score` (fp32, exactly the values the selection ranks) and `gmax`.

Why this shape (the legacy `_index_scores_kernel` put the (row, head) pairs on the M side instead):
* Keys are the M side, (row, head) pairs the N side. A wgmma accumulator row lives in the four lanes of
  one quad, so the sum over the 32 heads of a row is register adds plus two shuffles; with (row, head) as
  M, rows of the sum sit in different warps and the reshape-sum goes through shared memory. Triton maps
  the reshape of the MMA layout to a linear layout (no `convert_layout`), checked in the sm_90 TTGIR of
  both Triton 3.6 and 3.9.
* Q^T (BLOCK_T x 32 heads x 128 = 16 KB at BLOCK_T = 4) is loop-invariant: it stays in shared memory as
  the B operand, and the key tile, loaded once, meets every head of every row in one MMA. A per-head
  loop with M = rows (q_h [64 rows, D] @ K^T) would need all heads' queries resident (32 x 64 x 128 =
  256 KB, more than shared memory) or reload them for every key tile (256 KB per 128 keys, about 260
  FLOP per byte of L2 traffic), and would run 32 MMAs of K = 128 each followed by a serial epilogue.
* N = 128 keeps the wgmma's shared-memory reads (A 64x32 + B Nx32 bytes per instruction) under the
  128 B/clk an SM can feed at the fp8 rate. Triton places the wgmma wait right after each dot, so a
  program cannot overlap its own epilogue with its MMA (that needs warp specialisation); overlap comes
  from several small programs per SM instead: the default prefill tile (BLOCK_T 4, BLOCK_N 64, 4 warps,
  3 stages) compiles for sm_90a to 168 registers and 34 KB of shared memory under Triton 3.6 (three
  programs per SM) and 228 registers under 3.9.0 (two).
* A key tile never spans two cache blocks (BLOCK_N <= block size): one page lookup per tile, offsets
  that do not change across tiles, and unmasked copies (keys past the row's end are read from the same
  block and their scores dropped); masks are computed only on the tiles that cross a row's position.
* Keys are block-major (docs/kv-formats.md, "The indexer block"): a block's 64 x 128 value bytes, then its 64
  fp32 scales, so every key's values are a 16-byte aligned 128-byte row and a tile moves as 4 sixteen-byte
  cp.async per thread plus its scales. The 132-byte rows this replaced were only 4-byte aligned (17 four-byte
  copies per thread per tile): on the H200, same keys, same bits, the score kernel took 0.81-0.88x the time
  with block-major keys (prefill 8K / 128K / 1M, decode B = 64 x 128K; bench/data/kernels/indexer-layout/).
  Compiled for sm_90a the prefill loop has 423 instructions instead of 493 and 153 registers instead of 168
  under Triton 3.6, 161 instead of 228 under 3.9 (three programs per SM instead of two).
* What bounds it: the loop body for a full tile is ~400 instructions per warp against 4 wgmma that keep the
  SM's tensor cores busy for 256 clocks, so with three programs interleaved the issue slots allow well under
  the fp8 rate; most of them are the epilogue (ReLU, weight, head sum, group maxima: ~3 per logit). Triton
  waits for each dot, and overlapping the MMA with the epilogue in Gluon was measured slower (a Gluon
  version of this kernel, bitwise equal, 1.05-1.24x slower: two accumulators cost a third of the occupancy
  that hides the epilogue's latencies; bench/data/kernels/indexer-gluon/NOTES.md).
* Decode is the same kernel with BLOCK_T = 1 (N = 32 heads): one request's row over its whole context,
  split into KEYS_PER_PROG ranges over many programs, 4 pipeline stages of 64-key tiles, 80-106
  registers; at 62 FLOP per key byte it is bound by the key stream.

Tensors: q fp8 [T, H, D] (rows 4-byte aligned), w fp32 [T, H] with the q scale folded in; the key cache
layer [num_blocks, block_size, D + 4] uint8 (block-major) read through fp8 / fp32 views of its bytes; scores fp32
[rows, S] and gmax fp32 [rows, ceil(S / GROUP)] for rows [row_offset, row_offset + rows) (only positions
<= each row's position are written; group g is written when its first position is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.topk_threshold import SelectConfig, num_maxima, topk_threshold_rows
from kernels.triton_support import interpreting, jit, next_pow2


@jit(do_not_specialize=["row_offset", "s_bt"])  # s_bt: the step's block-table width
def _fused_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, tile_ptr, req_ptr, pos_ptr, score_ptr, gmax_ptr,
                         row_offset, num_heads, sq_t, sq_h, sw_t, sk_blk, sk_tok, s_bt, ss_row, sg_row,
                         BLOCK_SIZE: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr, KEYS_PER_PROG: tl.constexpr, GROUP: tl.constexpr,
                         DOT_F32: tl.constexpr):
    N: tl.constexpr = BLOCK_T * H_PAD
    row0 = tl.load(tile_ptr + 2 * tl.program_id(0)).to(tl.int64)
    num_rows = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < num_rows
    pos = tl.load(pos_ptr + row0 + t, mask=t_ok, other=-1).to(tl.int32)
    s_lo = tl.program_id(1) * KEYS_PER_PROG
    s_end = tl.minimum(tl.max(pos, axis=0) + 1, s_lo + KEYS_PER_PROG)
    pos_min = tl.min(tl.where(t_ok, pos, 2147483647), axis=0)
    if s_lo < s_end:
        c = tl.arange(0, N)
        c_ok = (c // H_PAD < num_rows) & (c % H_PAD < num_heads)
        q_rows = q_ptr + tl.multiple_of((row0 + c // H_PAD) * sq_t + (c % H_PAD) * sq_h, 4)
        q = tl.load(q_rows[:, None] + tl.arange(0, D)[None, :], mask=c_ok[:, None], other=0.0)  # [N, D]
        w = tl.load(w_ptr + (row0 + c // H_PAD) * sw_t + c % H_PAD, mask=c_ok, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        bt_row = bt_ptr + tl.load(req_ptr + row0).to(tl.int64) * s_bt
        score_rows = score_ptr + (row0 - row_offset + t) * ss_row
        gmax_rows = gmax_ptr + (row0 - row_offset + t) * sg_row
        # BLOCK_N divides BLOCK_SIZE and tiles start at multiples of BLOCK_N: a tile lies in one cache block,
        # so its keys sit at one base plus loop-invariant offsets (block-major: D-byte value rows, 16-byte
        # aligned, the block's scales after all of them)
        n = tl.arange(0, BLOCK_N)
        row_off = tl.multiple_of(n * D, 16)
        for s0 in range(s_lo, s_end, BLOCK_N):
            page = tl.load(bt_row + s0 // BLOCK_SIZE).to(tl.int64)
            # keys past s_end in the tile's block are read (valid memory), their scores never stored
            base = tl.multiple_of(page * sk_blk + (s0 % BLOCK_SIZE) * D, 16)
            k = tl.load(k_ptr + base + row_off[:, None] + tl.arange(0, D)[None, :])
            k_scale = tl.load(ks_ptr + (page * sk_blk + BLOCK_SIZE * D) // 4 + s0 % BLOCK_SIZE + n)
            if DOT_F32:
                k = k.to(tl.float32)
            logits = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_N, N]
            x = tl.maximum(logits, 0.0) * w[None, :]
            score = tl.sum(tl.reshape(x, [BLOCK_N, BLOCK_T, H_PAD]), axis=2) * k_scale[:, None]
            s = s0 + n
            g = s0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
            if s0 + BLOCK_N <= pos_min + 1:  # every key of the tile is causal for every row: no masks
                tl.store(score_rows[None, :] + s[:, None], score, mask=t_ok[None, :])
                gmax = tl.max(tl.reshape(score, [BLOCK_N // GROUP, GROUP, BLOCK_T]), axis=1)
                tl.store(gmax_rows[None, :] + g[:, None], gmax, mask=t_ok[None, :])
            else:
                valid = (s[:, None] <= pos[None, :]) & t_ok[None, :]
                tl.store(score_rows[None, :] + s[:, None], score, mask=valid)
                masked = tl.where(valid, score, float("-inf"))
                gmax = tl.max(tl.reshape(masked, [BLOCK_N // GROUP, GROUP, BLOCK_T]), axis=1)
                tl.store(gmax_rows[None, :] + g[:, None], gmax,
                         mask=(g[:, None] * GROUP <= pos[None, :]) & t_ok[None, :])


@dataclass(frozen=True)
class FusedConfig:
    """Tiles of the fused path: `block_t` caps the query rows per tile (N = block_t x H_PAD), `block_n` keys
    per MMA (at most the cache block size), `keys_per_prog` keys per program; `select` the top-k's (its
    `group` is the kernel's GROUP)."""
    block_t: int = 4
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    keys_per_prog: int = 8192
    select: SelectConfig = SelectConfig()

    def __post_init__(self):
        for name in ("block_t", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"FusedConfig.{name} = {v} must be a power of two")
        if self.block_n % self.select.group or self.keys_per_prog % self.block_n:
            raise ValueError("FusedConfig: select.group must divide block_n, and block_n keys_per_prog")


PREFILL = FusedConfig()
DECODE = FusedConfig(block_t=1, block_n=64, num_stages=4, keys_per_prog=4096)
INTERPRETED = FusedConfig(block_t=4, block_n=16, num_stages=1, keys_per_prog=64,
                          select=SelectConfig(group=4, sum_cap=64, gcap=64, cap=64, scan=32, block=32))


def _most_rows(query_start_loc_cpu: list[int] | None) -> int:
    if query_start_loc_cpu is None:
        return 1
    return max((b - a for a, b in zip(query_start_loc_cpu, query_start_loc_cpu[1:])), default=1)


def default_config(query_start_loc_cpu: list[int] | None) -> FusedConfig:
    """The decode tile when every request has one row, else the prefill tile; small under the interpreter."""
    if interpreting():
        return INTERPRETED
    return DECODE if _most_rows(query_start_loc_cpu) <= 1 else PREFILL


def tile_tensor(lo: int, hi: int, query_start_loc_cpu: list[int] | None, seq_lens_cpu: list[int] | None,
                topk: int, block_t: int, device: torch.device) -> torch.Tensor:
    """int32 [n, 2] (first row, rows <= block_t) tiles of rows [lo, hi) that never cross a request; requests
    whose whole context fits in the top-k need no scores (every position is selected). Without a host
    layout: one row per tile, built on the device."""
    if query_start_loc_cpu is None:
        rows = torch.arange(lo, hi, dtype=torch.int32, device=device)
        return torch.stack([rows, torch.ones_like(rows)], dim=1)
    tiles = []
    for b in range(len(query_start_loc_cpu) - 1):
        r0, r1 = max(lo, query_start_loc_cpu[b]), min(hi, query_start_loc_cpu[b + 1])
        if r0 >= r1 or (seq_lens_cpu is not None and seq_lens_cpu[b] <= topk):
            continue
        tiles += [(r, min(block_t, r1 - r)) for r in range(r0, r1, block_t)]
    host = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2)
    if device.type == "cuda":  # pinned + non_blocking: no host synchronisation
        return host.pin_memory().to(device, non_blocking=True)
    return host


def fused_indexer_topk(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                       token_req_idx: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, seq_len: int,
                       query_start_loc_cpu: list[int] | None, seq_lens_cpu: list[int] | None,
                       cfg: FusedConfig | None, max_score_bytes: int, return_slots: bool) -> None:
    """`indexer_topk` on the fused path: scores and maxima of a chunk of rows, then their threshold top-k."""
    T, width = q.shape[0], out.shape[1]
    cfg = cfg or default_config(query_start_loc_cpu)
    # two tile heights only, one row or the config's: a height per power of two of the step's rows would be one
    # more compiled variant for each (kernels/jit_variants.py), met first under traffic
    block_t = 1 if _most_rows(query_start_loc_cpu) <= 1 else cfg.block_t
    rows_per_chunk = max(block_t, max_score_bytes // (4 * seq_len))
    slots = dict(token_req_idx=token_req_idx, block_table=block_table) if return_slots else {}
    for lo in range(0, T, rows_per_chunk):
        hi = min(T, lo + rows_per_chunk)
        # rows padded to 16 values: the kernels' row strides stay multiples of 16 whatever the step's context,
        # so they compile one variant for every context length (kernels/jit_variants.py)
        scores = _padded_rows(hi - lo, seq_len, q.device)
        gmax = _padded_rows(hi - lo, num_maxima(seq_len, cfg.select), q.device)
        tiles = tile_tensor(lo, hi, query_start_loc_cpu, seq_lens_cpu, width, block_t, q.device)
        fused_scores(q, w, index_cache, block_table, token_req_idx, positions, tiles, scores, gmax, lo, block_t, cfg)
        topk_threshold_rows(scores, gmax, positions, width, out, lo, cfg.select, block_size=index_cache.shape[1],
                            **slots)


def _padded_rows(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, cols] whose row stride is `cols` rounded up to a multiple of 16."""
    return torch.empty((rows, -(-cols // 16) * 16), dtype=torch.float32, device=device)[:, :cols]


def fused_scores(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 token_req_idx: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor, scores: torch.Tensor,
                 gmax: torch.Tensor, row_offset: int, block_t: int, cfg: FusedConfig) -> None:
    """Scores and group maxima of the rows in `tiles` (int32 [n, 2]: first row, rows <= block_t).

    q: fp8 [T, H, D] (4-byte aligned strides, last dim contiguous); w fp32 [T, H] contiguous; index_cache a
    uint8 [num_blocks, block_size, D + 4] layer view of block-major keys (`kernels.formats.index_key_parts`)
    with contiguous blocks on 16-byte boundaries; scores fp32 [rows, S], gmax fp32 [rows, >= S / group].
    """
    T, H, D = q.shape
    if q.dtype != torch.float8_e4m3fn or q.stride(2) != 1 or q.stride(0) % 4 or q.stride(1) % 4:
        raise ValueError("q must be float8_e4m3fn with contiguous, 4-byte aligned rows")
    if index_cache.dtype != torch.uint8 or index_cache.shape[2] != D + 4 or index_cache.stride(2) != 1:
        raise ValueError(f"the fused indexer reads fp8 key rows [.., .., {D + 4}] uint8, got "
                         f"{index_cache.dtype} {tuple(index_cache.shape)}")
    sb, st = index_cache.stride(0), index_cache.stride(1)
    if st != D + 4 or sb % 16 or D % 16 or index_cache.data_ptr() % 16:
        raise ValueError(f"a block-major key cache needs contiguous blocks starting on 16-byte boundaries and "
                         f"D a multiple of 16, got D = {D}, strides {tuple(index_cache.stride())}")
    if scores.stride(1) != 1 or gmax.stride(1) != 1 or gmax.shape[1] * cfg.select.group < scores.shape[1]:
        raise ValueError("scores and gmax need contiguous rows, gmax one column per group of scores")
    bs = index_cache.shape[1]
    block_n = min(cfg.block_n, bs)  # a key tile never spans two cache blocks
    if bs & (bs - 1) or block_n % cfg.select.group:
        raise ValueError(f"the fused indexer needs a power-of-two cache block size of at least the group "
                         f"({cfg.select.group}), got {bs}")
    if tiles.shape[0] == 0:
        return
    span = sb * (index_cache.shape[0] - 1) + st * (index_cache.shape[1] - 1) + D + 4
    flat = index_cache.as_strided((span,), (1,))
    h_pad = max(16, next_pow2(H))
    grid = (tiles.shape[0], triton.cdiv(scores.shape[1], cfg.keys_per_prog))
    _fused_scores_kernel[grid](
        q, w, flat.view(torch.float8_e4m3fn), flat.view(torch.float32), block_table, tiles, token_req_idx,
        positions, scores, gmax, row_offset, H, q.stride(0), q.stride(1), w.stride(0), sb, st,
        block_table.stride(0), scores.stride(0), gmax.stride(0),
        BLOCK_SIZE=bs, D=D, H_PAD=h_pad, BLOCK_T=block_t, BLOCK_N=block_n,
        KEYS_PER_PROG=cfg.keys_per_prog, GROUP=cfg.select.group, DOT_F32=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
