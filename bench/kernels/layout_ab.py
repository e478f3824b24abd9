"""The indexer key layout, 132-byte rows against block-major values, on the same keys:
`python -m bench.kernels.layout_ab`.

The score kernel (`kernels.indexer_fused`, Triton) reads each key's 128 fp8 values and its fp32 scale. In the
cache's 132-byte rows the values are only 4-byte aligned (17 four-byte copies per thread per 64-key tile); in the
block-major form (`kernels.formats.index_rows_to_blocked`: a block's 64 x 128 values, then its 64 scales; the same
132 bytes per token) they are 16-byte aligned (4 sixteen-byte copies and the scale). This times the score kernel on
both forms of one cache, for the prefill cases of `bench.kernels --only indexer` (2,048 query rows at the end of an
S-token context; SIZES=8192,131072,1048576) and the decode case (B = 64 rows, one per request, S = 128K;
DECODE=0 skips it), checks that the two forms give bitwise-equal scores and maxima, and projects the whole
`indexer_topk` call with the faster kernel (the rows form's measured call minus the score kernels' difference).

Floors as in bench.kernels.indexer: prefill max(key bytes / copy, FLOPs / (2 x bf16 matmul)); decode the key
bytes B·S·132 over the copy bandwidth, both measured first in this run. JSON to $OUT/layout-ab.json.

`--static` needs no GPU: it compiles the prefill and decode tiles of both layouts for sm_90a with the installed
Triton and reports, from the cubin (the cuobjdump Triton ships), registers, shared memory, cp.async copies by
size, and the instructions, MMAs and copies of the MMA loop. JSON to $OUT/layout-static-triton<version>.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from bench.kernels.indexer import ROW, Case, D, H, _score_outputs
from bench.kernels.timing import ceilings, device_time, time_plain
from kernels.formats import index_rows_to_blocked
from kernels.indexer_fused import DECODE, PREFILL, FusedConfig


def score_launches(dev, case: Case, cfg: FusedConfig, rows: int):
    """{layout: (launch, scores, gmax)} over the first `rows` query rows, both layouts of the case's cache."""
    blocked = index_rows_to_blocked(case.cache, D)
    out = {"rows": _score_outputs(dev, case, cfg, rows), "blocked": _score_outputs(dev, case, cfg, rows, blocked, True)}
    for _, scores, gmax in out.values():
        scores.fill_(float("nan"))
        gmax.fill_(float("nan"))
    return out


def compare(dev, case: Case, cfg: FusedConfig, rows: int, scale_rows: int) -> dict:
    """Score-kernel seconds of both layouts (scaled to all rows) and whether their outputs are bitwise equal."""
    runs = score_launches(dev, case, cfg, rows)
    row = {}
    for name, (launch, _, _) in runs.items():
        launch()
        torch.cuda.synchronize()
        t = time_plain(launch, dev, rep_ms=300) * scale_rows / rows
        t_dev, kernels = device_time(launch, dev)
        row[name] = dict(score_us=t * 1e6, score_device_us=t_dev * scale_rows / rows * 1e6,
                         kernels={k[:50]: round(x * 1e6, 1) for k, x in kernels.items()})
    (_, s_a, g_a), (_, s_b, g_b) = runs["rows"], runs["blocked"]
    row["scores_bitwise_equal"] = bool(torch.equal(s_a.nan_to_num(7.0), s_b.nan_to_num(7.0)))
    row["gmax_bitwise_equal"] = bool(torch.equal(g_a.nan_to_num(7.0), g_b.nan_to_num(7.0)))
    row["score_speedup"] = row["rows"]["score_us"] / row["blocked"]["score_us"]
    return row


