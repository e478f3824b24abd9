// Sparse MLA attention over fp8_ds_mla cache pages on sm_90a (H100 / H200), warp-specialised.
//
// What it computes is kernels/sparse_mla.py's `sparse_mla` (same arguments, same outputs): for a query row t
// and head h, the online softmax over the row's selected cache rows of sm_scale * q[t, h] . [latent ; rope]
// and the softmax-weighted sum of the latents, plus the log-sum-exp; -1 indices are skipped; a row with
// nothing selected gives out 0 and lse -inf. One CTA is (query row, split of the index list) with all heads
// (<= 64) of the row; splits write fp32 partials that kernels/merge.py combines.
//
// Structure (the Hopper pattern of FlashAttention-3 and FlashMLA, written for this cache format):
//   * the selected rows of a tile (64 of them, 656 bytes each: 512 e4m3 latents, 4 fp32 scales per 128
//     latents, 64 bf16 rope values) move from HBM into a shared-memory stage as they are stored, one bulk copy
//     (cp.async.bulk, the TMA unit's 1-D form) a row, completing on the stage's `raw` mbarrier by byte count:
//     no registers hold them in flight, so a whole tile is in flight while the previous one is computed. The
//     consumers issue the copies of tile t + 2 the moment they are done with tile t's stage (the producer
//     issues tiles 0 and 1), so each stage is refilled without waiting for anyone;
//   * warpgroup 2, the producer, converts each stage in place: it reads the tile's raw rows (which take the
//     first 42 KB of the stage), and once all 128 threads hold theirs, writes the latents dequantised to bf16
//     (exact: e4m3 times a power of two) and the rope values into the 128-byte-swizzled layout wgmma reads,
//     handing the tile over in five parts (the rope chunk, then latent chunks {c, c + 4}) so the score GEMM
//     starts on the first part while the rest converts. It also looks up the slots of the tile two ahead
//     (indices, page-table entries) for the consumers' copies, so no index load is on the copy's path. (The
//     first version loaded the rows into the producer's registers: one tile in flight at most, behind a chain
//     of index, page-table and spilled-register loads; ncu put half the consumers' time at the full barrier.)
//   * warpgroups 0 and 1, the consumers, each compute the scores of half the tile's rows (64 heads x 32 rows,
//     K = 576: wgmma m64n32k16 with q and the tile in shared memory), exchange their row maxima through shared
//     memory, write their half of P (bf16) into a shared 64 x 64 tile, and each accumulate 256 of the 512
//     output columns (wgmma m64n256k16: P the A operand, the tile's latents the B operand, read transposed).
//     The score work is split, not duplicated (the Triton kernel's chained dots computed it in both).
//   * mbarriers hand stages on: `raw` (copies landed, by bytes) to the producer, `full` (one a part,
//     converted) to the consumers; the consumers' end-of-tile named barrier frees the stage for the next
//     copies. Named barriers also sync the two consumers (row maxima, P) and the producer's threads (all raw
//     rows read before any converted row overwrites them).
//
// What sets its pace (H200, bench/data/kernels/NOTES.md): the conversion. A stage's cycle is copy + HBM latency
// + conversion + the consumers' tile, and two stages overlap two cycles; the producer's warpgroup spends about
// 1,000 instructions a warp on a tile (three quarters of them the e4m3 -> f16 -> f32 x scale -> bf16 steps),
// and the consumers wait for its later parts. A second converting warpgroup would cap every thread at 128
// registers (the launch bound), below the PV accumulators' 128; shared memory (q 72 KB + two 72 KB stages)
// holds no third stage.

// The tile's shared-memory layout: 9 chunks of 64 columns (128 bytes a row), each [64 rows][128 bytes] with
// the 16-byte units of row r XOR-ed by r % 8 (the 128B swizzle), chunks 8 KiB apart. Read K-major it is the
// B operand of the score GEMM (rows = N, columns = K); read MN-major it is the B operand of the PV GEMM
// (rows = K, columns = N); q and P use the same layout as A operands.
//
// Built at first use by kernels/sparse_mla_sm90.py (nvcc -gencode arch=compute_90a,code=sm_90a) and called
// through ctypes with raw pointers and the caller's stream, so it is captured by CUDA graphs like any launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int R = 512;           // latent columns
constexpr int P = 64;            // rope columns
constexpr int D = R + P;         // score dot length
constexpr int HEADS = 64;        // one wgmma M tile: q rows of a query row (fewer heads are zero-padded)
constexpr int BN = 64;           // selected rows per tile
constexpr int CHUNKS = D / 64;   // 9 swizzled chunks of 64 bf16 columns
constexpr int CHUNK_BYTES = 64 * 128;
constexpr int TILE_BYTES = CHUNKS * CHUNK_BYTES;  // 73,728
constexpr int STAGES = 2;
constexpr int ROW_BYTES = R + 16 + 2 * P;   // 656: an fp8_ds_mla cache row, copied as is to the stage's start
constexpr int CONSUMERS = 256;   // warpgroups 0 and 1
constexpr int PRODUCERS = 128;   // warpgroup 2, two threads a row (one more warpgroup would cap every thread at
                                 // 128 registers, and the PV accumulators alone take 128)
