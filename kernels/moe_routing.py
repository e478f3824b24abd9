"""The small steps around the grouped MoE GEMMs, one launch each: routing, sorting by expert, combining.

- `route`: router logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64): sigmoid, correction bias,
  top-k by the biased scores, weights from the unbiased ones, normalised and scaled (`route_ref`,
  n_group = 1: GLM-5.x routes ungrouped). One program per token; the top-k is k rounds of max over the E
  scores, ties to the lower expert id.
- `align_by_expert_small`: `align_by_expert`'s result (assignments sorted by local expert,
  each expert padded to a multiple of BLOCK_M rows; the padded block -> expert table) in one program, for
  the decode sizes (at most 8,192 assignments). One bitonic sort of (expert, assignment) keys gives the
  stable order; a row's place is its sorted position plus the padding of the experts before its own. The
  eager form is a radix argsort plus about ten small kernels (30 us of sort alone at 2,048 assignments).
- `align_by_expert_many`: the same blocks for more assignments than one program sorts quickly (the static
  EP dispatch hands an expert rank every row of the group: D times a rank's own assignments, most of them
  another rank's): a counting sort in three launches over many programs. An atomic counter per expert gives
  each local assignment its place inside its expert's rows, so the order within an expert is arrival order,
  not assignment order; every row of a grouped GEMM is computed on its own, so the outputs are the same.
- `moe_combine`: y [T * k, H] fp32 per-assignment rows -> [T, H] in the output dtype, summing each token's
  local assignments in order j = 0..k-1 and skipping the others, so y's rows of other ranks' experts are never
  read (y need not be zeroed: under EP most of it is never written).

The grouped GEMMs (kernels.moe, kernels.fp8_moe, kernels.fp8_cublas) build on this module, never the reverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit, next_pow2, to_bf16

MAX_SMALL_ASSIGNMENTS = 8192
# above this many assignments the counting sort over many programs beats the one-program sort (H100 timing,
# bench/kernels/moe_align.py)
MANY_MIN_ASSIGNMENTS = 1024


@jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, top_k, scaling, sl_t,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    scores = tl.sigmoid(tl.load(logits_ptr + t * sl_t + e, mask=em, other=0.0).to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=em, other=0.0)
    choice = tl.where(em, choice, float("-inf"))
    j = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    w = tl.zeros([BLOCK_K], tl.float32)
    for r in range(top_k):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)
        ids = tl.where(j == r, pick, ids)
        w = tl.where(j == r, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), w)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORMALIZE:
        w = w / (tl.sum(tl.where(j < top_k, w, 0.0), axis=0) + 1e-20)
    tl.store(w_ptr + t * top_k + j, w * scaling, mask=j < top_k)
    tl.store(ids_ptr + t * top_k + j, ids.to(tl.int64), mask=j < top_k)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *, n_group: int = 1,
          topk_group: int = 1, normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_ref` (same arguments) for ungrouped routing; grouped routing (n_group > 1) runs the
    reference. No host synchronisation."""
    if n_group > 1:
        return route_ref(router_logits, correction_bias, top_k, n_group=n_group, topk_group=topk_group,
                         normalize=normalize, scaling=scaling)
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"top_k {top_k} must be in [1, {E}]")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"correction bias {tuple(correction_bias.shape)} must be [{E}]")
    check_device(router_logits, *(() if correction_bias is None else (correction_bias,)))
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias, weights, ids, E, top_k, float(scaling), logits.stride(0),
                            BLOCK_E=next_pow2(E), BLOCK_K=max(2, next_pow2(top_k)),
                            HAS_BIAS=correction_bias is not None, NORMALIZE=normalize, num_warps=4)
    return weights, ids


