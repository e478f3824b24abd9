"""kv_b_proj's FP8 block-scaled weight dequantized for MLA's absorbed matmuls, once per layer forward.

kv_b_proj.weight is float8_e4m3fn [H * (nope + v), R] with fp32 scales [ceil(H (nope + v) / 128), ceil(R / 128)];
head h owns rows h (nope + v) + [0, nope) (W_UK_h) and the next v rows (W_UV_h). The absorbed path multiplies
per head (q_lat = W_UK_h^T q_nope_h, o_h = W_UV_h lat_h), and head boundaries do not fall on 128-row scale
blocks (nope + v = 448 for GLM-5.3), so it runs as bf16 batched matmuls on a dequantized copy made by
`dequantize_fp8` right before them: one bandwidth-bound pass (read 1 B, write 2 B per element) into a
temporary the caching allocator hands from layer to layer. Storage stays FP8 (engine/model/fp8.py says why).

Each program dequantizes a [BLOCK_R, 128] tile inside one 128 x 128 scale block: one scale per program.

At decode sizes the pass and the bf16 copy it writes cost more than the matmuls: per GLM-5.3 layer the copy is
14.7 MB read and 29.4 MB written, then 29.4 MB read again, for a handful of rows. `absorbed_matmul` instead reads
the FP8 rows where it multiplies them: program (h, n-tile) loads head h's [k, n] (W_UK) or [n, k] (W_UV) tiles,
dequantizes each to the bf16 values the copy would hold (one scale a tile: 64 rows starting at a multiple of 64
lie in one 128-row block where nope and v are multiples of 64, as GLM-5.3's are; else a scale per element),
and multiplies them into fp32 sums for every row of x. Against the copy and a bf16 matmul the result differs
only in the order of the sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import BLOCK, dequantize_weight_ref
from kernels.triton_support import check_device, interpreting, jit, to_bf16


@jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, sw, ss, so, BLOCK_R: tl.constexpr, ROUND_FIRST: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = (r[:, None] < N) & (c[None, :] < K)
    s = tl.load(s_ptr + ((tl.program_id(0) * BLOCK_R) // 128) * ss + tl.program_id(1))
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * sw + c[None, :], mask=m, other=0.0).to(tl.float32) * s
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = to_bf16(w, ROUND_FIRST)
    else:
        v = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r[:, None].to(tl.int64) * so + c[None, :], v, mask=m)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float8_e4m3fn [N, K] with fp32 scales [ceil(N/128), ceil(K/128)] -> `dtype` [N, K] (Triton)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    want = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    check_device(weight, scale)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale = scale.contiguous()
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    block_r = 32
    grid = (triton.cdiv(N, block_r), triton.cdiv(K, BLOCK))
    _dequant_kernel[grid](weight, scale, out, N, K, weight.stride(0), scale.stride(0), out.stride(0),
                          BLOCK_R=block_r, ROUND_FIRST=interpreting(), num_warps=4)
    return out


def absorbed_weights(weight: torch.Tensor, scale: torch.Tensor, num_heads: int, nope: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, R] and W_UV [H, v, R] in `dtype`: views of one dequantized copy (Triton on CUDA)."""
    w = dequantize_fp8(weight, scale, dtype) if weight.is_cuda else dequantize_weight_ref(weight, scale, dtype)
    w = w.view(num_heads, -1, weight.shape[1])
    return w[:, :nope], w[:, nope:]


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize_weight_ref(weight, scale, dtype)