constexpr int THREADS = CONSUMERS + PRODUCERS;

// shared memory, from a 1024-byte aligned base
constexpr int OFF_Q = 0;
constexpr int OFF_K = OFF_Q + TILE_BYTES;
constexpr int OFF_P = OFF_K + STAGES * TILE_BYTES;
constexpr int OFF_MAX = OFF_P + HEADS * 128;            // [2 buffers][2 warpgroups][64] fp32 row maxima
constexpr int OFF_SUM = OFF_MAX;                        // [2 warpgroups][64] fp32 row sums, after the last tile
constexpr int OFF_VALID = OFF_MAX + 2 * 2 * HEADS * 4;  // [STAGES][64] bytes: row valid
constexpr int OFF_NEXT = OFF_VALID + STAGES * BN;       // [STAGES][64] int32: tile t + 2's rows (row_ref; -1: none)
constexpr int PARTS = 5;         // a tile is handed over in parts: the rope chunk, then latent chunks {c, c + 4}
constexpr int OFF_BAR = OFF_NEXT + STAGES * BN * 4;     // raw[STAGES], then full[STAGES][PARTS] mbarriers
constexpr int OFF_NTILES = OFF_BAR + STAGES * (1 + PARTS) * 8;
constexpr int SMEM_BYTES = OFF_NTILES + 16;
constexpr int SMEM_ALLOC = SMEM_BYTES + 1024;           // room to align the base
static_assert(SMEM_ALLOC <= 227 * 1024, "shared memory");
static_assert(ROW_BYTES == 656 && ROW_BYTES % 16 == 0, "fp8_ds_mla row: bulk copies move multiples of 16 bytes");
static_assert(BN * ROW_BYTES <= TILE_BYTES, "a tile's raw rows fit in its stage");

// named barriers (0 is __syncthreads)
constexpr int BAR_Q = 1, BAR_MAX = 2, BAR_P = 3, BAR_SUM = 4, BAR_DONE = 5, BAR_RAW = 6;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of 16-byte unit `u` (0..7) of row `r` in a swizzled [rows][128 B] chunk.
__device__ __forceinline__ uint32_t swz(int r, int u) {
  return (r >> 3) * 1024 + (r & 7) * 128 + ((u ^ (r & 7)) << 4);
}

// wgmma shared-memory descriptor, 128-byte swizzle: start, leading and stride byte offsets (>> 4).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrive, adding `bytes` to the transaction count the phase waits for (the bulk copies' completions subtract them).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory through the async
// proxy; completion is reported to `bar` as transaction bytes.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed (a fresh barrier is in phase 0).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x, 2 ulp; exp2(-inf) = 0
  float y;
  asm("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {  // keep the compiler from moving accumulator uses
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 32] (fp32, 16 registers a thread) += A[64 x 16] * B[16 x 32], bf16 from shared memory.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, %19;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

