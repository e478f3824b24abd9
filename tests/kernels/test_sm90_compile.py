"""The decode GEMM's split-K kernel and HiSparse's plan kernel compile for the H200 at the launches the engine makes.

Triton's interpreter, which runs the kernel in every other CPU test, accepted a partial-sum loop the
compiler rejects; this builds the cubin itself (tests/helpers/sm90.py)."""

from __future__ import annotations

import pytest

from tests.helpers.sm90 import compile_sm90, nvidia_backend

pytestmark = pytest.mark.skipif(not nvidia_backend(), reason="Triton without its NVIDIA backend")


def test_splitk_kernel_compiles_for_sm90():
    out = compile_sm90('''
        from kernels.fp8_gemm import DECODE_MAX_M
        from kernels.fp8_splitk import _splitk_kernel, splitk_config

        ints = "M N K num_kb sx_m sx_k sxs_m sw_n sws_n so_m sp_s sp_m".split()
        shapes = [(2048, 6144), (576, 6144), (16384, 2048), (6144, 16384), (24576, 6144), (4096, 2048)]
        picks = {splitk_config(M, N, K, 132) for M in (1, 16, 64, DECODE_MAX_M) for N, K in shapes}
        # every tile the launcher picks (e4m3 codes from quant_act), with one split and with several (the
        # partial sums), then the activation quantized in the kernel (fuse_quant) on 128-column tiles
        jobs = {(c.block_m, c.block_n, s, c.fuse_quant) for c in picks for s in (1, 8)}
        jobs |= {(16, 128, 2, True), (64, 128, 1, True)}
        for bm, bn, split, quant in sorted(jobs):
            sig = {"x_ptr": "*bf16" if quant else "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                   "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                   **{k: "i32" for k in ints}}
            const = dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, QUANT_A=quant, DOT_F32=False, ROUND_FIRST=False)
            print(bm, bn, split, quant, build(_splitk_kernel, sig, const, num_warps=4, num_stages=3))
    ''')
    builds = [line.split() for line in out.splitlines()]
    assert len(builds) >= 6 and all(len(b) == 5 and int(b[4]) > 0 for b in builds), out  # tile, split, cubin bytes


def test_hisparse_plan_kernel_compiles_for_sm90_at_the_service_shapes():
    """Top-k 2048 with MTP3 (8192 selections per request) and the default hot buffer (4096 rows) at the warps
    the launcher picks for them: at 8 warps this build took minutes (docs/hisparse.md, "Under CUDA graphs")."""
    out = compile_sm90('''
        import time
        from kernels.hisparse_plan import _plan_kernel, plan_warps

        P = "*i64"
        sig = dict(topk_ptr="*i32", s_topk="i64", entry_ptr=P, start_ptr=P, hot_slot_ptr=P, table_slot_ptr=P,
                   hot_base_ptr=P, page_ptr="*i32", s_page="i64", host_ptr="*i32", s_host="i64", hblk_ptr="*i32",
                   s_hblk="i64", rowpos_ptr=P, stamp_ptr=P, state_off="i64", s_state="i64", dst_row_ptr=P,
                   sel_ptr="*i32", s_sel="i64", msrc_ptr=P, mdst_ptr=P, scratch_ptr=P, counters_ptr=P,
                   bytes_per_miss="i64", clock_ptr=P, R="i32", K="i32", M="i32", BS="i32")
        n_pad, r_pad, k_pad = 8192, 4096, 2048
        for rows_sorted in (False, True):  # the sort of the selections, and the merge of ascending rows
            t = time.perf_counter()
            size = build(_plan_kernel, sig, dict(N_PAD=n_pad, R_PAD=r_pad, LOG_N=n_pad.bit_length() - 1,
                                                 ROWS_SORTED=rows_sorted, K_PAD=k_pad, LOG_K=k_pad.bit_length() - 1),
                         num_warps=plan_warps(n_pad, r_pad))
            print(plan_warps(n_pad, r_pad), size, round(time.perf_counter() - t, 1))
    ''', timeout=900)
    builds = [line.split() for line in out.splitlines()]
    assert len(builds) == 2 and all(int(w) == 32 and int(size) > 0 for w, size, _ in builds), out
    print(f"plan kernel for sm_90: {builds[0][2]} s (sort) and {builds[1][2]} s (merge) to compile")


