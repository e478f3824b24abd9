"""The indexer's prefill score kernel in Gluon (Hopper): each key tile's MMA runs while the previous tile's
epilogue does, the overlap the Triton kernel (`kernels.indexer_fused`) cannot express.

Same contract, outputs and arithmetic as `indexer_fused._fused_scores_kernel` (scores fp32 [rows, S] and group
maxima), for its prefill tile only: 4 query rows x 32 index heads (N = 128 MMA columns), 64-key tiles of 128-dim
fp8 keys. Why Gluon, and this structure:

* The Triton kernel's loop body is about 45% MMA-bound work and 55% epilogue (ReLU, head weights, the head sum,
  group maxima, stores); Triton waits for each `tl.dot` right after issuing it, so one program alternates MMA and
  epilogue and the tensor cores idle during the epilogue (44-45% of the fp8 rate at S >= 128K on the H200).
  Gluon exposes the asynchronous wgmma: tile i's MMA is issued and tile i - 1's epilogue runs on the same warps
  while it is in flight. Two accumulators alternate (the loop is unrolled by two so each keeps its registers;
  none is zeroed in the loop). ptxas serialises every wgmma of a kernel in which it cannot prove an
  accumulator untouched while its MMA is pending (warning C7514): a `wait(1)` whose pending MMA was issued in
  the previous iteration, or zeros copied from an accumulator register on the loop's skip path, both did that;
  the loop therefore waits for all MMAs (`wait(0)`, only the previous tile's is pending) before each pair.
  sm_90a build (checked in CI): 234 registers under Triton 3.6, 255 under 3.9, no spills, 50 KB of shared
  memory: two programs per SM.
* Keys arrive by cp.async (the 132-byte rows are only 4-byte aligned, so no TMA) into a ring of STAGES tiles in
  the wgmma's 128-byte swizzled layout; a slot is refilled once the MMA that read it has been waited for.
  Q^T (128 x 128 fp8, 16 KB) stays in shared memory as the B operand for the whole program.
* One warpgroup per program (4 warps, two accumulators of 64 fp32 each per thread), several programs per SM.
  Full warp specialisation (a producer warp and two consumer warpgroups) would free the consumers from issuing
  the copies (about 15% of the loop); not needed for the overlap itself.

Measured on the H200 (bench/data/kernels/indexer-gluon/NOTES.md, `python -m bench.kernels.gluon_ab`): scores
bitwise equal to the Triton kernel's, and slower: 4,259 against 3,447 us at S = 128K (1.24x), 1.11x at 1M,
1.05x at 8K. The tensor cores were not the limit: the Triton kernel spends ~3x the MMA's cycles per tile on the
epilogue's instructions and their latencies, hidden by three programs (12 warps) per SM; two accumulators cost
this kernel a third of that occupancy. So the Triton kernel stays the default everywhere; `PDSERVE_INDEXER_GLUON=1`
runs this one on sm_90 (kept, tested, as the base for a form with a shorter epilogue).

Triton 3.6 names the copy `async_copy_global_to_shared` and the barrier `thread_barrier`, later versions
`async_load` and `barrier`; both are accepted. The Triton kernel is the path everywhere else (CPU interpreter,
other GPUs, other tiles, decode).
"""

from __future__ import annotations

import torch

from kernels._jit import env_flag, interpreting

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
except ImportError:  # a Triton without Gluon: the Triton kernel runs
    gluon = None

BLOCK_T = 4
H_PAD = 32
D = 128
BLOCK_N = 64
STAGES = 4
NUM_WARPS = 4
DEFAULT = False  # PDSERVE_INDEXER_GLUON's default: off, measured slower than the Triton kernel
MAXNREG: int | None = None  # a register cap for the launch (None: the compiler's choice)