// D[64 x 256] (fp32, 128 registers a thread) += A[64 x 16] * B[16 x 256], bf16 from shared memory.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16 e4m3 codes times `scale` (a power of two) -> 16 bf16 values as two 16-byte units (exact).
__device__ __forceinline__ void dequant16(uint4 codes, float scale, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * half)), __NV_E4M3);
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
      o[2 * i + half] = pack_bf16(f.x * scale, f.y * scale);
    }
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ void st_shared(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_shared_u8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

struct Args {
  const __nv_bfloat16* q;
  const uint8_t* kv;       // the cache layer's bytes; a row at page * s_blk + offset * s_tok
  const int* idx;          // slots, or request positions with `positions`
  void* out;               // bf16, or fp32 partials [split, row, head, R]
  float* lse;
  float* dbg;              // DEBUG builds: CTA (0, 0)'s first tile, stage by stage (kernels/sparse_mla_sm90.py)
  const int* table;        // block table rows (positions only)
  const int* req;          // request of each query row (positions only)
  long long sq_b, sq_s, sq_h, si_b, si_s, s_blk, s_tok, so_split, so_row, so_h, sl_split, sl_row, s_table;
  int num_heads, num_idx, split_len, sq_len, block_shift, positions, trim;
  int wide;                // the layer view spans more than 32 GiB: rows handed over as slots (row_ref)
  float sm_scale_log2;
};

// Timing variants (time the kernel with one stage left out): the copies read the cache's first 64 rows (cached
// after the first tile) instead of the selected ones, so a tile costs its conversion and stores but not the
// gather from HBM (indices and page-table entries still load); or the consumers skip the wgmmas (the softmax runs
// on whatever the score registers hold). Their outputs mean nothing.
constexpr int FULL = 0, NO_GATHER = 1, NO_MMA = 2;

// Shared addresses of stage `st`'s tile, its raw barrier and its first full barrier (one a part, 8 bytes apart).
__device__ __forceinline__ uint32_t stage_tile(uint32_t sbase, int st) { return sbase + OFF_K + st * TILE_BYTES; }
__device__ __forceinline__ uint32_t raw_bar(uint32_t sbase, int st) { return sbase + OFF_BAR + st * 8; }
__device__ __forceinline__ uint32_t full_bar(uint32_t sbase, int st) {
  return sbase + OFF_BAR + (STAGES + st * PARTS) * 8;
}

// Byte offset of a cache slot's row: page * block stride + offset in the page * row stride.
__device__ __forceinline__ long long row_offset(const Args& a, long long slot) {
  return (slot >> a.block_shift) * a.s_blk + (slot & ((1 << a.block_shift) - 1)) * a.s_tok;
}

// What the producer hands the consumers for row r of a tile, -1 for none: the row's byte offset / 16, which the
// consumers' copy adds to the base as it is (31 bits of 16-byte units reach 32 GiB), or, where the layer view
// spans more (`wide`: a pool of few layers on a large GPU), the slot itself (the cache's row r with NO_GATHER),
// which the copy turns into a 64-bit offset. The wide form puts a few 64-bit multiplies on the consumers' path
// between freeing a stage and refilling it: 3-4% slower on the H200, so only views wider than 32 GiB pay it.
template <int VARIANT>
__device__ __forceinline__ int row_ref(const Args& a, int slot, int r) {
  if (slot < 0) return -1;
  if (a.wide) return VARIANT == NO_GATHER ? r : slot;
  return static_cast<int>((VARIANT == NO_GATHER ? r * a.s_tok : row_offset(a, slot)) >> 4);
}

// Row r of tile t: copy the cache row `ref` names (row_ref) to row r's place in stage t % 2's raw area, counted on
// that stage's raw barrier (one arrival per row; a row with nothing selected only arrives).
template <int VARIANT>
__device__ __forceinline__ void copy_row(const Args& a, uint32_t sbase, int t, int r, int ref) {
  const int st = t & 1;
  const uint32_t bar = raw_bar(sbase, st);
  if (ref < 0) {
    mbar_arrive(bar);
    return;
  }
  const long long off = !a.wide ? 16ll * ref
                        : VARIANT == NO_GATHER ? static_cast<long long>(ref) * a.s_tok : row_offset(a, ref);
  mbar_arrive_expect_tx(bar, ROW_BYTES);
  bulk_copy_g2s(stage_tile(sbase, st) + r * ROW_BYTES, a.kv + off, ROW_BYTES, bar);
}

// Warpgroup 2: converts each stage's raw rows in place into the tile the consumers read; looks up the slots of
// the tile two ahead for the consumers' copies.
template <int VARIANT>
__device__ __forceinline__ void produce(const Args& a, uint8_t* smem, const int* idx_row, const int* tab, int lo,
                                        int hi, int n_tiles) {
  const int pt = threadIdx.x - CONSUMERS;
  const int r = pt >> 1, hf = pt & 1;  // two threads a row: latents [256 * hf, +256), rope [32 * hf, +32)
  const uint32_t sbase = smem_u32(smem);
  auto slot_of = [&](int t) -> int {  // row r's cache slot in tile t, -1 where nothing is selected
    const int n = lo + t * BN + r;
    if (t >= n_tiles || n >= hi) return -1;
    const int ix = __ldg(idx_row + n);
    if (ix < 0 || !a.positions) return ix;
    return (__ldg(tab + (ix >> a.block_shift)) << a.block_shift) + (ix & ((1 << a.block_shift) - 1));
  };
  int cur = slot_of(0), nxt = slot_of(1);
  if (hf == 0) {  // tiles 0 and 1; the consumers copy the rest
    if (n_tiles > 0) copy_row<VARIANT>(a, sbase, 0, r, row_ref<VARIANT>(a, cur, r));
    if (n_tiles > 1) copy_row<VARIANT>(a, sbase, 1, r, row_ref<VARIANT>(a, nxt, r));
  }
  for (int t = 0; t < n_tiles; ++t) {
    const int st = t & 1;
    const int ahead = slot_of(t + 2);  // in flight while this tile's rows land and convert
    const bool valid = cur >= 0;
    const uint32_t k = stage_tile(sbase, st);
    const uint32_t raw = k + r * ROW_BYTES;
    mbar_wait(raw_bar(sbase, st), (t >> 1) & 1);  // the tile's rows landed
    uint4 lat[16], rope[4];
    float2 sc = make_float2(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < 16; ++j) lat[j] = valid ? ld_shared_v4(raw + hf * 256 + 16 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      rope[j] = valid ? ld_shared_v4(raw + R + 16 + hf * 64 + 16 * j) : make_uint4(0, 0, 0, 0);
    if (valid) sc = ld_shared_f2(raw + R + hf * 8);
    bar_sync(BAR_RAW, PRODUCERS);  // every raw row is in registers: the converted tile may overwrite them
    // handed over in parts, so the consumers' score GEMM starts on the first part while the rest converts: the
    // rope chunk (and the row flags, the next slots), then latent chunks c (by the hf = 0 threads) and c + 4
    const uint32_t full = full_bar(sbase, st);
#pragma unroll
    for (int j = 0; j < 4; ++j) st_shared(k + 8 * CHUNK_BYTES + swz(r, 4 * hf + j), rope[j]);
    if (hf == 0) {
      st_shared_u8(sbase + OFF_VALID + st * BN + r, (uint32_t)valid);
      st_shared(sbase + OFF_NEXT + (st * BN + r) * 4, static_cast<uint32_t>(row_ref<VARIANT>(a, ahead, r)));
    }
    fence_async_smem();  // the generic-proxy stores, visible to wgmma (async proxy) after the barrier
    mbar_arrive(full);
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // columns 256 * hf + 16 * j: chunk 4 * hf + j / 4, units 2 * (j % 4) and +1
      uint4 v0, v1;
      dequant16(lat[j], j < 8 ? sc.x : sc.y, v0, v1);
      const uint32_t c = k + (4 * hf + j / 4) * CHUNK_BYTES;
      st_shared(c + swz(r, 2 * (j % 4)), v0);
      st_shared(c + swz(r, 2 * (j % 4) + 1), v1);
      if (j % 4 == 3) {
        fence_async_smem();
        mbar_arrive(full + (1 + j / 4) * 8);
      }
    }
    cur = nxt;
    nxt = ahead;
  }
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Wait until part `p` of the oldest tile in flight has landed, `newer` (0 or PARTS) groups of a later tile
// issued after it: cp.async.wait_group takes its count as an immediate.
__device__ __forceinline__ void wait_part(int p, int newer) {
  switch (newer + PARTS - 1 - p) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    case 8: cp_async_wait<8>(); break;
    default: cp_async_wait<9>(); break;
  }
}

// Warpgroup 2 over bf16 rows (a workspace [S, 576] or bf16 pages: 1,152 bytes a row, nothing to convert): each
// row's 72 16-byte units go straight from global memory to their swizzled places (cp.async, two threads a row:
// the rope chunk's units 4 hf.., then latent chunk c + 4 hf in part c + 1), one commit group a part, so a tile is
// handed over in the same five parts as the fp8 tile. A stage is refilled once the consumers have arrived on its
// `empty` barrier (the raw barrier's place: nothing lands raw here), and a tile's parts are published (wait for
// the copies, proxy fence, arrive) as they land. Rows with nothing selected are zeroed (P is 0 there, and 0 times
// a stale NaN would not be).
__device__ __forceinline__ void produce_bf16(const Args& a, uint8_t* smem, const int* idx_row, const int* tab,
                                             int lo, int hi, int n_tiles) {
  const int pt = threadIdx.x - CONSUMERS;
  const int r = pt >> 1, hf = pt & 1;
  const uint32_t sbase = smem_u32(smem);
  auto slot_of = [&](int t) -> int {
    const int n = lo + t * BN + r;
    if (t >= n_tiles || n >= hi) return -1;
    const int ix = __ldg(idx_row + n);
    if (ix < 0 || !a.positions) return ix;
    return (__ldg(tab + (ix >> a.block_shift)) << a.block_shift) + (ix & ((1 << a.block_shift) - 1));
  };
  uint32_t valid = 0;  // bit st: this thread's row of the tile in stage st is selected
  auto issue = [&](int t) {
    const int st = t & 1;
    const int slot = slot_of(t);  // the index and table loads overlap the wait below
    if (t >= 2) mbar_wait(raw_bar(sbase, st), ((t >> 1) - 1) & 1);  // the consumers are done with tile t - 2
    valid = (valid & ~(1u << st)) | (static_cast<uint32_t>(slot >= 0) << st);
    const uint32_t k = stage_tile(sbase, st);
    const uint8_t* row = a.kv + (slot >= 0 ? row_offset(a, slot) : 0);
#pragma unroll
    for (int part = 0; part < PARTS; ++part) {
      const int c = part == 0 ? 8 : part - 1 + 4 * hf;  // the chunk this thread fills in this part
#pragma unroll
      for (int j = 0; j < (part == 0 ? 4 : 8); ++j) {
        const int u = part == 0 ? 4 * hf + j : j;
        const uint32_t dst = k + c * CHUNK_BYTES + swz(r, u);
        if (slot >= 0) cp_async16(dst, row + c * 128 + u * 16);
        else st_shared(dst, make_uint4(0, 0, 0, 0));
      }
      cp_async_commit();
    }
  };
  auto publish = [&](int t, int newer) {
    const int st = t & 1;
    const uint32_t full = full_bar(sbase, st);
    if (hf == 0) st_shared_u8(sbase + OFF_VALID + st * BN + r, (valid >> st) & 1u);
#pragma unroll
    for (int part = 0; part < PARTS; ++part) {
      wait_part(part, newer);
      fence_async_smem();  // the copies' (and zero rows') bytes, visible to wgmma after the barrier
      mbar_arrive(full + part * 8);
    }
  };
  // Tile t + 1 is published before the producer waits to refill tile t's stage, so the consumers never wait for
  // that refill: while they work on tile t + 1, tile t + 2's copies land.
  if (n_tiles > 0) issue(0);
  if (n_tiles > 1) issue(1);
  if (n_tiles > 0) publish(0, n_tiles > 1 ? PARTS : 0);
  for (int t = 1; t < n_tiles; ++t) {
    if (t >= 2) issue(t);
    publish(t, 0);  // the only copies in flight are tile t's
  }
}

// The DEBUG instantiation's dump of CTA (0, 0)'s first tile, in floats: raw scores [64 heads][64 rows], P as
// rounded to bf16 [64][64], the accumulator after that tile's PV [64][512], the stage's bf16 tile as stored
// (73,728 swizzled bytes).
constexpr int DBG_S = 0, DBG_P = HEADS * BN, DBG_O = 2 * HEADS * BN, DBG_TILE = DBG_O + HEADS * R;

// Warpgroups 0 and 1: scores, softmax and the PV accumulation; then the output.
template <bool OUT_F32, bool DEBUG, int VARIANT, bool BF16>
__device__ __forceinline__ void consume(const Args& a, uint8_t* smem, long long row, long long b, long long s,
                                        int split, int n_tiles) {
  const int w = threadIdx.x >> 7;  // warpgroup: rows [32 w, +32) of each tile's scores, columns [256 w, +256)
  const int ct = threadIdx.x & 127, warp = ct >> 5, lane = ct & 31;
  const int r0 = warp * 16 + (lane >> 2);  // accumulator rows (heads) of this thread: r0 and r0 + 8
  const int quad = lane & 3;
  const uint32_t sbase = smem_u32(smem);
  const uint32_t sq = sbase + OFF_Q, sp = sbase + OFF_P;
  const int H = a.num_heads;

  {  // q [H, 576] bf16 -> the swizzled A tile (zeros past H): every load issued before the first store, so the
     // tile costs one memory latency, not one a 16-byte unit (the stores' asm "memory" clobbers order them)
    constexpr int PER_THREAD = HEADS * (D / 8) / CONSUMERS;  // 18
    static_assert(HEADS * (D / 8) % CONSUMERS == 0, "q units per consumer thread");
    const __nv_bfloat16* qrow = a.q + b * a.sq_b + s * a.sq_s;
    uint4 v[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int e = threadIdx.x + i * CONSUMERS, h = e / (D / 8), du = e % (D / 8);
      v[i] = h < H ? __ldg(reinterpret_cast<const uint4*>(qrow + h * a.sq_h) + du) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int e = threadIdx.x + i * CONSUMERS, h = e / (D / 8), du = e % (D / 8);
      st_shared(sq + (du >> 3) * CHUNK_BYTES + swz(h, du & 7), v[i]);
    }
    fence_async_smem();
    bar_sync(BAR_Q, CONSUMERS);
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // V (the tile's latents) read MN-major: 64-column chunks 8 KiB apart along N, 8-row groups 1 KiB apart along K
  // (transposed operands: the leading byte offset steps along N, the stride byte offset along K)

  for (int t = 0; t < n_tiles; ++t) {
    const int st = t & 1;
    const uint32_t k = stage_tile(sbase, st), full = full_bar(sbase, st);
    const bool dump = DEBUG && t == 0 && blockIdx.x == 0 && blockIdx.y == 0;

    float sc[16];
    // descriptors of step 0; a step adds its byte offset >> 4 to the start-address field (no carry: shared
    // addresses are < 2^18, so the field never overflows)
    const uint64_t dq = desc(sq, 16, 1024), dk = desc(k + w * 4 * 1024, 16, 1024);
    // 36 steps of 16 columns (chunk kk / 4, 32 bytes apart inside it), in the order the parts arrive: the rope
    // chunk 8, then chunks c and c + 4; the wgmmas already issued run while the next part is waited for
#pragma unroll
    for (int part = 0; part < PARTS; ++part) {
      mbar_wait(full + part * 8, (t >> 1) & 1);
      wgmma_fence();  // after every wait (a loop): otherwise ptxas fences each wgmma on its own
#pragma unroll
      for (int i = 0; i < (part == 0 ? 4 : 8); ++i) {
        const int kk = part == 0 ? 32 + i : (i < 4 ? 4 * (part - 1) + i : 4 * (part + 3) + i - 4);
        const uint32_t off = (kk >> 2) * CHUNK_BYTES + (kk & 3) * 32;
        if (VARIANT != NO_MMA) wgmma_m64n32k16<0>(sc, dq + (off >> 4), dk + (off >> 4), part > 0 || i > 0);
      }
    }
    wgmma_commit();
    wgmma_wait0();
    fence_regs(sc);
    if (dump)
      for (int e = threadIdx.x; e < TILE_BYTES / 4; e += CONSUMERS)
        a.dbg[DBG_TILE + e] = reinterpret_cast<const float*>(smem + OFF_K + st * TILE_BYTES)[e];
    if (dump)
#pragma unroll
      for (int e = 0; e < 16; ++e)
        a.dbg[DBG_S + (r0 + 8 * ((e >> 1) & 1)) * BN + 32 * w + 8 * (e >> 2) + 2 * quad + (e & 1)] = sc[e];

    // sc[n * 4 + i * 2 + j]: head r0 + 8 i, tile row 32 w + 8 n + 2 quad + j
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = ld_shared_u8(sbase + OFF_VALID + st * BN + 32 * w + 8 * n + 2 * quad + j) != 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float& z = sc[n * 4 + i * 2 + j];
          z = ok ? z * a.sm_scale_log2 : -INFINITY;
          mx[i] = fmaxf(mx[i], z);
        }
      }
    const uint32_t smax_w = sbase + OFF_MAX + ((t & 1) * 2 + w) * HEADS * 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
      if (quad == 0) st_shared(smax_w + (r0 + 8 * i) * 4, __float_as_uint(mx[i]));
    }
    bar_sync(BAR_MAX, CONSUMERS);
    const uint32_t smax_o = sbase + OFF_MAX + ((t & 1) * 2 + (1 - w)) * HEADS * 4;
    float alpha[2], msafe[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float mn = fmaxf(m[i], fmaxf(mx[i], __uint_as_float(ld_shared_u32(smax_o + (r0 + 8 * i) * 4))));
      msafe[i] = mn == -INFINITY ? 0.f : mn;  // nothing valid yet: stay at 0
      alpha[i] = fast_exp2(m[i] - msafe[i]);
      m[i] = mn;
      l[i] *= alpha[i];
    }
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float p0 = fast_exp2(sc[n * 4 + i * 2] - msafe[i]), p1 = fast_exp2(sc[n * 4 + i * 2 + 1] - msafe[i]);
        l[i] += p0 + p1;
        const int h = r0 + 8 * i;  // P[h, 32 w + 8 n + 2 quad + {0, 1}]: 16-byte unit 4 w + n, bytes 4 quad
        st_shared(sp + swz(h, 4 * w + n) + 4 * quad, pack_bf16(p0, p1));
        if (dump) {
          a.dbg[DBG_P + h * BN + 32 * w + 8 * n + 2 * quad] = __bfloat162float(__float2bfloat16_rn(p0));
          a.dbg[DBG_P + h * BN + 32 * w + 8 * n + 2 * quad + 1] = __bfloat162float(__float2bfloat16_rn(p1));
        }
      }