def test_sparse_mla_kernel_with_trim_compiles_for_sm90():
    """The sparse MLA kernel at the decode tile (64 heads, fp8 pages of 64 tokens) with and without TRIM (the
    index-row load and the run-time loop bound before the pipelined loop)."""
    out = compile_sm90('''
        ints = ("num_heads num_idx split_len sq_len sq_b sq_s sq_h si_b si_s skv_blk skv_tok so_split so_row so_h "
                "sl_split sl_row").split()
        from kernels.sparse_mla import _sparse_mla_kernel

        sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv_scale_ptr": "*fp32", "kv_rope_ptr": "*bf16", "idx_ptr": "*i32",
               "out_ptr": "*fp32", "lse_ptr": "*fp32", **{k: "i32" for k in ints}, "sm_scale_log2": "fp32",
               "table_ptr": "*i32", "s_table": "i32", "req_ptr": "*i32"}
        for trim in (False, True):
            const = dict(R=512, P=64, TILE=128, KV_FP8=True, BLOCK_SIZE=64, BLOCK_H=64, BLOCK_N=64, IDX_AHEAD=True,
                         DOT_F32=False, ROUND_FIRST=False, POSITIONS=False, TRIM=trim)
            print(trim, build(_sparse_mla_kernel, sig, const, num_warps=8, num_stages=3))
    ''', timeout=900)
    builds = [line.split() for line in out.splitlines()]
    assert [b[0] for b in builds] == ["False", "True"] and all(int(b[1]) > 0 for b in builds), out


def test_small_fused_kernels_compile_for_sm90():
    """The norm and the gated MLP's activation (each also with the FP8 quantization of its output), RoPE and
    MoE-routing kernels at the launches a GLM-5.3 decode step makes (bitonic sort, histogram and barrier in the
    one-program expert sort among them)."""
    out = compile_sm90('''
        from kernels.act import _silu_mul_kernel
        from kernels.moe_routing import _align_kernel, _combine_kernel, _route_kernel
        from kernels.norm import _rms_norm_kernel
        from kernels.rope import _rope_cat_kernel, _rope_kernel

        i = "i32"
        for block, res, quant in ((8192, True, False), (2048, False, False), (512, False, False), (8192, True, True)):
            print("norm", build(_rms_norm_kernel, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                  "y_ptr": "*bf16", "sum_ptr": "*bf16", "q_ptr": "*u8", "qs_ptr": "*fp32", "D": i, "eps": "fp32",
                  "sx": i, "sr": i, "sy": i, "ss": i, "sq": i, "sqs": i},
                  dict(BLOCK_D=block, HAS_RES=res, QUANT=quant, ROUND_FIRST=False), num_warps=max(1, block // 512)))
        for quant in (False, True):
            print("silu_mul", build(_silu_mul_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16",
                  "q_ptr": "*u8", "qs_ptr": "*fp32", **{k: i for k in "inter sg su sh sq sqs".split()}},
                  dict(BLOCK=512, QUANT=quant, ROUND_FIRST=False)))
        for inter, bh in ((True, 32), (False, 16)):
            print("rope", build(_rope_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32", "H": i, "sx_t": i, "sx_h": i, "so_t": i, "so_h": i, "sc_t": i},
                  dict(HALF=32, BLOCK_H=bh, INTERLEAVE=inter)))
        print("rope_cat", build(_rope_cat_kernel, {"a_ptr": "*bf16", "x_ptr": "*bf16", "out_ptr": "*bf16",
              "cos_ptr": "*fp32", "sin_ptr": "*fp32", **{k: i for k in "A sa_t sa_h sx_t sx_h so_t so_h sc_t".split()}},
              dict(BLOCK_A=512, HALF=32)))
        print("route", build(_route_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32",
              "ids_ptr": "*i64", "E": i, "top_k": i, "scaling": "fp32", "sl_t": i},
              dict(BLOCK_E=256, BLOCK_K=8, HAS_BIAS=True, NORMALIZE=True)))
        for block_a, block_e, block_r, block_b, bm in ((2048, 64, 4096, 128, 32), (8192, 512, 16384, 1024, 16)):
            print("align", build(_align_kernel, {"ids_ptr": "*i64", "rows_ptr": "*i32", "block_expert_ptr": "*i32",
                  "scratch_ptr": "*i32", **{k: i for k in "A num_experts offset max_rows num_blocks".split()}},
                  dict(BLOCK_A=block_a, BLOCK_E=block_e, BLOCK_R=block_r, BLOCK_B=block_b, BLOCK_M=bm), num_warps=8))
        print("combine", build(_combine_kernel, {"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16",
              **{k: i for k in "H top_k num_experts offset sy_a so_t".split()}}, dict(BLOCK_H=1024, ROUND_FIRST=False)))
    ''')
    sizes = [line.split() for line in out.splitlines()]
    assert len(sizes) == 13 and all(int(s[1]) > 0 for s in sizes), out