if gluon is not None:
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 / 3.6

    @gluon.jit
    def _landed(STAGES: gl.constexpr):
        """The oldest pending key tile is in shared memory and visible to the wgmma: every thread's copies done,
        each thread's proxy fence (cp.async writes through the generic proxy, wgmma reads through the async one),
        then a barrier, the order the Triton kernel's pipeline uses."""
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        _barrier()

    @gluon.jit
    def _issue(k_smem, k_ptr, bt_row, s_lo, tile, n_tiles, sk_blk, sk_tok, off, rows,
               BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """cp.async of key tile `tile` (its 64 rows of 128 fp8 values) into ring slot tile % STAGES; a tile past
        the last is a masked copy (zeros), so every iteration commits one group."""
        s0 = s_lo + tile * BLOCK_N
        ok = tile < n_tiles
        page = gl.load(bt_row + s0 // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        base = gl.multiple_of(page * sk_blk + (s0 % BLOCK_SIZE) * sk_tok, 4)
        _async_load(k_smem.index(tile % STAGES), k_ptr + base + off, mask=(rows < BLOCK_N) & ok)
        cp.commit_group()

    @gluon.jit
    def _scale(ks_ptr, bt_row, s_lo, tile, n_tiles, sk_blk, sk_tok, n,
               BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """The fp32 scales of key tile `tile` (read one iteration before its epilogue uses them)."""
        s0 = s_lo + tile * BLOCK_N
        ok = tile < n_tiles
        page = gl.load(bt_row + s0 // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        base = page * sk_blk + (s0 % BLOCK_SIZE) * sk_tok
        return gl.load(ks_ptr + (base + D) // 4 + n * (sk_tok // 4), mask=(n < BLOCK_N) & ok, other=0.0)

    @gluon.jit
    def _epilogue(acc, w, k_scale, s0, s_end, score_rows, gmax_ptrs, pos, pos_g, pos_min, t_ok, ok_g,
                  SCORE_L: gl.constexpr, GMAX_L: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr,
                  H_PAD: gl.constexpr, GROUP: gl.constexpr):
        """ReLU, head weights, head sum, key scale; scores and group maxima of tile s0 (nothing past s_end)."""
        if s0 < s_end:
            x = gl.maximum(acc, 0.0) * w[None, :]
            score = gl.convert_layout(gl.sum(gl.reshape(x, [BLOCK_N, BLOCK_T, H_PAD]), axis=2), SCORE_L)
            score = score * k_scale[:, None]
            s = s0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCORE_L))
            g = s0 // GROUP + gl.arange(0, BLOCK_N // GROUP, layout=gl.SliceLayout(1, GMAX_L))
            if (s0 + BLOCK_N <= pos_min + 1) & (s0 + BLOCK_N <= s_end):  # every key causal for every row
                gl.store(score_rows[None, :] + s[:, None], score, mask=t_ok[None, :])
                gmax = gl.max(gl.reshape(score, [BLOCK_N // GROUP, GROUP, BLOCK_T]), axis=1)
                gl.store(gmax_ptrs[None, :] + g[:, None], gl.convert_layout(gmax, GMAX_L), mask=ok_g[None, :])
            else:
                valid = (s[:, None] <= pos[None, :]) & (s[:, None] < s_end) & t_ok[None, :]
                gl.store(score_rows[None, :] + s[:, None], score, mask=valid)
                masked = gl.where(valid, score, float("-inf"))
                gmax = gl.max(gl.reshape(masked, [BLOCK_N // GROUP, GROUP, BLOCK_T]), axis=1)
                gl.store(gmax_ptrs[None, :] + g[:, None], gl.convert_layout(gmax, GMAX_L),
                         mask=(g[:, None] * GROUP <= pos_g[None, :]) & (g[:, None] * GROUP < s_end) & ok_g[None, :])

    @gluon.jit
    def _gluon_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, tile_ptr, req_ptr, pos_ptr, score_ptr, gmax_ptr,
                             row_offset, num_heads, sq_t, sq_h, sw_t, sk_blk, sk_tok, s_bt, ss_row, sg_row,
                             BLOCK_SIZE: gl.constexpr, D: gl.constexpr, H_PAD: gl.constexpr, BLOCK_T: gl.constexpr,
                             BLOCK_N: gl.constexpr, KEYS_PER_PROG: gl.constexpr, GROUP: gl.constexpr,
                             STAGES: gl.constexpr):
        N: gl.constexpr = BLOCK_T * H_PAD
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
        SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        COPY: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # a warp copies one 128-byte row
        SCORE_L: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])  # keys along lanes
        GMAX_L: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [0, 1])
        ROWS_L: gl.constexpr = gl.SliceLayout(0, SCORE_L)

        row0 = gl.load(tile_ptr + 2 * gl.program_id(0)).to(gl.int64)
        num_rows = gl.load(tile_ptr + 2 * gl.program_id(0) + 1)
        t = gl.arange(0, BLOCK_T, layout=ROWS_L)
        t_ok = t < num_rows
        pos = gl.load(pos_ptr + row0 + t, mask=t_ok, other=-1).to(gl.int32)
        s_lo = gl.program_id(1) * KEYS_PER_PROG
        s_end = gl.minimum(gl.max(pos, axis=0) + 1, s_lo + KEYS_PER_PROG)
        pos_min = gl.min(gl.where(t_ok, pos, 2147483647), axis=0)
        if s_lo < s_end:
            n_tiles = gl.cdiv(s_end - s_lo, BLOCK_N)
            # Q^T: the (row, head) pairs' queries, [N, D] K-major in shared memory for the whole program
            c = gl.arange(0, N, layout=gl.SliceLayout(1, COPY))
            c_ok = (c // H_PAD < num_rows) & (c % H_PAD < num_heads)
            q_rows = q_ptr + (row0 + c // H_PAD) * sq_t + (c % H_PAD) * sq_h
            d = gl.arange(0, D, layout=gl.SliceLayout(0, COPY))
            q = gl.load(q_rows[:, None] + d[None, :], mask=c_ok[:, None], other=0.0)
            q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [N, D], SMEM)
            q_smem.store(q)
            cw = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
            w = gl.load(w_ptr + (row0 + cw // H_PAD) * sw_t + cw % H_PAD,
                        mask=(cw // H_PAD < num_rows) & (cw % H_PAD < num_heads), other=0.0)
            qt = q_smem.permute((1, 0))

            bt_row = bt_ptr + gl.load(req_ptr + row0).to(gl.int64) * s_bt
            score_rows = score_ptr + (row0 - row_offset + t) * ss_row
            t_g = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, GMAX_L))
            ok_g = t_g < num_rows
            pos_g = gl.load(pos_ptr + row0 + t_g, mask=ok_g, other=-1).to(gl.int32)
            gmax_ptrs = gmax_ptr + (row0 - row_offset + t_g) * sg_row
            rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY))
            off = gl.multiple_of(rows * sk_tok, 4)[:, None] + d[None, :]  # rows of 132 bytes: 4-byte aligned
            n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCORE_L))

            k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, BLOCK_N, D], SMEM)
            for j in gl.static_range(STAGES - 1):
                _issue(k_smem, k_ptr, bt_row, s_lo, j, n_tiles, sk_blk, sk_tok, off, rows[:, None],
                       BLOCK_SIZE, BLOCK_N, STAGES)
            fence_async_shared()  # Q^T's stores before the wgmma reads it

            # Two accumulators, both zero before any MMA is in flight (ptxas serialises every wgmma of a
            # kernel that touches an accumulator while one is pending); the loop runs tiles in pairs, each
            # MMA in flight while the other accumulator's tile goes through the epilogue. Tiles -1 and
            # n_tiles (a masked copy) have no epilogue.
            # (the empty wait pins both to their own registers here: without it the compiler materialises the
            # zeros of the loop's skip path from an accumulator register, which ptxas counts as such a touch)
            acc_a, acc_b = warpgroup_mma_wait(0, deps=(gl.zeros([BLOCK_N, N], gl.float32, MMA),
                                                       gl.zeros([BLOCK_N, N], gl.float32, MMA)))
            acc_b = warpgroup_mma_init(acc_b)  # carried in flight from one iteration to the next
            ks_b = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, SCORE_L))
            for i in range(0, n_tiles, 2):
                # tile i - 1's MMA is the only one in flight: waiting for all of them here (not for all but one
                # after the next issue) keeps ptxas from serialising the wgmmas, and costs no overlap: the tensor
                # cores run one MMA of the warpgroup at a time anyway
                acc_b = warpgroup_mma_wait(0, deps=(acc_b,))
                _landed(STAGES)
                acc_a = warpgroup_mma(k_smem.index(i % STAGES), qt, acc_a, use_acc=False, is_async=True)
                _issue(k_smem, k_ptr, bt_row, s_lo, i + STAGES - 1, n_tiles, sk_blk, sk_tok, off, rows[:, None],
                       BLOCK_SIZE, BLOCK_N, STAGES)
                ks_a = _scale(ks_ptr, bt_row, s_lo, i, n_tiles, sk_blk, sk_tok, n, BLOCK_SIZE, BLOCK_N, D)
                if i > 0:
                    _epilogue(acc_b, w, ks_b, s_lo + (i - 1) * BLOCK_N, s_end, score_rows, gmax_ptrs, pos, pos_g,
                              pos_min, t_ok, ok_g, SCORE_L, GMAX_L, BLOCK_N, BLOCK_T, H_PAD, GROUP)

                _landed(STAGES)
                acc_b = warpgroup_mma(k_smem.index((i + 1) % STAGES), qt, acc_b, use_acc=False, is_async=True)
                acc_a = warpgroup_mma_wait(1, deps=(acc_a,))
                _issue(k_smem, k_ptr, bt_row, s_lo, i + STAGES, n_tiles, sk_blk, sk_tok, off, rows[:, None],
                       BLOCK_SIZE, BLOCK_N, STAGES)
                ks_b = _scale(ks_ptr, bt_row, s_lo, i + 1, n_tiles, sk_blk, sk_tok, n, BLOCK_SIZE, BLOCK_N, D)
                _epilogue(acc_a, w, ks_a, s_lo + i * BLOCK_N, s_end, score_rows, gmax_ptrs, pos, pos_g, pos_min,
                          t_ok, ok_g, SCORE_L, GMAX_L, BLOCK_N, BLOCK_T, H_PAD, GROUP)
            # acc_b holds tile 2 * cdiv(n_tiles, 2) - 1: the last tile, or one past it (masked copy, no epilogue)
            acc_b = warpgroup_mma_wait(0, deps=(acc_b,))
            cp.wait_group(0)
            _epilogue(acc_b, w, ks_b, s_lo + (2 * gl.cdiv(n_tiles, 2) - 1) * BLOCK_N, s_end, score_rows,
                      gmax_ptrs, pos, pos_g, pos_min, t_ok, ok_g, SCORE_L, GMAX_L, BLOCK_N, BLOCK_T, H_PAD, GROUP)