#pragma unroll
    for (int n = 0; n < 32; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        o[n * 4 + i * 2] *= alpha[i];
        o[n * 4 + i * 2 + 1] *= alpha[i];
      }
    fence_async_smem();
    bar_sync(BAR_P, CONSUMERS);  // both halves of P written

    wgmma_fence();
    const uint64_t dp = desc(sp, 16, 1024), dv = desc(k + 4 * w * CHUNK_BYTES, CHUNK_BYTES, 1024);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)  // 4 steps of 16 tile rows: P 32 bytes apart, V two 8-row groups
      if (VARIANT != NO_MMA) wgmma_m64n256k16<1>(o, dp + (kk * 32 >> 4), dv + (kk * 2048 >> 4), 1);
    wgmma_commit();
    wgmma_wait0();
    fence_regs(o);
    if (dump)
#pragma unroll
      for (int e = 0; e < 128; ++e)
        a.dbg[DBG_O + (r0 + 8 * ((e >> 1) & 1)) * R + 256 * w + 8 * (e >> 2) + 2 * quad + (e & 1)] = o[e];
    if constexpr (BF16) {
      mbar_arrive(raw_bar(sbase, st));  // the stage is free: the producer refills it (produce_bf16)
    } else if (t + 2 < n_tiles) {  // refill the stage: once every consumer warp is done with it, copy tile t + 2's rows
      bar_sync(BAR_DONE, CONSUMERS);
      if (lane < BN / 8) {
        const int r = (threadIdx.x >> 5) * (BN / 8) + lane;
        copy_row<VARIANT>(a, sbase, t + 2, r, static_cast<int>(ld_shared_u32(sbase + OFF_NEXT + (st * BN + r) * 4)));
      }
    }
  }

  // the row sums of both warpgroups' columns
  float* ssum = reinterpret_cast<float*>(smem + OFF_SUM);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    if (quad == 0) ssum[w * HEADS + r0 + 8 * i] = l[i];
  }
  bar_sync(BAR_SUM, CONSUMERS);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int h = r0 + 8 * i;
    const float total = l[i] + ssum[(1 - w) * HEADS + h];
    if (h >= H) continue;
    const bool has = total > 0.f;
    const float inv = has ? 1.f / total : 1.f;
    const long long o_off = split * a.so_split + row * a.so_row + h * a.so_h + 256 * w + 2 * quad;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const float x0 = o[n * 4 + i * 2] * inv, x1 = o[n * 4 + i * 2 + 1] * inv;
      if constexpr (OUT_F32) {
        *reinterpret_cast<float2*>(static_cast<float*>(a.out) + o_off + 8 * n) = make_float2(x0, x1);
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(a.out) + o_off + 8 * n) = pack_bf16(x0, x1);
      }
    }
    if (w == 0 && quad == 0)
      a.lse[split * a.sl_split + row * a.sl_row + h] = has ? (m[i] + log2f(total)) * 0.69314718055994531f : -INFINITY;
  }
}