def prefill(dev, ceil: dict, S: int, T: int = 2048) -> dict:
    case = Case(dev, [S], T, 2048)
    cfg = PREFILL
    rows = min(T, max(cfg.block_t, (1 << 30) // (4 * S)))
    flops = 2 * H * D * int((case.pos + 1).sum())
    floor = max(S * ROW / (ceil["copy_tbps"] * 1e12), flops / (2 * ceil["bf16_tflops"] * 1e12))
    row = {"case": "prefill", "S": S, "T": T, "floor_us": floor * 1e6, "fp8_ceiling_tflops": 2 * ceil["bf16_tflops"]}
    row.update(compare(dev, case, cfg, rows, T))
    for name in ("rows", "blocked"):
        row[name]["score_tflops"] = flops / (row[name]["score_us"] * 1e-6) / 1e12

    def call():  # the engine's path: the rows layout
        return case.select("fused", cfg)

    t_call = time_plain(call, dev, rep_ms=300)
    t_dev, _ = device_time(call, dev)
    saved = (row["rows"]["score_us"] - row["blocked"]["score_us"]) * 1e-6
    row["call_rows_us"], row["call_rows_device_us"] = t_call * 1e6, t_dev * 1e6
    row["call_rows_floor_frac"] = floor / t_dev
    row["call_blocked_projected_floor_frac"] = floor / (t_dev - saved)
    return row


def decode(dev, ceil: dict, B: int = 64, S: int = 131072) -> dict:
    case = Case(dev, [S] * B, 1, 2048)
    cfg = DECODE
    key_bytes = B * S * ROW
    row = {"case": "decode", "B": B, "S": S, "key_bytes": key_bytes}
    row.update(compare(dev, case, cfg, B, B))
    for name in ("rows", "blocked"):
        row[name]["key_copy_frac"] = key_bytes / (row[name]["score_us"] * 1e-6) / (ceil["copy_tbps"] * 1e12)
    return row


def compile_sm90(cfg: FusedConfig, block_t: int, blocked: bool):
    """The score kernel compiled for sm_90a (no GPU needed; Triton's compiler, not its interpreter), with the
    alignment its arguments have at real sizes: 16-byte aligned pointers and strides (not the 132-byte row)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.indexer_fused import _fused_scores_kernel as kernel

    sig = dict(q_ptr="*fp8e4nv", w_ptr="*fp32", k_ptr="*fp8e4nv", ks_ptr="*fp32", bt_ptr="*i32", tile_ptr="*i32",
               req_ptr="*i32", pos_ptr="*i64", score_ptr="*fp32", gmax_ptr="*fp32")
    sig.update({a: "i32" for a in "row_offset num_heads sq_t sq_h sw_t sk_blk sk_tok s_bt ss_row sg_row".split()})
    aligned = [a for a in sig if sig[a].startswith("*")] + "sq_t sq_h sw_t sk_blk ss_row sg_row".split()
    const = dict(BLOCK_SIZE=64, D=D, H_PAD=H, BLOCK_T=block_t, BLOCK_N=cfg.block_n, KEYS_PER_PROG=cfg.keys_per_prog,
                 GROUP=cfg.select.group, DOT_F32=False, BLOCKED=blocked)
    full = {a: sig.get(a, "constexpr") for a in kernel.arg_names}
    consts = {(kernel.arg_names.index(n),): v for n, v in const.items()}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(kernel, full, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def cp_async_sizes(ptx: str) -> dict[str, int]:
    """{"4B": n, "16B": m}: the kernel's cp.async copies by size."""
    copies: dict[str, int] = {}
    for n in re.findall(r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", ptx):
        copies[f"{int(n, 0)}B"] = copies.get(f"{int(n, 0)}B", 0) + 1
    return copies


def static() -> dict:
    """Compile both layouts' prefill and decode tiles for sm_90a (no GPU) and count what their code does."""
    import triton
    import triton.backends.nvidia as nvidia

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    res = {"triton": triton.__version__, "target": "sm_90a", "tiles": {}}
    for name, cfg, block_t in (("prefill", PREFILL, PREFILL.block_t), ("decode", DECODE, 1)):
        for blocked in (False, True):
            out = compile_sm90(cfg, block_t, blocked)
            copies = cp_async_sizes(out.asm["ptx"])
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(out.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
            code = [(int(a, 16), t) for a, t in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
            loop = None  # the backward branch whose body holds the MMAs: the key-tile loop, both epilogue paths
            for addr, text in code:
                target = re.search(r"BRA\s+(?:\S+\s+)?(0x[0-9a-f]+)", text)
                if target and int(target.group(1), 16) < addr:
                    body = [t for a, t in code if int(target.group(1), 16) <= a <= addr]
                    if any("GMMA" in t for t in body) and (loop is None or len(body) > loop["instructions"]):
                        loop = dict(instructions=len(body), mma=sum("GMMA" in t for t in body),
                                    copies=sum("LDGSTS" in t for t in body))
            res["tiles"][f"{name} {'blocked' if blocked else 'rows'}"] = dict(
                registers=int(re.search(r"REG:(\d+)", usage).group(1)), shared_bytes=out.metadata.shared,
                cp_async=copies, instructions=len(code), loop=loop)
            print(name, "blocked" if blocked else "rows", res["tiles"][f"{name} {'blocked' if blocked else 'rows'}"],
                  flush=True)
    return res


def main() -> None:
    if "--static" in sys.argv[1:]:
        if os.environ.get("TRITON_INTERPRET") != "0":  # a CPU torch turns the interpreter on at import: compile
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            raise SystemExit(subprocess.run([sys.executable, "-m", "bench.kernels.layout_ab", *sys.argv[1:]],
                                            env=env).returncode)
        res = static()
        path = os.path.join(os.environ.get("OUT", "/tmp"), f"layout-static-triton{res['triton']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        return
    dev = torch.device("cuda")
    out = os.path.join(os.environ.get("OUT", "/tmp"), "layout-ab.json")
    res = {"torch": torch.__version__, "triton": __import__("triton").__version__,
           "gpu": torch.cuda.get_device_name(dev), "rows": []}
    res["ceil"] = ceilings(dev)
    print("ceilings", res["ceil"], flush=True)
    sizes = [int(x) for x in os.environ.get("SIZES", "8192,131072,1048576").split(",") if x]
    cases = [lambda S=S: prefill(dev, res["ceil"], S) for S in sizes]
    if os.environ.get("DECODE", "1") != "0":
        cases.append(lambda: decode(dev, res["ceil"]))
    for case in cases:
        res["rows"].append(case())
        print(json.dumps(res["rows"][-1]), flush=True)
        torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