@jit(do_not_specialize=["A", "max_rows", "num_blocks"])
def _align_kernel(ids_ptr, rows_ptr, block_expert_ptr, scratch_ptr, A, num_experts, offset, max_rows, num_blocks,
                  BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """One program. scratch [2 BLOCK_E] int32: per expert, (padded rows before it - its first sorted
    position), then its padded end."""
    a = tl.arange(0, BLOCK_A)
    am = a < A
    key = tl.load(ids_ptr + a, mask=am, other=0).to(tl.int32) - offset
    key = tl.where(am & (key >= 0) & (key < num_experts), key, num_experts)  # not ours: after every expert
    key = tl.where(am, key, num_experts + 1)  # past the end: last of all
    counts = tl.histogram(key, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    local_counts = tl.where(e < num_experts, counts, 0)
    padded = (local_counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    start = tl.cumsum(local_counts, axis=0) - local_counts
    tl.store(scratch_ptr + e, pad_end - padded - start)
    tl.store(scratch_ptr + BLOCK_E + e, pad_end)
    r = tl.arange(0, BLOCK_R)
    tl.store(rows_ptr + r, tl.full([BLOCK_R], -1, tl.int32), mask=r < max_rows)
    tl.debug_barrier()
    packed = tl.sort(key * BLOCK_A + a)  # stable by construction: ties broken by the assignment id
    s_key = packed // BLOCK_A
    s_a = packed % BLOCK_A
    p = tl.arange(0, BLOCK_A)
    ok = s_key < num_experts
    extra = tl.load(scratch_ptr + tl.where(ok, s_key, 0), mask=ok, other=0)
    tl.store(rows_ptr + p + extra, s_a, mask=ok)
    b = tl.arange(0, BLOCK_B)
    block_start = b * BLOCK_M
    expert = tl.zeros([BLOCK_B], tl.int32)
    for x in range(num_experts):
        expert += (tl.load(scratch_ptr + BLOCK_E + x) <= block_start).to(tl.int32)
    tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)


def align_by_expert_small(ids: torch.Tensor, num_experts: int, expert_offset: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `align_by_expert` (same arguments and results) for at most
    MAX_SMALL_ASSIGNMENTS assignments and 1,023 local experts; one launch, no host synchronisation."""
    A = ids.numel()
    if A > MAX_SMALL_ASSIGNMENTS or num_experts >= 1024 or block_m & (block_m - 1):
        raise ValueError(f"{A} assignments over {num_experts} experts (block {block_m}): use align_by_expert")
    check_device(ids)
    max_rows = triton.cdiv(A + min(num_experts, A) * (block_m - 1), block_m) * block_m
    rows = torch.empty((max_rows,), dtype=torch.int32, device=ids.device)
    num_blocks = max_rows // block_m
    block_expert = torch.empty((num_blocks,), dtype=torch.int32, device=ids.device)
    block_e = next_pow2(num_experts + 2)
    scratch = torch.empty((2 * block_e,), dtype=torch.int32, device=ids.device)
    if A:
        flat = ids.reshape(-1)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        _align_kernel[(1,)](flat, rows, block_expert, scratch, A, num_experts, expert_offset, max_rows, num_blocks,
                            BLOCK_A=max(16, next_pow2(A)), BLOCK_E=block_e, BLOCK_R=next_pow2(max_rows),
                            BLOCK_B=max(16, next_pow2(num_blocks)), BLOCK_M=block_m, num_warps=8)
    return rows, block_expert


@jit(do_not_specialize=["A"])
def _count_kernel(ids_ptr, counts_ptr, slot_ptr, A, num_experts, offset, BLOCK: tl.constexpr):
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    am = a < A
    e = tl.load(ids_ptr + a, mask=am, other=0).to(tl.int32) - offset
    ok = am & (e >= 0) & (e < num_experts)
    pos = tl.atomic_add(counts_ptr + tl.where(ok, e, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(slot_ptr + a, tl.where(ok, pos, -1), mask=am)


@jit(do_not_specialize=["num_blocks"])
def _offsets_kernel(counts_ptr, start_ptr, block_expert_ptr, num_experts, num_blocks,
                    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    em = e < num_experts
    counts = tl.load(counts_ptr + e, mask=em, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + e, pad_end - padded, mask=em)
    b = tl.arange(0, BLOCK_B)
    before = (pad_end[None, :] <= (b * BLOCK_M)[:, None]) & em[None, :]  # experts ending at or before block b
    tl.store(block_expert_ptr + b, tl.sum(before.to(tl.int32), axis=1), mask=b < num_blocks)


@jit(do_not_specialize=["A"])
def _place_kernel(ids_ptr, slot_ptr, start_ptr, rows_ptr, A, num_experts, offset, BLOCK: tl.constexpr):
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    am = a < A
    e = tl.load(ids_ptr + a, mask=am, other=0).to(tl.int32) - offset
    ok = am & (e >= 0) & (e < num_experts)
    pos = tl.load(slot_ptr + a, mask=ok, other=0)
    start = tl.load(start_ptr + tl.where(ok, e, 0), mask=ok, other=0)
    tl.store(rows_ptr + start + pos, a.to(tl.int32), mask=ok)


MAX_MANY_BLOCKS = 2048  # padded blocks `align_by_expert_many` maps to experts in its one-program step


def align_by_expert_many(ids: torch.Tensor, num_experts: int, expert_offset: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s blocks by a counting sort over many programs (module docstring): the same
    block -> expert table, each expert's rows the same set, in arrival order. No host synchronisation."""
    A = ids.numel()
    max_rows = triton.cdiv(A + min(num_experts, A) * (block_m - 1), block_m) * block_m
    num_blocks = max_rows // block_m
    if num_experts >= 1024 or block_m & (block_m - 1) or num_blocks > MAX_MANY_BLOCKS:
        raise ValueError(f"{A} assignments over {num_experts} experts (block {block_m}): use align_by_expert")
    check_device(ids)
    rows = torch.full((max_rows,), -1, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty((num_blocks,), dtype=torch.int32, device=ids.device)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=ids.device)
    start = torch.empty((num_experts,), dtype=torch.int32, device=ids.device)
    slot = torch.empty((A,), dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    block = 1024
    grid = (triton.cdiv(A, block),)
    if A:
        _count_kernel[grid](flat, counts, slot, A, num_experts, expert_offset, BLOCK=block, num_warps=4)
    _offsets_kernel[(1,)](counts, start, block_expert, num_experts, num_blocks, BLOCK_E=next_pow2(num_experts),
                          BLOCK_B=max(16, next_pow2(num_blocks)), BLOCK_M=block_m, num_warps=8)
    if A:
        _place_kernel[grid](flat, slot, start, rows, A, num_experts, expert_offset, BLOCK=block, num_warps=4)
    return rows, block_expert


@jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, H, top_k, num_experts, offset, sy_a, so_t,
                    BLOCK_H: tl.constexpr, ROUND_FIRST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    nm = n < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(top_k):
        a = t * top_k + j
        e = tl.load(ids_ptr + a) - offset
        mine = ((e >= 0) & (e < num_experts)).to(tl.int32) + tl.zeros([BLOCK_H], tl.int32)
        acc += tl.load(y_ptr + a * sy_a + n, mask=nm & (mine != 0), other=0.0)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + t * so_t + n, to_bf16(acc, ROUND_FIRST), mask=nm)
    else:
        tl.store(out_ptr + t * so_t + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def moe_combine(y: torch.Tensor, ids: torch.Tensor, num_experts: int, expert_offset: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Triton `moe_combine_ref`: y [T * k, H] fp32 (only this rank's assignments' rows are read) -> [T, H]."""
    T, k = ids.shape
    H = y.shape[1]
    if y.shape[0] != T * k or y.dtype != torch.float32 or y.stride(1) != 1:
        raise ValueError(f"y {tuple(y.shape)} {y.dtype} must be [{T * k}, H] float32 with unit stride along H")
    check_device(y, ids)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    out = torch.empty((T, H), dtype=dtype, device=y.device)
    if T and H:
        block_h = min(1024, next_pow2(H))
        _combine_kernel[(T, triton.cdiv(H, block_h))](y, ids, out, H, k, num_experts, expert_offset, y.stride(0),
                                                      out.stride(0), BLOCK_H=block_h, ROUND_FIRST=interpreting())
    return out


def moe_combine_ref(y: torch.Tensor, ids: torch.Tensor, num_experts: int, expert_offset: int,
                    dtype: torch.dtype) -> torch.Tensor:
    T, k = ids.shape
    local = ((ids - expert_offset) >= 0) & ((ids - expert_offset) < num_experts)
    rows = torch.where(local.reshape(-1, 1), y, torch.zeros((), dtype=y.dtype, device=y.device))
    return rows.view(T, k, -1).sum(dim=1).to(dtype)


# ---- the eager forms: the references, and the sort beyond the one-launch sizes ----------------------------

def route_ref(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *, n_group: int = 1,
              topk_group: int = 1, normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64). No host synchronisation.

    The bias only steers *which* experts are chosen; the weights come from the unbiased sigmoid scores.
    """
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    T, E = choice.shape
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def align_by_expert(ids: torch.Tensor, num_experts: int, expert_offset: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments (token, j) sorted by local expert, each expert padded to a multiple of block_m rows.

    Returns rows [max_rows] (assignment id t*k + j, -1 = padding) and block_expert [max_rows / block_m]
    (num_experts = past the last expert). Only device ops (sort, scatter, cumsum, searchsorted): no host
    synchronisation; max_rows is a host-side bound, A + min(E, A) * (block_m - 1).
    """
    A = ids.numel()
    flat = ids.reshape(-1).long() - expert_offset
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # non-local ids sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    local_key = sorted_key.clamp(max=num_experts - 1)
    max_rows = triton.cdiv(A + min(num_experts, A) * (block_m - 1), block_m) * block_m
    dest = pad_end[local_key] - padded[local_key] + torch.arange(A, device=ids.device) - start[sorted_key]
    dest = torch.where(sorted_key < num_experts, dest, max_rows)  # the dump slot, cut off below
    rows = torch.full((max_rows + 1,), -1, dtype=torch.int32, device=ids.device)
    rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).to(torch.int32)
    return rows[:max_rows], block_expert


# ---- what the grouped MoE GEMMs call (kernels.moe.fused_moe, kernels.fp8_moe.fused_moe_fp8) ----------------

def sort_by_expert(ids: torch.Tensor, num_experts: int, expert_offset: int, block_m: int,
                   small: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s blocks: when `small`, from the one-program sort up to MANY_MIN_ASSIGNMENTS, the
    counting sort above (while its block table fits one program); else the eager sort."""
    A = ids.numel()
    if small and A <= MANY_MIN_ASSIGNMENTS:
        return align_by_expert_small(ids, num_experts, expert_offset, block_m)
    blocks = triton.cdiv(A + min(num_experts, A) * (block_m - 1), block_m)
    if small and blocks <= MAX_MANY_BLOCKS and num_experts < 1024 and not block_m & (block_m - 1):
        return align_by_expert_many(ids, num_experts, expert_offset, block_m)
    return align_by_expert(ids, num_experts, expert_offset, block_m)


def assignment_rows(num_assign: int, H: int, small: bool, device: torch.device) -> torch.Tensor:
    """The fp32 per-assignment output rows [A, H]: left unwritten for `moe_combine` (which reads only this
    rank's rows), zeroed for the torch sum."""
    return (torch.empty if small else torch.zeros)((num_assign, H), dtype=torch.float32, device=device)


def combine(y: torch.Tensor, ids: torch.Tensor, num_experts: int, expert_offset: int, dtype: torch.dtype,
            small: bool) -> torch.Tensor:
    """Each token's rows summed: `moe_combine` when `small`, else a torch sum over zeroed rows."""
    if small:
        return moe_combine(y, ids, num_experts, expert_offset, dtype)
    return y.view(ids.shape[0], ids.shape[1], -1).sum(dim=1).to(dtype)