template <bool OUT_F32, bool DEBUG, int VARIANT, bool BF16>
__global__ void __launch_bounds__(THREADS, 1) sparse_mla_sm90_kernel(const Args a) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const long long row = blockIdx.x;
  const int split = blockIdx.y;
  const long long b = row / a.sq_len, s = row % a.sq_len;
  const int* idx_row = a.idx + b * a.si_b + s * a.si_s;
  const int* tab = a.positions ? a.table + (long long)__ldg(a.req + row) * a.s_table : a.table;
  const int lo = split * a.split_len;
  int hi = min(lo + a.split_len, a.num_idx);
  int* ntiles = reinterpret_cast<int*>(smem + OFF_NTILES);

  if (threadIdx.x < 32) {  // warp 0: barriers, and the trimmed bound (stop after the split's last valid index)
    if (threadIdx.x == 0) {
      const uint32_t sbase = smem_u32(smem);
      // fp8: one arrival a row + the copies' bytes; bf16 rows: the stage's `empty` barrier, one arrival a consumer
      for (int st = 0; st < STAGES; ++st) mbar_init(raw_bar(sbase, st), BF16 ? CONSUMERS : BN);
      for (int i = 0; i < STAGES * PARTS; ++i) mbar_init(full_bar(sbase, 0) + i * 8, PRODUCERS);  // the producer's
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the async proxy
    }
    int last = hi - 1;
    if (a.trim && hi > lo && __ldg(idx_row + hi - 1) < 0) {  // a full row keeps its bound after one load
      last = lo - 1;
      for (int n = lo + threadIdx.x; n < hi; n += 32)
        if (__ldg(idx_row + n) >= 0) last = n;
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) last = max(last, __shfl_xor_sync(0xffffffff, last, d));
    }
    if (threadIdx.x == 0) *ntiles = last >= lo ? (last - lo + BN) / BN : 0;
    if (a.trim) hi = last + 1;
  }
  __syncthreads();
  const int n_tiles = *ntiles;
  if (a.trim) hi = min(hi, lo + n_tiles * BN);  // the producer masks entries past its tiles' end only

  if (threadIdx.x >= CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 112;\n" ::: "memory");
    if constexpr (BF16) produce_bf16(a, smem, idx_row, tab, lo, hi, n_tiles);
    else produce<VARIANT>(a, smem, idx_row, tab, lo, hi, n_tiles);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 192;\n" ::: "memory");
    consume<OUT_F32, DEBUG, VARIANT, BF16>(a, smem, row, b, s, split, n_tiles);
  }
}

