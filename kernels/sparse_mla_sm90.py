"""The warp-specialised sparse MLA kernel for sm_90 (kernels/csrc/sparse_mla_sm90.cu): build, checks, launch.

Why CUDA C++ and not Triton or Gluon: the kernel needs a producer warpgroup with its own (smaller) register
budget, mbarrier-handed shared-memory stages, and the score GEMM split across the two consumer warpgroups
with their row maxima exchanged. Triton lays a chained score dot's warps along M only, so both warpgroups
computed the same scores (bench/data/kernels/NOTES.md); Gluon expresses the rest, but its API has changed
between the Triton releases our hosts run (3.6) and pin (3.9), and one source had to build on both. CUDA
C++ builds with the toolkit's nvcc everywhere the H200s run, and its instructions are the ones written.

The source is built on first use with nvcc (`-gencode arch=compute_90a,code=sm_90a`) into a shared library
under PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/kernels; engine.settings), named by the source's and nvcc's
hash, and called through ctypes with raw pointers and torch's current stream (so CUDA graphs capture it). A host
without nvcc, or a failed build, logs once and keeps the Triton kernel.

`sparse_mla` in kernels/sparse_mla.py takes this path by default for more than 32 heads (on the H200 it is
1.5-1.6x the Triton kernel's speed at decode and prefill, BENCHMARKS.md; `kernel="triton"` keeps the Triton
kernel, for the benchmarks' side-by-side) when `eligible(...)` holds: bf16 q with <= 64 heads,
an fp8_ds_mla paged cache (latent 512, rope 64, 656-byte rows on 16-byte boundaries), int32 indices.

The kernel also reads bf16 rows (a workspace [S, 576], or bf16 pages [blocks, page, 576], e.g. a bf16 model's
"auto" KV cache): nothing to convert, the producer copies each row's 16-byte units by cp.async straight to their
swizzled places, and the raw-row barriers become the stages' "empty" barriers. On the H200 (BENCHMARKS.md) that
is 1.2x the Triton kernel at prefill sizes (8K and 64K query rows) but 0-10% slower at decode sizes (32-512 rows
over a 2M-token cache), so `sparse_mla` takes it by default from BF16_MIN_ROWS query rows. It is no faster than
this kernel over fp8 rows (the consumers, not the conversion, set the prefill's pace), so fp8 pages are read in
place rather than dequantised into a bf16 copy first.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine import settings
from kernels.store_kv import gather_kv_ref

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "sparse_mla_sm90.cu"
HEADS = 64          # one wgmma M tile
LATENT, ROPE = 512, 64
ROW_BYTES = LATENT + 4 * (LATENT // 128) + 2 * ROPE  # 656
BLOCK_N = 64        # selected rows per tile
NOT_SM90 = "needs an sm_90 GPU"  # eligible()'s answer off Hopper (the only one the default does not log)
NARROW_SPAN = 16 << 31  # layer views up to this many bytes hand rows over as 16-byte units in 31 bits (row_ref)

VARIANTS = {"full": 0, "no-gather": 1, "no-mma": 2}  # timing variants: the source's FULL / NO_GATHER / NO_MMA
_variant = "full"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
BF16_MIN_ROWS = 8192  # bf16 rows: the default takes this kernel from this many query rows (measured at 8K)


@contextlib.contextmanager
def timing_variant(name: str):
    """Launches inside run a variant with one stage left out (bench.kernels --only sparse-mla-sm90): "no-gather"
    (no row reads), "no-mma" (no wgmma); their outputs mean nothing; bf16 rows always run the full kernel. Not
    thread-safe: benchmarks only."""
    global _variant
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    before, _variant = _variant, name
    try:
        yield
    finally:
        _variant = before


_fallbacks: set[str] = set()


def note_fallback(why: str) -> None:
    """The default dispatch wanted this kernel on an sm_90 GPU and the inputs ruled it out: logged once per reason,
    since the Triton kernel it keeps is 1.5x slower and nobody chose it."""
    if why not in _fallbacks:
        _fallbacks.add(why)
        log.warning("sparse MLA: the sm_90 kernel cannot run these inputs (%s); using the Triton kernel", why)


def nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = settings.cuda_home()
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_command(compiler: str, out: Path) -> list[str]:
    return [compiler, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
            "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(out), str(SOURCE)]


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it built): the shared library's path. Raises RuntimeError with nvcc's
    message when it cannot be built."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(build_command("", Path())).encode())
    out_dir = out_dir or settings.kernel_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"sparse_mla_sm90-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: concurrent builders are safe
        part = Path(tmp) / lib.name
        proc = subprocess.run(build_command(compiler, part), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed building {SOURCE.name}:\n{proc.stderr[-4000:]}")
        os.replace(part, lib)
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (logged once) when it cannot be built."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.pdserve_sparse_mla_sm90
                fn.restype = ctypes.c_int
                fn.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_longlong] * 13 + [ctypes.c_int] * 8 + [ctypes.c_float]
                               + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])
                _lib = lib
            except (RuntimeError, OSError) as e:
                _failed = str(e)
                log.warning("sparse MLA sm_90 kernel unavailable, using the Triton kernel: %s", e)
    return _lib


def eligible(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, latent_dim: int,
             positions: bool, block_table: torch.Tensor | None, token_req_idx: torch.Tensor | None) -> str | None:
    """None when the sm_90 kernel can run these inputs, else why not."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return NOT_SM90
    if q.dtype != torch.bfloat16:
        return f"q is {q.dtype}, not bfloat16"
    if q.shape[-2] > HEADS:
        return f"{q.shape[-2]} heads > {HEADS}"
    if latent_dim != LATENT or q.shape[-1] != LATENT + ROPE:
        return f"latent {latent_dim} / head dim {q.shape[-1]} are not {LATENT} / {LATENT + ROPE}"
    if kv.dtype == torch.bfloat16:
        if kv.dim() not in (2, 3) or kv.shape[-1] != LATENT + ROPE:
            return f"bf16 rows {tuple(kv.shape)} are neither a workspace [S, {LATENT + ROPE}] nor pages of them"
        if kv.dim() == 3 and bad_page_size(kv.shape[1]):
            return f"page size {kv.shape[1]} is not a power of two"
        if kv.stride(-1) != 1 or any(st * 2 % 16 for st in kv.stride()[:-1]) or kv.data_ptr() % 16:
            return "bf16 rows are not on 16-byte boundaries"
    elif kv.dtype != torch.uint8 or kv.dim() != 3 or kv.shape[2] != ROW_BYTES:
        return "the cache is not an fp8_ds_mla paged layer view"
    elif kv.shape[1] & (kv.shape[1] - 1):
        return f"page size {kv.shape[1]} is not a power of two"
    elif kv.stride(2) != 1 or kv.stride(0) % 16 or kv.stride(1) % 16 or kv.data_ptr() % 16:
        return "cache rows are not on 16-byte boundaries"
    if q.data_ptr() % 16 or any(s % 8 for s in q.stride()[:-1]) or q.stride(-1) != 1:
        return "q rows are not on 16-byte boundaries"
    if indices.dtype != torch.int32:
        return f"indices are {indices.dtype}, not int32"
    if positions and kv.dim() == 2:
        return "positions need a paged cache, not a workspace"
    if positions and (block_table.dtype != torch.int32 or token_req_idx.dtype != torch.int32):
        return "the block table and token_req_idx must be int32"
    return None