def supported(device: torch.device, block_t: int, num_heads: int, head_dim: int, block_n: int) -> bool:
    """True where the Gluon kernel runs: a Hopper GPU (sm_90), the prefill tile (4 rows x <= 32 heads x 128,
    64-key tiles), Gluon present, and PDSERVE_INDEXER_GLUON set to 1 (off by default: slower, see above)."""
    if gluon is None or device.type != "cuda" or interpreting() or not env_flag("PDSERVE_INDEXER_GLUON", DEFAULT):
        return False
    return (torch.cuda.get_device_capability(device) == (9, 0) and block_t == BLOCK_T and num_heads <= H_PAD
            and head_dim == D and block_n == BLOCK_N)


def launch(grid, q, w, k_fp8, k_f32, block_table, tiles, token_req_idx, positions, scores, gmax, row_offset,
           num_heads, sb, st, bs, keys_per_prog, group) -> None:
    """The Gluon kernel over `grid` with the Triton kernel's arguments (see `indexer_fused.fused_scores`)."""
    _gluon_scores_kernel[grid](
        q, w, k_fp8, k_f32, block_table, tiles, token_req_idx, positions, scores, gmax, row_offset, num_heads,
        q.stride(0), q.stride(1), w.stride(0), sb, st, block_table.stride(0), scores.stride(0), gmax.stride(0),
        BLOCK_SIZE=bs, D=D, H_PAD=H_PAD, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, KEYS_PER_PROG=keys_per_prog,
        GROUP=group, STAGES=STAGES, num_warps=NUM_WARPS, **({"maxnreg": MAXNREG} if MAXNREG else {}))