template <bool OUT_F32, bool DEBUG, int VARIANT = FULL, bool BF16 = false>
int launch(const Args& a, int rows, int splits, int device, cudaStream_t stream) {
  // This library links its own CUDA runtime, whose current device is not torch's: set it where it differs.
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess && current != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  static unsigned long long ready = 0;  // devices whose dynamic shared-memory limit is raised for this kernel
  if (device >= 64 || !(ready >> device & 1)) {
    e = cudaFuncSetAttribute(sparse_mla_sm90_kernel<OUT_F32, DEBUG, VARIANT, BF16>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_ALLOC);
    if (e != cudaSuccess) return (int)e;
    if (device < 64) ready |= 1ull << device;
  }
  sparse_mla_sm90_kernel<OUT_F32, DEBUG, VARIANT, BF16><<<dim3(rows, splits), THREADS, SMEM_ALLOC, stream>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// Shared memory one CTA takes (bytes), for the launcher's checks; floats of the DEBUG dump.
int pdserve_sparse_mla_sm90_smem() { return SMEM_ALLOC; }
int pdserve_sparse_mla_sm90_debug_floats() { return DBG_TILE + TILE_BYTES / 4; }

// Launch over `rows` query rows x `splits` splits; strides in elements (bytes for the cache). Returns a
// cudaError_t (0 = launched).
int pdserve_sparse_mla_sm90(const void* q, const void* kv, const void* idx, void* out, void* lse, const void* table,
                            const void* req, long long sq_b, long long sq_s, long long sq_h, long long si_b,
                            long long si_s, long long s_blk, long long s_tok, long long so_split, long long so_row,
                            long long so_h, long long sl_split, long long sl_row, long long s_table, int num_heads,
                            int num_idx, int split_len, int sq_len, int block_shift, int positions, int trim, int wide,
                            float sm_scale_log2, int out_f32, int rows, int splits, int device, void* dbg,
                            int variant, int bf16_rows, void* stream) {
  Args a;
  a.q = static_cast<const __nv_bfloat16*>(q);
  a.kv = static_cast<const uint8_t*>(kv);
  a.idx = static_cast<const int*>(idx);
  a.out = out;
  a.lse = static_cast<float*>(lse);
  a.dbg = static_cast<float*>(dbg);
  a.table = static_cast<const int*>(table);
  a.req = static_cast<const int*>(req);
  a.sq_b = sq_b; a.sq_s = sq_s; a.sq_h = sq_h; a.si_b = si_b; a.si_s = si_s; a.s_blk = s_blk; a.s_tok = s_tok;
  a.so_split = so_split; a.so_row = so_row; a.so_h = so_h; a.sl_split = sl_split; a.sl_row = sl_row;
  a.s_table = s_table;
  a.num_heads = num_heads; a.num_idx = num_idx; a.split_len = split_len; a.sq_len = sq_len;
  a.block_shift = block_shift; a.positions = positions; a.trim = trim; a.wide = wide;
  a.sm_scale_log2 = sm_scale_log2;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (bf16_rows)  // bf16 rows: the full kernel only (no debug dump, no timing variants)
    return out_f32 ? launch<true, false, FULL, true>(a, rows, splits, device, st)
                   : launch<false, false, FULL, true>(a, rows, splits, device, st);
  if (dbg) return launch<false, true>(a, rows, splits, device, st);  // bf16 output, one split
  if (variant == NO_GATHER)
    return out_f32 ? launch<true, false, NO_GATHER>(a, rows, splits, device, st)
                   : launch<false, false, NO_GATHER>(a, rows, splits, device, st);
  if (variant == NO_MMA)
    return out_f32 ? launch<true, false, NO_MMA>(a, rows, splits, device, st)
                   : launch<false, false, NO_MMA>(a, rows, splits, device, st);
  return out_f32 ? launch<true, false>(a, rows, splits, device, st) : launch<false, false>(a, rows, splits, device, st);
}

}  // extern "C"