def bad_page_size(n: int) -> bool:
    """Whether a page size is unusable (not a power of two)."""
    return n <= 0 or n & (n - 1) != 0


def paged(kv: torch.Tensor) -> torch.Tensor:
    """The cache as [blocks, page, row]: a workspace [S, 576] is pages of one row."""
    return kv if kv.dim() == 3 else kv.unsqueeze(1)


def span(kv: torch.Tensor) -> int:
    """Bytes from a paged layer view's first row to the end of its last."""
    kv, e = paged(kv), kv.element_size()
    return ((kv.shape[0] - 1) * kv.stride(0) + kv.shape[1] * kv.stride(1)) * e


def launch(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
           rows: int, splits: int, split_len: int, sq_len: int, q_strides: tuple[int, int, int],
           idx_strides: tuple[int, int], out_strides: tuple[int, int, int], lse_strides: tuple[int, int],
           sm_scale_log2: float, block_table: torch.Tensor | None, token_req_idx: torch.Tensor | None,
           trim: bool, dbg: torch.Tensor | None = None) -> None:
    """One launch over rows x splits (strides in elements, the cache's in bytes); out fp32 partials [split,
    row, head, R] when splits > 1, else out in bf16. `dbg` (fp32, `debug_floats()`; one split only): the
    debug build, which also dumps CTA (0, 0)'s first tile stage by stage (`first_tile_report`)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"sparse MLA sm_90 kernel unavailable: {_failed}")
    positions = block_table is not None
    table = block_table if positions else indices
    stream = torch.cuda.current_stream(q.device).cuda_stream
    bf16_rows = kv.dtype == torch.bfloat16
    pages, e = paged(kv), kv.element_size()
    err = lib.pdserve_sparse_mla_sm90(
        q.data_ptr(), kv.data_ptr(), indices.data_ptr(), out.data_ptr(), lse.data_ptr(), table.data_ptr(),
        (token_req_idx if positions else indices).data_ptr(),
        *q_strides, *idx_strides, pages.stride(0) * e, pages.stride(1) * e, *out_strides, *lse_strides,
        block_table.stride(0) if positions else 0,
        q.shape[-2], indices.shape[-1], split_len, sq_len, pages.shape[1].bit_length() - 1, int(positions), int(trim),
        int(span(kv) > NARROW_SPAN),
        sm_scale_log2, int(out.dtype == torch.float32),
        rows, splits, q.device.index if q.device.index is not None else torch.cuda.current_device(),
        None if dbg is None else dbg.data_ptr(), VARIANTS[_variant], int(bf16_rows), stream)
    if err:
        raise RuntimeError(f"sparse MLA sm_90 launch failed: CUDA error {err}")


# ---- diagnosis ---------------------------------------------------------------------------------------


def debug_floats() -> int:
    """fp32 elements of the debug dump (the layout is the constants DBG_* in the source)."""
    return HEADS * BLOCK_N * 2 + HEADS * LATENT + BLOCK_N * (LATENT + ROPE) * 2 // 4


def unswizzle_tile(raw: torch.Tensor) -> torch.Tensor:
    """A stage as the kernel stores it (9 chunks of [64 rows][128 B], 16-byte units of row r at unit ^ (r % 8))
    -> the bf16 tile [64, 576] in row order."""
    t = raw.contiguous().view(torch.uint8).view(9, 8, 8, 8, 16)  # chunk, 8-row group, row, physical unit, byte
    r8 = torch.arange(8, device=raw.device)[:, None]
    u = torch.arange(8, device=raw.device)[None, :]
    logical = t[:, :, r8, u ^ r8]  # [chunk, group, row, unit, byte]
    return logical.permute(1, 2, 0, 3, 4).reshape(BLOCK_N, 9 * 128).view(torch.bfloat16)


def first_tile_report(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float) -> dict:
    """Run the debug build on these inputs (slots, one split) and check query row 0's first tile stage by
    stage against torch on the kernel's own intermediate values: the producer's tile (bit-exact against the
    dequantised rows), the scores (fp32 accumulation order), P from those scores, the PV accumulator from that
    P. Max |error| / max |reference| per stage, so a wrong stage is named instead of a wrong output."""
    if kv.dtype != torch.uint8:
        raise ValueError("the debug dump covers the fp8 path only (bf16 rows are copied, not converted)")
    lead = q.dim() - 2
    rows = q.shape[:-2].numel()
    q2 = q.reshape(rows, *q.shape[-2:])
    idx2 = indices.reshape(rows, indices.shape[-1])
    out = torch.empty((rows, q.shape[-2], LATENT), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((rows, q.shape[-2]), dtype=torch.float32, device=q.device)
    dbg = torch.full((debug_floats(),), float("nan"), dtype=torch.float32, device=q.device)
    sq_len = q.shape[1] if lead == 2 else 1
    qs = (q.stride(0), q.stride(1), q.stride(2)) if lead == 2 else (q.stride(0), 0, q.stride(1))
    ids = (indices.stride(0), indices.stride(1)) if lead == 2 else (indices.stride(0), 0)
    launch(q, kv, indices, out, lse, rows=rows, splits=1, split_len=-(-indices.shape[-1] // BLOCK_N) * BLOCK_N,
           sq_len=sq_len, q_strides=qs, idx_strides=ids, out_strides=(0, out.stride(0), out.stride(1)),
           lse_strides=(0, lse.stride(0)), sm_scale_log2=sm_scale * 1.4426950408889634, block_table=None,
           token_req_idx=None, trim=False, dbg=dbg)
    torch.cuda.synchronize(q.device)
    n_s = HEADS * BLOCK_N
    s_k = dbg[:n_s].view(HEADS, BLOCK_N)
    p_k = dbg[n_s: 2 * n_s].view(HEADS, BLOCK_N)
    o_k = dbg[2 * n_s: 2 * n_s + HEADS * LATENT].view(HEADS, LATENT)
    tile = unswizzle_tile(dbg[2 * n_s + HEADS * LATENT:]).float()

    sel = idx2[0, :BLOCK_N].long()
    valid = sel >= 0
    want_tile = gather_kv_ref(kv, sel.clamp(min=0), LATENT, ROPE).masked_fill(~valid[:, None], 0.0)
    qf = torch.zeros(HEADS, LATENT + ROPE, device=q.device)
    qf[: q.shape[-2]] = q2[0].float()
    s_ref = qf @ tile.T
    z = torch.where(valid[None, :], s_k * sm_scale * 1.4426950408889634, float("-inf"))
    m = z.amax(dim=1, keepdim=True)
    p_ref = torch.exp2(z - torch.where(torch.isinf(m), 0.0, m)).bfloat16().float()
    o_ref = p_k @ tile[:, :LATENT]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

    return {"tile_exact": bool(torch.equal(tile, want_tile)), "tile_err": rel(tile, want_tile),
            "scores_err": rel(s_k, s_ref), "p_err": rel(p_k, p_ref), "pv_err": rel(o_k, o_ref),
            "nan": {k: bool(torch.isnan(v).any()) for k, v in (("scores", s_k), ("p", p_k), ("pv", o_k))}}