@jit
def _absorbed_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, row0, rows_per_head, sx_t, sx_h, so_t, so_h, sw, ss,
                     TRANS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ONE_SCALE: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """out[t, h, n] = sum_k x[t, h, k] * W_h[k, n] with W_h the dequantized rows row0 + h * rows_per_head + ...:
    TRANS_W False (W_UK) those rows are k and the columns n; TRANS_W True (W_UV) the rows are n, the columns k.
    ONE_SCALE: every tile lies in one 128 x 128 scale block (one scale load); else a scale per element."""
    h = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    base = row0 + h * rows_per_head
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < T
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xv = tl.load(x_ptr + t[:, None].to(tl.int64) * sx_t + h * sx_h + k[None, :],
                         mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            wk = k_ok[:, None] & n_ok[None, :]
            if TRANS_W:  # the tile [k, n] from weight rows base + n, columns k
                rows = (base + n).to(tl.int64)
                w = tl.load(w_ptr + rows[None, :] * sw + k[:, None], mask=wk, other=0.0)
                if ONE_SCALE:
                    s = tl.load(s_ptr + ((base + pid_n * BLOCK_N) // 128) * ss + k0 // 128)
                else:
                    s = tl.load(s_ptr + (rows // 128)[None, :] * ss + (k // 128)[:, None], mask=wk, other=0.0)
            else:  # the tile [k, n] from weight rows base + k, columns n
                rows = (base + k).to(tl.int64)
                w = tl.load(w_ptr + rows[:, None] * sw + n[None, :], mask=wk, other=0.0)
                if ONE_SCALE:
                    s = tl.load(s_ptr + ((base + k0) // 128) * ss + (pid_n * BLOCK_N) // 128)
                else:
                    s = tl.load(s_ptr + (rows // 128)[:, None] * ss + (n // 128)[None, :], mask=wk, other=0.0)
            wd = to_bf16(w.to(tl.float32) * s, ROUND_FIRST)  # the bf16 copy's values
            if DOT_F32:
                acc += tl.dot(xv.to(tl.float32), wd.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xv, wd)
        tl.store(out_ptr + t[:, None].to(tl.int64) * so_t + h * so_h + n[None, :],
                 to_bf16(acc, ROUND_FIRST), mask=t_ok[:, None] & n_ok[None, :])


# up to this many rows the in-place read wins (H100: 14.0 / 13.9 / 15.9 us against 24.8 / 26.1 / 31.2 us for the
# copy and the two einsums at 4 / 16 / 64 rows); at 256 rows they tie (48.2 / 47.0 us), above the copy wins
ABSORBED_MAX_ROWS = 64


def absorbed_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, num_heads: int, nope: int,
                    which: str) -> torch.Tensor:
    """MLA's absorbed matmul with kv_b_proj's FP8 rows read in place (Triton, bf16).

    which "uk": x = q_nope [T, H, nope] -> q_lat [T, H, R] (einsum thn,hnr->thr with W_UK);
    which "uv": x = the attention's latent output [T, H, R] -> [T, H, v] (einsum thr,hvr->thv with W_UV).
    x: bf16 (any strides); weight, scale: kv_b_proj's
    float8_e4m3fn [H (nope + v), R] and fp32 [ceil(H (nope + v) / 128), ceil(R / 128)]."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    rows_per_head, R = weight.shape[0] // num_heads, weight.shape[1]
    v = rows_per_head - nope
    if rows_per_head * num_heads != weight.shape[0] or v <= 0 or nope <= 0:
        raise ValueError(f"kv_b_proj {tuple(weight.shape)} does not split into {num_heads} heads of {nope} + v rows")
    want = (triton.cdiv(weight.shape[0], BLOCK), triton.cdiv(R, BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 {list(want)}, got {scale.dtype} {tuple(scale.shape)}")
    if which not in ("uk", "uv"):
        raise ValueError(f"which must be 'uk' or 'uv', got {which!r}")
    K, N, row0 = (nope, R, 0) if which == "uk" else (R, v, nope)
    if x.dim() != 3 or x.shape[1:] != (num_heads, K) or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [T, {num_heads}, {K}], got {x.dtype} {tuple(x.shape)}")
    check_device(x, weight, scale)
    x = x if x.stride(2) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale = scale.contiguous()
    T = x.shape[0]
    out = torch.empty((T, num_heads, N), dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return out
    block_t = min(64, max(16, triton.next_power_of_2(T)))
    block_n, block_k = 64, 64 if which == "uk" else 128
    # one scale a tile where head rows, tiles and 128-blocks line up (GLM-5.3: nope 192, v 256, R 512)
    one_scale = nope % 64 == 0 and v % 64 == 0 and R % 128 == 0
    grid = (num_heads, triton.cdiv(N, block_n))
    _absorbed_kernel[grid](x, weight, scale, out, T, N, K, row0, rows_per_head, x.stride(0), x.stride(1),
                           out.stride(0), out.stride(1), weight.stride(0), scale.stride(0), TRANS_W=which == "uv",
                           BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, ONE_SCALE=one_scale,
                           DOT_F32=interpreting(), ROUND_FIRST=interpreting(), num_warps=4)
    return out


def absorbed_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, num_heads: int, nope: int,
                        which: str) -> torch.Tensor:
    """The semantics: the bf16 copy's W_UK / W_UV and the einsum in fp32, rounded to bf16."""
    w_uk, w_uv = absorbed_weights(weight.cpu(), scale.cpu(), num_heads, nope, torch.bfloat16)
    xf = x.float().cpu()
    y = torch.einsum("thn,hnr->thr", xf, w_uk.float()) if which == "uk" else torch.einsum("thr,hvr->thv", xf,
                                                                                           w_uv.float())
    return y.to(torch.bfloat16).to(x.device)