def test_threshold_select_kernel_compiles_for_sm90():
    """The threshold top-k's one kernel (persistent rows: theta, the group list, compaction, selection, and the
    radix fallback) at the launcher's default configuration, as positions and as slots."""
    out = compile_sm90('''
        from kernels.topk_threshold import SelectConfig, _select_kernel

        c = SelectConfig()
        sig = {"score_ptr": "*fp32", "gmax_ptr": "*fp32", "pos_ptr": "*i64", "req_ptr": "*i32", "bt_ptr": "*i32",
               "out_ptr": "*i32", "glist_ptr": "*i32", "cand_ptr": "*i32", "cpos_ptr": "*i32",
               **{k: "i32" for k in "rows row_offset ss_row sg_row so_row s_bt k".split()}}
        for slots in (False, True):
            const = dict(BLOCK_SIZE=64, AS_SLOTS=slots, GROUP=c.group, SUM_CAP=c.sum_cap, GCAP=c.gcap, CAP=c.cap,
                         SCAN=c.scan, BLOCK=c.block)
            print(slots, build(_select_kernel, sig, const, num_warps=c.num_warps, num_stages=1))
    ''', timeout=900)
    builds = [line.split() for line in out.splitlines()]
    assert [b[0] for b in builds] == ["False", "True"] and all(int(b[1]) > 0 for b in builds), out


def test_indexer_scores_kernel_moves_block_major_keys_in_16_byte_copies_for_sm90():
    """The fused score kernel at the prefill and decode tiles, with the alignment its arguments have at real
    sizes: it builds, and the block-major keys (docs/kv-formats.md) move as 16-byte cp.async; the 132-byte
    rows they replaced could only move as 4-byte ones."""
    out = compile_sm90('''
        import re
        from kernels.indexer_fused import DECODE, PREFILL, _fused_scores_kernel as k

        sig = dict(q_ptr="*fp8e4nv", w_ptr="*fp32", k_ptr="*fp8e4nv", ks_ptr="*fp32", bt_ptr="*i32", tile_ptr="*i32",
                   req_ptr="*i32", pos_ptr="*i64", score_ptr="*fp32", gmax_ptr="*fp32")
        sig.update({a: "i32" for a in "row_offset num_heads sq_t sq_h sw_t sk_blk sk_tok s_bt ss_row sg_row".split()})
        aligned = [a for a in sig if sig[a].startswith("*")] + "sq_t sq_h sw_t sk_blk ss_row sg_row".split()
        for cfg, block_t in ((PREFILL, PREFILL.block_t), (DECODE, 1)):
            const = dict(BLOCK_SIZE=64, D=128, H_PAD=32, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
                         KEYS_PER_PROG=cfg.keys_per_prog, GROUP=cfg.select.group, DOT_F32=False)
            full = {a: sig.get(a, "constexpr") for a in k.arg_names}
            consts = {(k.arg_names.index(n),): v for n, v in const.items()}
            attrs = {(k.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
            out = triton.compile(ASTSource(k, full, constexprs=consts, attrs=attrs), target=TARGET,
                                 options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            ptx = out.asm["ptx"].splitlines()
            copies = [ln for ln in ptx if re.search(r"cp\\.async\\.c[ag]\\.shared\\.global", ln)]
            sizes = [int(re.search(r"\\],\\s*(0x[0-9a-f]+|\\d+)", ln.split("]", 1)[1]).group(1), 0) for ln in copies]
            print(block_t, len(out.asm["cubin"]), sum(n == 16 for n in sizes), len(sizes))
    ''')
    builds = [[int(x) for x in line.split()] for line in out.splitlines()]
    assert len(builds) == 2, out
    for block_t, size, copies_16, _ in builds:
        assert size > 0 and copies_16 > 0, f"tile of {block_t} rows: no 16-byte key copies ({out})"
