// examples/qwen/gemv.cu: the fused GEMV of decode buckets up to kMmaMaxRows rows.
//
// y = W·x for B batch rows, reading every weight once per step. x is staged once per block in
// shared memory as bf16: copied, or RMS-normalised on the fly from the fp32 residual (the layer's
// RMSNorm folded into its consumer). Each warp computes whole output rows with 16-byte streaming
// loads of W, fp32 accumulation and a warp reduction, then the epilogue of the Linear's mode:
// store, residual add (a red.global.add: no thread waits for the old value), SiLU(gate)·up of the
// stacked gate/up matrix, or logits + argmax. Weights are loaded before pdl::wait().
// At batch 1, two kernels on the CUDA cores: the ring GEMV for matrices whose per-warp share fits
// shared memory, the pipelined GEMV elsewhere (plan_gemv); both multiply in the same order, so their
// results are bit-identical. From 2 rows, the tensor-core GEMV (same inputs and epilogues).
#include "kernels.cuh"
#include "device.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <cudaTypedefs.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <type_traits>

namespace qwen {
namespace {

using namespace dev;

/// The RMSNorm weights a thread of stage_x uses in its first two passes (k = 8 tid + 2048 i for 256
/// threads), loaded before pdl::wait(): they do not depend on earlier kernels, and loading
/// them after it put one more round trip to L2 on the critical path.
template <int WARPS>
__device__ __forceinline__ void norm_weights_prefetch(const GemvIn& in, int K, uint4 (&g)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int k = threadIdx.x * 8 + i * (WARPS * 32) * 8;
    g[i] = in.norm_w != nullptr && k < K ? *reinterpret_cast<const uint4*>(in.norm_w + k) : make_uint4(0, 0, 0, 0);
  }
}

/// Eight elements of a normalised GEMV input: x[0, 8) (fp32) times the norm weights gw (8 bf16),
/// stored to dst as bf16 (the RMS scale is applied to the finished dot products); returns the sum
/// of their squares, from which the row's scale is made.
__device__ __forceinline__ float stage_norm8(const float* x, uint4 gw, bf16* dst) {
  float g[8];
  unpack8(gw, g);
  const float4 a = *reinterpret_cast<const float4*>(x);
  const float4 c = *reinterpret_cast<const float4*>(x + 4);
  uint4 o;
  o.x = pack2(a.x * g[0], a.y * g[1]);
  o.y = pack2(a.z * g[2], a.w * g[3]);
  o.z = pack2(c.x * g[4], c.y * g[5]);
  o.w = pack2(c.z * g[6], c.w * g[7]);
  *reinterpret_cast<uint4*>(dst) = o;
  return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + c.x * c.x + c.y * c.y + c.z * c.z + c.w * c.w;
}

/// Stages the batch-1 GEMV input in shared memory as bf16, in one pass: x copied as is, or the fp32
/// residual times in.norm_w (the layer's RMSNorm fused into the projection), each warp's sum of
/// squares in red[warp]; the RMS scale (block_rms_scale, once the caller has synchronised) multiplies
/// the finished dot products: W·(x∘g)·rs = W·(x∘g·rs). Every thread of the block takes part; the
/// caller synchronises before reading xs or red. ASYNC: the copy by cp.async, every piece in flight
/// at once (the ring kernel; the pipelined kernel keeps loads: with cp.async it needs fewer registers,
/// a fourth block fits on an SM, and the larger grid that then runs is slower).
template <bool NORM, int WARPS, bool PREG = false, bool ASYNC = false>
__device__ __forceinline__ void stage_x(const GemvIn& in, int K, bf16* xs, float (&red)[WARPS],
                                        const uint4 (&gpre)[2] = {}) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if constexpr (NORM) {
    float ss = 0.f;
    for (int k = tid * 8, pass = 0; k < K; k += (WARPS * 32) * 8, ++pass) {
      const uint4 gw =
          PREG && pass < 2 ? (pass == 0 ? gpre[0] : gpre[1]) : *reinterpret_cast<const uint4*>(in.norm_w + k);
      ss += stage_norm8(in.x_f32 + k, gw, xs + k);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
  } else if constexpr (ASYNC) {  // one round trip to L2 whatever K is
    for (int k = tid * 8; k < K; k += (WARPS * 32) * 8) cp_async16(xs + k, in.x_bf16 + k, true);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    for (int k = tid * 8; k < K; k += (WARPS * 32) * 8)
      *reinterpret_cast<uint4*>(xs + k) = *reinterpret_cast<const uint4*>(in.x_bf16 + k);
  }
}

/// The RMS scale of the staged row from stage_x's per-warp sums (added in warp order); 1 without NORM.
template <bool NORM, int WARPS>
__device__ __forceinline__ float block_rms_scale(const float (&red)[WARPS], int K, float eps) {
  if constexpr (!NORM) return 1.f;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) sum += red[w];
  return rsqrtf(sum / K + eps);
}

/// The GEMV epilogue for one output: `a` = W row · x (for silu_mul the gate row), `up` = the up row.
/// add_f32 is a reduction (red.global.add): no thread waits for the old value, and with one addend
/// per element the result is the plain fp32 sum y + a.
template <gemv_out MODE>
__device__ __forceinline__ void gemv_store(float* y_f32, bf16* y_bf16, std::size_t o, float a, float up) {
  if constexpr (MODE == gemv_out::store_f32 || MODE == gemv_out::argmax) {
    y_f32[o] = a;
  } else if constexpr (MODE == gemv_out::add_f32) {
    atomicAdd(y_f32 + o, a);
  } else {
    y_bf16[o] = __float2bfloat16(a / (1.f + __expf(-a)) * up);
  }
}

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * 32;

/// One chunk of a warp's row(s): acc[r] += w[r][u] · x for the U 16-byte pieces at k0 + 256 u (k0
/// includes the lane's 8-element offset); pieces at or past K are skipped.
template <int R, int U>
__device__ __forceinline__ void gemv_fma_chunk(const uint4 (&w)[R][U], const bf16* xs, int K, int k0, float (&acc)[R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = k0 + u * 256;
    if (k < K) {
      float xf[8];
      unpack8(*reinterpret_cast<const uint4*>(xs + k), xf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[8];
        unpack8(w[r][u], wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r] = fmaf(wf[j], xf[j], acc[r]);
      }
    }
  }
}

/// A warp's row n is complete: warp sums times rs (the RMS scale; 1 where x is not normalised), lane
/// 0 runs the epilogue of MODE and tracks the argmax, and acc is cleared for the next row.
template <int R, gemv_out MODE>
__device__ __forceinline__ void gemv_finish_row(float (&acc)[R], float rs, int n, int lane, float* y_f32,
                                                bf16* y_bf16, float& best_v, int& best_i) {
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]) * rs;
  if (lane == 0) {
    gemv_store<MODE>(y_f32, y_bf16, n, acc[0], acc[R - 1]);
    if constexpr (MODE == gemv_out::argmax)
      if (acc[0] > best_v) best_v = acc[0], best_i = n;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
}

constexpr int kNoRow = 0x7fffffff;  // an argmax candidate's row before the warp has finished a row

/// argmax epilogue of a GEMV block: each warp's best (value, row), then one atomicMax of the block's
/// best key. Every thread of the block calls it; best_i == kNoRow: the warp had no row.
__device__ __forceinline__ void gemv_argmax_block(float best_v, int best_i, unsigned long long (&red_key)[kGemvWarps],
                                                  unsigned long long* keys, int index0) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (lane == 0) red_key[warp] = best_i == kNoRow ? 0ull : argmax_key(best_v, best_i + index0);
  __syncthreads();
  if (tid == 0) {
    unsigned long long k = 0;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) k = red_key[w] > k ? red_key[w] : k;
    if (k != 0) atomicMax(keys, k);
  }
}


// ------------------------------------------------------------------------------------------------
// Pipelined per-row GEMV
//
// Each warp walks (row, 256*U-wide chunk) in a grid-stride loop and keeps two chunks in two register
// sets, so it always has U 16-byte loads per lane in flight. Chunk 0 (PRE = 1) or chunks 0 and 1
// (PRE = 2, "deep") are loaded before pdl::wait(), with the norm weights of the first two staging
// passes: weights do not depend on earlier kernels. PRE = 2
// keeps both register sets live across the x staging (fewer resident blocks), which pays only for
// large matrices with long rows (plan_gemv).
// ------------------------------------------------------------------------------------------------

template <gemv_out MODE, bool NORM, int U, int PRE>
__global__ void __launch_bounds__(kGemvThreads) gemv_pipelined_kernel(const bf16* __restrict__ W, int N, int K,
                                                                    GemvIn in, float* y_f32, bf16* y_bf16,
                                                                    unsigned long long* keys, int index0) {
  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  constexpr int kChunk = 256 * U;  // weights per row per chunk (a warp's U loads per lane)
  extern __shared__ uint4 smem_u4[];
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);  // [K]
  __shared__ float red[kGemvWarps];
  __shared__ unsigned long long red_key[kGemvWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int stride = gridDim.x * kGemvWarps;

  using Regs = uint4[R][U];
  auto load = [&](Regs& w, int row, int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = base + u * 256 + lane * 8;
#pragma unroll
      for (int r = 0; r < R; ++r)
        w[r][u] = row < N && k < K ? ld_stream(W + (std::size_t(r) * N + row) * K + k) : make_uint4(0, 0, 0, 0);
    }
  };
  auto advance = [&](int& row, int& base) {
    base += kChunk;
    if (base >= K) base = 0, row += stride;
  };

  float acc[R] = {};
  float best_v = -INFINITY;
  int best_i = kNoRow;
  float rs = 1.f;  // the RMS scale, once x is staged

  auto compute = [&](const Regs& w, int row, int base) {
    gemv_fma_chunk<R, U>(w, xs, K, base + lane * 8, acc);
    if (base + kChunk >= K)  // the row is complete (warp-uniform)
      gemv_finish_row<R, MODE>(acc, rs, row, lane, y_f32, y_bf16, best_v, best_i);
  };

  Regs wa, wb;
  int n = blockIdx.x * kGemvWarps + warp, kb = 0;
  replay::pdl::launch_dependents();
  load(wa, n, kb);  // weights do not depend on earlier kernels
  uint4 gpre[2];
  if constexpr (NORM) norm_weights_prefetch<kGemvWarps>(in, K, gpre);
  if constexpr (PRE == 1) {
    replay::pdl::wait();
    stage_x<NORM, kGemvWarps, NORM>(in, K, xs, red, gpre);
    __syncthreads();
    rs = block_rms_scale<NORM>(red, K, in.eps);
    int n2 = n, kb2 = kb;
    advance(n2, kb2);
    while (n < N) {  // two chunks per trip, so that the register sets never swap (no dynamic indexing)
      load(wb, n2, kb2);
      compute(wa, n, kb);
      n = n2, kb = kb2;
      advance(n2, kb2);
      if (n >= N) break;
      load(wa, n2, kb2);
      compute(wb, n, kb);
      n = n2, kb = kb2;
      advance(n2, kb2);
    }
  } else {
    // Both sets loaded before the wait; (n3, kb3) is the chunk after (n2, kb2), loaded into the set
    // just computed, so two chunks stay in flight.
    int n2 = n, kb2 = kb;
    advance(n2, kb2);
    load(wb, n2, kb2);
    int n3 = n2, kb3 = kb2;
    advance(n3, kb3);
    replay::pdl::wait();
    stage_x<NORM, kGemvWarps, NORM>(in, K, xs, red, gpre);
    __syncthreads();
    rs = block_rms_scale<NORM>(red, K, in.eps);
    auto step = [&]() { n = n2, kb = kb2, n2 = n3, kb2 = kb3, advance(n3, kb3); };
    while (n < N) {  // two chunks per trip (no dynamic indexing of the register sets)
      compute(wa, n, kb);
      load(wa, n3, kb3);
      step();
      if (n >= N) break;
      compute(wb, n, kb);
      load(wb, n3, kb3);
      step();
    }
  }
  if constexpr (MODE == gemv_out::argmax) gemv_argmax_block(best_v, best_i, red_key, keys, index0);
}

// ------------------------------------------------------------------------------------------------
// Per-warp shared-memory ring GEMV
//
// One block per SM owns a contiguous share of the rows; each warp streams its rows through its own
// ring of shared-memory slots filled by bulk copies (cp.async.bulk, lane 0, one mbarrier per slot).
// The bytes in flight cost no registers and a block takes at most kRingSmemBudget of shared memory,
// so the next kernel's block fits beside it: under PDL it launches while this one runs and fills its
// ring before pdl::wait(). Where a warp's share fits its ring (small matrices: every layer matrix of
// the 0.6B shape at batch 1) the whole matrix is on its way into shared memory before the previous
// kernel ends. A slot holds one 1024-wide piece of a row (of the gate and the up row for silu_mul);
// lane l multiplies weights k0 + 256u + 8l .. +8 (u < 4) of each piece, the pipelined GEMV's order
// with U = 4, so the two give bit-identical results.
// ------------------------------------------------------------------------------------------------

constexpr int kRingPiece = 1024;  // weights per row per slot (2 KiB of bf16)
constexpr int kRingMaxSlots = 8;  // slots per warp at most
constexpr std::size_t kRingSmemBudget = 100 * 1024;  // dynamic shared memory per block (x + rings)

template <gemv_out MODE, bool NORM>
__global__ void __launch_bounds__(kGemvThreads) gemv_ring_kernel(const bf16* __restrict__ W, int N, int K, GemvIn in,
                                                                 float* y_f32, bf16* y_bf16, unsigned long long* keys,
                                                                 int index0, int slots) {
  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  constexpr int kSlotElems = R * kRingPiece;
  extern __shared__ uint4 smem_u4[];
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);  // [K] (K % 8 == 0: the rings stay 16-byte aligned)
  __shared__ unsigned long long bars[kGemvWarps][kRingMaxSlots];
  __shared__ float red[kGemvWarps];
  __shared__ unsigned long long red_key[kGemvWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  bf16* ring = xs + K + std::size_t(warp) * slots * kSlotElems;
  unsigned long long* bar = bars[warp];

  // This block's rows [rb, re); this warp's rows rb + warp + 8i; P pieces per row; T items.
  const int rb = static_cast<int>(static_cast<long long>(blockIdx.x) * N / gridDim.x);
  const int re = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * N / gridDim.x);
  const int P = (K + kRingPiece - 1) / kRingPiece;
  const int my_rows = rb + warp < re ? (re - rb - warp + kGemvWarps - 1) / kGemvWarps : 0;
  const int T = my_rows * P;

  auto issue = [&](int t, int s) {  // lane 0: item t (row, piece) into slot s, one bulk copy per row piece
    const int n = rb + warp + (t / P) * kGemvWarps, k0 = (t % P) * kRingPiece;
    const unsigned bytes = static_cast<unsigned>(min(kRingPiece, K - k0)) * sizeof(bf16);
    const unsigned long long pol = evict_first_policy();
    mbar_arrive_tx(bar + s, R * bytes);
#pragma unroll
    for (int r = 0; r < R; ++r)
      bulk_load(ring + std::size_t(s) * kSlotElems + r * kRingPiece, W + (std::size_t(r) * N + n) * K + k0, bytes,
                bar + s, pol);
  };

  replay::pdl::launch_dependents();
  if (lane == 0) {  // weights do not depend on earlier kernels: fill the ring before the wait
    for (int s = 0; s < slots; ++s) mbar_init(bar + s, 1);
    mbar_fence_init();
    for (int t = 0; t < T && t < slots; ++t) issue(t, t);
  }
  __syncwarp();
  uint4 gpre[2];
  if constexpr (NORM) norm_weights_prefetch<kGemvWarps>(in, K, gpre);
  replay::pdl::wait();
  stage_x<NORM, kGemvWarps, NORM, true>(in, K, xs, red, gpre);
  __syncthreads();
  const float rs = block_rms_scale<NORM>(red, K, in.eps);

  float acc[R] = {};
  float best_v = -INFINITY;
  int best_i = kNoRow;

  int s = 0, n = rb + warp, p = 0;
  unsigned parity = 0;
  for (int t = 0; t < T; ++t) {
    mbar_wait(bar + s, parity);
    const bf16* slot = ring + std::size_t(s) * kSlotElems;
    const int k0 = p * kRingPiece;
    uint4 w[R][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = u * 256 + lane * 8;
#pragma unroll
      for (int r = 0; r < R; ++r)
        w[r][u] = k0 + k < K ? *reinterpret_cast<const uint4*>(slot + r * kRingPiece + k) : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();  // every lane has read the slot: refill it
    if (lane == 0 && t + slots < T) {
      fence_proxy_async();
      issue(t + slots, s);
    }
    gemv_fma_chunk<R, 4>(w, xs, K, k0 + lane * 8, acc);
    if (p == P - 1) {
      gemv_finish_row<R, MODE>(acc, rs, n, lane, y_f32, y_bf16, best_v, best_i);
      n += kGemvWarps, p = 0;
    } else {
      ++p;
    }
    if (++s == slots) s = 0, parity ^= 1u;
  }
  if constexpr (MODE == gemv_out::argmax) gemv_argmax_block(best_v, best_i, red_key, keys, index0);
}

// ------------------------------------------------------------------------------------------------
// Tensor-core GEMV for buckets of 2 to 16 rows
//
// The batch is the M side of mma.sync m16n8k16 (x rows, in tiles of 16; rows past B are zero
// fragments) and eight weight rows the N side (eight gate and eight up rows for silu_mul), so the
// arithmetic per weight is a fraction of an instruction and every weight is read once per step at
// any bucket. x is staged once per block in shared memory, each row padded by kMmaPad elements so
// that the fragment loads are free of bank conflicts; with the RMSNorm folded in, as x∘norm_w in one
// pass over the residual (a row split over 8 / B warps below 8 rows), the RMS scale applied to the
// finished sums. The 8 warps of a block split a tile's K in interleaved 32-wide steps and sum their
// partial tiles in shared memory in a fixed order before the GEMV's epilogue: results do not depend
// on the grid, and eager and graph runs agree bit for bit.
// Within a 32-wide step a lane's 16 bytes of a weight row and of an x row feed two mma, so the k
// order inside the step is permuted the same way for both operands (the dot product does not see
// it). Weights stream through a block-wide ring of kMmaStages slots of 8 weight rows x `piece`
// weights: thread 0 fills a slot with one tensor copy (cp.async.bulk.tensor through the matrix's
// tensor map, make_weight_maps) per matrix half, completing on the slot's `full` mbarrier; every
// warp arrives on the slot's `empty` mbarrier once it has read it, and thread 0 waits for that
// before refilling it. All slots are filled before the wait; no block barrier per slot.
// ------------------------------------------------------------------------------------------------

constexpr int kMmaPad = 32;     // elements of padding per staged x row
constexpr int kMmaStages = 4;   // ring slots per block
constexpr int kMmaPieces[3] = {1024, 512, 256};  // weights per row per slot, widest first (at most K)
constexpr int kMmaMaps = int(std::size(kMmaPieces));  // one tensor map per piece
static_assert(std::extent_v<decltype(Linear::wmap)> == kMmaMaps, "Linear::wmap holds one tensor map per piece");
constexpr std::size_t kMmaSmemMax = 226 * 1024;  // dynamic shared memory per block (sm_90: 227 KiB with the static)
constexpr std::size_t kSmemPerSm = 228 * 1024;   // shared memory per SM (sm_90), 1 KiB of it reserved per block

__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/// stage_x for the tensor-core GEMV, one pass over x. With NORM, x∘norm_w in bf16, S =
/// kStageWarps<B> warps per row (each every S-th 256-wide slice of its k); the RMS scale is applied
/// to the finished dot products (W·(x∘g)·rs = W·(x∘g·rs), rms_scale). ss holds each row's scale
/// where one warp stages the row (made by that warp before the block barrier: made by the epilogue's
/// threads instead, the 8- and 16-row steps were slower), else each warp's sum of squares at
/// ss[b * S + slice]. Otherwise every thread copies 8-element pieces of any row, all in flight at once.
template <int B>
constexpr int kStageWarps = B >= kGemvWarps ? 1 : kGemvWarps / B;
template <int B, bool NORM>
__device__ __forceinline__ void stage_x_rows(const GemvIn& in, int K, bf16* xs, int sx,
                                             float (&ss)[B * kStageWarps<B>]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if constexpr (NORM) {
    constexpr int S = kStageWarps<B>;
    for (int q = warp; q < B * S; q += kGemvWarps) {  // (row, slice) q = b * S + slice
      const int b = q / S, slice = q % S;
      const float* xr = in.x_f32 + std::size_t(b) * K;
      float sum = 0.f;
#pragma unroll 4
      for (int k = (slice * 32 + lane) * 8; k < K; k += 256 * S) {
        const uint4 gw = *reinterpret_cast<const uint4*>(in.norm_w + k);
        sum += stage_norm8(xr + k, gw, xs + std::size_t(b) * sx + k);
      }
      sum = warp_sum(sum);
      if (lane == 0) ss[q] = S == 1 ? rsqrtf(sum / K + in.eps) : sum;  // one warp per row: the scale itself
    }
  } else {  // every piece in flight at once (cp.async): one round trip to L2 whatever B * K is
    const int per_row = K / 8;
    for (int i = tid; i < B * per_row; i += kGemvThreads) {
      const int b = i / per_row, k = (i - b * per_row) * 8;
      cp_async16(xs + std::size_t(b) * sx + k, in.x_bf16 + std::size_t(b) * K + k, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
  }
}
/// Row b's RMS scale: ss[b] itself with one staging warp per row, else from the warps' sums of
/// squares, added in slice order.
template <int B>
__device__ __forceinline__ float rms_scale(const float (&ss)[B * kStageWarps<B>], int b, int K, float eps) {
  if constexpr (kStageWarps<B> == 1) return ss[b];
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < kStageWarps<B>; ++j) t += ss[b * kStageWarps<B> + j];
  return rsqrtf(t / K + eps);
}

template <int B, gemv_out MODE, bool NORM>
__global__ void __launch_bounds__(kGemvThreads) gemv_mma_kernel(const __grid_constant__ CUtensorMap wmap, int N, int K,
                                                                GemvIn in, float* y_f32, bf16* y_bf16, int ldy,
                                                                unsigned long long* keys, int index0, int piece) {
  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  constexpr int MT = (B + 15) / 16;                               // 16-row batch tiles
  constexpr int kOut = MT * 128;                                  // outputs of a tile (with padded batch rows)
  constexpr int kPer = (kOut + kGemvThreads - 1) / kGemvThreads;  // outputs per thread in the epilogue
  extern __shared__ uint4 smem_u4[];
  const int sx = K + kMmaPad;                                     // padded x row
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);                    // [B][sx]
  float* red = reinterpret_cast<float*>(xs + std::size_t(B) * sx);  // [warp][MT][R][lane][4]
  // The ring, 1024-byte aligned: slot s is [R][piece / 64][8 rows][64 weights], one 128-byte line per
  // (chunk, row), its 16-byte units swizzled by the tensor copy (unit u of row g's line at u ^ g).
  char* red_end = reinterpret_cast<char*>(red + kGemvWarps * MT * R * 128);
  bf16* ring = reinterpret_cast<bf16*>(red_end + ((1024u - (smem_addr(red_end) & 1023u)) & 1023u));
  __shared__ float ss[B * kStageWarps<B>];
  __shared__ unsigned long long skeys[B];
  __shared__ unsigned long long full[kMmaStages], empty[kMmaStages];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int ntiles = (N + 7) / 8, P = (K + piece - 1) / piece;
  const int my_tiles = blockIdx.x < ntiles ? (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int T = my_tiles * P;  // items: (tile, piece) in order
  const std::size_t slot_elems = std::size_t(R) * 8 * piece;

  // Thread 0: item t into slot s, one tensor copy per matrix half (R); rows past the matrix and k past
  // K arrive as zeros, so a copy always brings the whole box.
  auto issue = [&](int t, int s) {
    if (t >= T) return;
    const int row0 = (blockIdx.x + (t / P) * gridDim.x) * 8, chunk0 = (t % P) * (piece / 64);
    mbar_arrive_tx(full + s, static_cast<unsigned>(slot_elems * sizeof(bf16)));
    const unsigned long long pol = evict_first_policy();
#pragma unroll
    for (int r = 0; r < R; ++r)
      tensor_load_3d(ring + s * slot_elems + std::size_t(r) * 8 * piece, &wmap, 0, r * N + row0, chunk0, full + s, pol);
  };

  float acc[MT][R][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][r][i] = 0.f;
  float best_v[kPer];
  int best_i[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) best_v[j] = -INFINITY, best_i[j] = kNoRow;

  // Lane g multiplies weight row wrow = pi(g) = (g & 1) << 2 | g >> 1 of a slot: the two rows of a
  // quarter warp then sit in different halves of their swizzled lines (no bank conflict). So output
  // column c of an mma tile is weight row pi(c).
  const int wrow = ((g & 1) << 2) | (g >> 1);
  // A tile is complete: the warps' partial tiles summed in warp order, then the epilogue. Output e of
  // a tile is element e % 4 of lane (e / 4) % 32's fragment of batch tile e / 128.
  auto finish = [&](int n0) {
    float4* rw = reinterpret_cast<float4*>(red);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        rw[((warp * MT + m) * R + r) * 32 + lane] = make_float4(acc[m][r][0], acc[m][r][1], acc[m][r][2], acc[m][r][3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][r][i] = 0.f;
      }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = tid + j * kGemvThreads;
      if (kOut % kGemvThreads == 0 || e < kOut) {
        const int m = e / 128, ln = (e / 4) % 32, i = e % 4, c = (ln & 3) * 2 + (i & 1);
        const int b = m * 16 + (ln >> 2) + (i >= 2 ? 8 : 0), n = n0 + (((c & 1) << 2) | (c >> 1));
        float a[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          a[r] = 0.f;
#pragma unroll
          for (int w = 0; w < kGemvWarps; ++w) a[r] += red[(((w * MT + m) * R + r) * 32 + ln) * 4 + i];
        }
        if (b < B && n < N) {
          if constexpr (NORM) {
            const float rs = rms_scale<B>(ss, b, K, in.eps);
#pragma unroll
            for (int r = 0; r < R; ++r) a[r] *= rs;
          }
          gemv_store<MODE>(y_f32, y_bf16, std::size_t(b) * ldy + n, a[0], a[R - 1]);
          if constexpr (MODE == gemv_out::argmax)
            if (a[0] > best_v[j]) best_v[j] = a[0], best_i[j] = n;
        }
      }
    }
    __syncthreads();
  };

  replay::pdl::launch_dependents();
  if (tid == 0) {  // weights do not depend on earlier kernels: fill every slot before the wait
    prefetch_tensormap(&wmap);
    for (int s = 0; s < kMmaStages; ++s) mbar_init(full + s, 1), mbar_init(empty + s, kGemvWarps);
    mbar_fence_init();
    for (int t = 0; t < kMmaStages; ++t) issue(t, t);
  }
  replay::pdl::wait();
  stage_x_rows<B, NORM>(in, K, xs, sx, ss);
  __syncthreads();  // x is staged and the mbarriers initialised

  for (int t = 0; t < T; ++t) {
    const int s = t % kMmaStages, k0 = (t % P) * piece, kw = min(piece, K - k0);
    const int refill = t - 1 + kMmaStages;  // into the slot of item t - 1, once every warp has read it
    if (tid == 0 && t >= 1 && refill < T) {
      mbar_wait(empty + refill % kMmaStages, (refill / kMmaStages - 1) & 1);
      issue(refill, refill % kMmaStages);
    }
    mbar_wait(full + s, (t / kMmaStages) & 1);
    const bf16* slot = ring + s * slot_elems;
    // Warp w takes the 32-wide k steps w, w + 8, ... of the piece: per step and batch tile, a lane's
    // 16 bytes of x (rows g and g + 8) and of weight row wrow feed two mma.
    for (int ks = warp * 32; ks < kw; ks += kGemvWarps * 32) {
      const int k = ks + t4 * 8;
      const int wo = (k >> 6) * 512 + wrow * 64 + ((((k >> 3) & 7) ^ wrow) << 3);  // swizzled offset in a half
      uint4 w[R];
#pragma unroll
      for (int r = 0; r < R; ++r) w[r] = *reinterpret_cast<const uint4*>(slot + std::size_t(r) * 8 * piece + wo);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
        if (B >= 8 || g < B) lo = *reinterpret_cast<const uint4*>(xs + std::size_t(m * 16 + g) * sx + k0 + k);
        if constexpr (B % 16 == 0) hi = *reinterpret_cast<const uint4*>(xs + std::size_t(m * 16 + g + 8) * sx + k0 + k);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          mma_bf16(acc[m][r], lo.x, hi.x, lo.y, hi.y, w[r].x, w[r].y);
          mma_bf16(acc[m][r], lo.z, hi.z, lo.w, hi.w, w[r].z, w[r].w);
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);  // this warp is done with the slot
    if (t % P == P - 1) finish((blockIdx.x + (t / P) * gridDim.x) * 8);
  }
  if constexpr (MODE == gemv_out::argmax) {
    if (tid < B) skeys[tid] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = tid + j * kGemvThreads;
      const int b = (e / 128) * 16 + ((e / 4) % 32 >> 2) + (e % 4 >= 2 ? 8 : 0);
      if (best_i[j] != kNoRow) atomicMax(skeys + b, argmax_key(best_v[j], best_i[j] + index0));
    }
    __syncthreads();
    if (tid < B && skeys[tid] != 0) atomicMax(keys + tid, skeys[tid]);
  }
}

/// The tensor-core GEMV's shared memory: padded x rows, the warps' partial tiles and `slots` ring
/// slots of 8 (R = 2: 16) `piece`-wide weight rows, with 1 KiB for the ring's alignment.
std::size_t mma_shared_bytes(int rows, int K, int R, int piece, int slots) {
  const int MT = (rows + 15) / 16;
  return std::size_t(rows) * (K + kMmaPad) * sizeof(bf16) + std::size_t(kGemvWarps) * MT * R * 128 * sizeof(float) +
         1024 + std::size_t(slots) * R * 8 * piece * sizeof(bf16);
}

constexpr std::size_t kMaxStageBytes = 200 * 1024;  // x of the batch-1 GEMVs in shared memory: K bf16 at most

/// Calls f(kernel) with the instance of `Pick<MODE, NORM>` for the runtime mode and input. NORM is on
/// for the projections that read the residual (QKV, gate/up, lm_head) and off for those that read a
/// bf16 activation (O, down): add_f32 reads a bf16 activation; store_f32 reads either (a bf16 one on
/// the tensor-parallel ranks that store their partial O and down products); the others the residual.
template <template <gemv_out, bool> class Pick, class F>
void by_mode(gemv_out mode, bool norm, F&& f) {
  switch (mode) {
    case gemv_out::store_f32:
      if (!norm) return f(Pick<gemv_out::store_f32, false>::kernel);
      return f(Pick<gemv_out::store_f32, true>::kernel);
    case gemv_out::silu_mul: return f(Pick<gemv_out::silu_mul, true>::kernel);
    case gemv_out::argmax: return f(Pick<gemv_out::argmax, true>::kernel);
    case gemv_out::add_f32: return f(Pick<gemv_out::add_f32, false>::kernel);
  }
}
template <gemv_out M, bool N>
struct Ring {
  static constexpr auto kernel = gemv_ring_kernel<M, N>;
};
template <gemv_out M, bool N>
struct Pipelined {
  static constexpr auto kernel = gemv_pipelined_kernel<M, N, 4, 1>;
};
template <gemv_out M, bool N>
struct PipelinedDeep {
  static constexpr auto kernel = gemv_pipelined_kernel<M, N, 4, 2>;
};
template <int B>
struct Mma {
  template <gemv_out M, bool N>
  struct at {
    static constexpr auto kernel = gemv_mma_kernel<B, M, N>;
  };
};
/// The tensor-core GEMV's instance for (rows, mode, norm), rows 2 to 16.
template <class F>
void with_mma(int rows, gemv_out mode, bool norm, F&& f) {
  switch (rows) {
    case 2: return by_mode<Mma<2>::at>(mode, norm, f);
    case 4: return by_mode<Mma<4>::at>(mode, norm, f);
    case 8: return by_mode<Mma<8>::at>(mode, norm, f);
    case 16: return by_mode<Mma<16>::at>(mode, norm, f);
    default: throw replay::usage_error("qwen::gemv: rows must be 2, 4, 8 or 16 for the tensor-core GEMV");
  }
}

void check_linear(const Linear& op, int rows) {
  if (op.W == nullptr || op.N < 1 || op.K < 8 || op.K % 8 != 0)
    throw replay::usage_error("qwen::gemv: needs W, N >= 1 and K a positive multiple of 8");
  if (reinterpret_cast<std::uintptr_t>(op.W) % 16 != 0)
    throw replay::usage_error("qwen::gemv: W must be 16-byte aligned");
  if (op.mode != gemv_out::store_f32 && (op.in.norm_w != nullptr) != (op.mode != gemv_out::add_f32))
    throw replay::usage_error("qwen::gemv: residual-add projections read bf16 x; silu_mul and argmax the normalised "
                              "residual");
  if (rows <= kGemvMaxRows && std::size_t(rows) * op.K * sizeof(bf16) > kMaxStageBytes)
    throw replay::usage_error("qwen::gemv: rows * K too large for the shared-memory stage");
}

struct MmaLayout {
  int piece = 0;          // weights per row per slot
  int map = 0;            // its index in kMmaPieces (and Linear::wmap)
  std::size_t bytes = 0;  // dynamic shared memory
};

/// The tensor-core GEMV's ring for (rows, op): the widest piece (1024, 512 or 256 weights per row;
/// wider pieces stream faster) whose kMmaStages slots fit beside x within kMmaSmemMax. nullopt
/// where none does.
std::optional<MmaLayout> mma_layout(const Linear& op, int rows) {
  if (op.K % 64 != 0) return std::nullopt;
  const int R = op.mode == gemv_out::silu_mul ? 2 : 1;
  for (int m = 0; m < kMmaMaps; ++m) {
    const int pc = std::min(kMmaPieces[m], op.K);
    const std::size_t bytes = mma_shared_bytes(rows, op.K, R, pc, kMmaStages);
    if (bytes <= kMmaSmemMax) return MmaLayout{pc, m, bytes};
  }
  return std::nullopt;
}

}  // namespace

bool gemv_fits(const Linear& op, int rows) {
  if (rows < 1 || rows > kMmaMaxRows || (rows & (rows - 1)) != 0) return false;
  if (rows <= kGemvMaxRows) return std::size_t(rows) * op.K * sizeof(bf16) <= kMaxStageBytes;
  return mma_layout(op, rows).has_value();
}

GemvPlan plan_gemv(const Linear& op, int rows, int num_sms) {
  check_linear(op, rows);
  const int R = op.mode == gemv_out::silu_mul ? 2 : 1;
  GemvPlan p;
  if (rows > kGemvMaxRows) {
    const auto l = mma_layout(op, rows);
    if (!l) throw replay::usage_error("qwen::gemv: rows * K too large for the tensor-core GEMV");
    // Two blocks per SM where they fit, else one (at most one per 8-row tile): a block's warps sum
    // their partial tiles at the end of each tile (a barrier), and a second block on the SM keeps
    // its loads going meanwhile.
    p.kind = GemvPlan::kernel::mma;
    p.shared_bytes = l->bytes;
    p.piece = l->piece;
    p.wmap = l->map;
    const int per_sm = 2 * (l->bytes + 2048) <= kSmemPerSm ? 2 : 1;
    const int tiles = (op.N + 7) / 8;
    p.grid = tiles < per_sm * num_sms ? tiles : per_sm * num_sms;
    return p;
  }
  // Ring: one block per SM (at most one per row), slots per warp from the shared memory left after
  // x; only where every warp's share of the rows fits its ring (streaming larger matrices through
  // the rings keeps too few bytes in flight per SM).
  const std::size_t xbytes = std::size_t(rows) * op.K * sizeof(bf16);
  const std::size_t slot_bytes = std::size_t(kGemvWarps) * R * kRingPiece * sizeof(bf16);
  const int slots = xbytes >= kRingSmemBudget ? 0 : static_cast<int>((kRingSmemBudget - xbytes) / slot_bytes);
  const int ns = slots < kRingMaxSlots ? slots : kRingMaxSlots;
  const int ring_grid = op.N < num_sms ? op.N : num_sms;
  const int rows_per_block = (op.N + ring_grid - 1) / ring_grid;
  const int items_per_warp = (rows_per_block + kGemvWarps - 1) / kGemvWarps * ((op.K + kRingPiece - 1) / kRingPiece);
  if (ns >= 2 && items_per_warp <= ns) {
    // The rings take the whole budget even where a share needs fewer slots: smaller blocks would let
    // more later kernels' blocks onto the SM, whose prefetches compete with the critical path.
    p.kind = GemvPlan::kernel::ring;
    p.grid = ring_grid;
    p.shared_bytes = xbytes + ns * slot_bytes;
    p.slots = ns;
    return p;
  }
  // Pipelined: both register sets loaded before the wait for rows of three chunks or more and a
  // matrix of 16 MiB or more (where the round trip it hides costs more than the resident block it
  // loses).
  const bool deep = (op.K + 1023) / 1024 >= 3 && std::size_t(op.N) * R * op.K * sizeof(bf16) >= (16u << 20);
  p.kind = deep ? GemvPlan::kernel::pipelined_deep : GemvPlan::kernel::pipelined;
  p.shared_bytes = xbytes;
  int per_sm = 0;
  auto occupancy = [&](auto kernel) {
    REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvThreads, p.shared_bytes));
  };
  const bool norm = op.in.norm_w != nullptr;
  if (deep) by_mode<PipelinedDeep>(op.mode, norm, occupancy);
  else by_mode<Pipelined>(op.mode, norm, occupancy);
  // The grid is capped at what is resident at once, so x is staged once per resident block.
  const int cap = (per_sm < 1 ? 1 : per_sm) * num_sms;
  const int want = (op.N + kGemvWarps - 1) / kGemvWarps;
  p.grid = want < cap ? want : cap;
  return p;
}

void launch_gemv(const Linear& op, int rows, const GemvPlan& plan, replay::stream_ref s) {
  if (plan.grid < 1) throw replay::usage_error("qwen::launch_gemv: no plan (plan_gemv)");
  const replay::launch_config c{.grid = dim3(plan.grid), .block = dim3(kGemvThreads),
                                .shared_bytes = plan.shared_bytes, .stream = s, .pdl = true};
  if (plan.kind != GemvPlan::kernel::mma && rows != 1)
    throw replay::usage_error("qwen::launch_gemv: the CUDA-core GEMVs serve 1 row");
  const bool norm = op.in.norm_w != nullptr;
  auto pipelined = [&](auto k) {
    replay::launch(k, c, op.W, op.N, op.K, op.in, op.y_f32, op.y_bf16, op.keys, op.index0);
  };
  switch (plan.kind) {
    case GemvPlan::kernel::ring:
      by_mode<Ring>(op.mode, norm, [&](auto k) {
        replay::launch(k, c, op.W, op.N, op.K, op.in, op.y_f32, op.y_bf16, op.keys, op.index0, plan.slots);
      });
      break;
    case GemvPlan::kernel::pipelined: by_mode<Pipelined>(op.mode, norm, pipelined); break;
    case GemvPlan::kernel::pipelined_deep: by_mode<PipelinedDeep>(op.mode, norm, pipelined); break;
    case GemvPlan::kernel::mma:
      with_mma(rows, op.mode, norm, [&](auto k) {
        replay::launch(k, c, op.wmap[plan.wmap], op.N, op.K, op.in, op.y_f32, op.y_bf16, op.ldy, op.keys, op.index0,
                       plan.piece);
      });
      break;
  }
}

void make_weight_maps(Linear& op) {
  // The driver's encoder, through the runtime (no link against the driver library).
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    REPLAY_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
#else
    REPLAY_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
#endif
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      throw std::runtime_error("qwen: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (op.W == nullptr || op.K % 64 != 0) return;  // not served by the tensor-core GEMV (mma_layout)
  const int R = op.mode == gemv_out::silu_mul ? 2 : 1;
  // The row-major [R N][K] weights viewed in 3-D as (64 weights, row, 64-weight chunk): a box of
  // (64, 8 rows, piece / 64 chunks) lands as [chunk][row][64], one 128-byte line per (chunk, row).
  const cuuint64_t dims[3] = {64, cuuint64_t(R) * op.N, cuuint64_t(op.K / 64)};
  const cuuint64_t strides[2] = {cuuint64_t(op.K) * sizeof(bf16), 64 * sizeof(bf16)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  for (int i = 0; i < kMmaMaps; ++i) {
    const cuuint32_t box[3] = {64, 8, cuuint32_t(std::min(kMmaPieces[i], op.K) / 64)};
    const CUresult r = encode(&op.wmap[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(op.W), dims, strides,
                              box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) throw std::runtime_error(fmt::format("qwen: cuTensorMapEncodeTiled failed (CUresult {})", int(r)));
  }
}

void init_gemv_attributes() {
  // Every kernel of the step asks for the most shared memory (one L1/shared split): an SM runs
  // blocks of kernels with one configuration at a time, so differing splits would not overlap
  // under PDL.
  auto attrs = [](std::size_t max_dynamic) {
    return [max_dynamic](auto kernel) {
      REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_dynamic)));
      REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    };
  };
  auto instances = [&](gemv_out m, bool norm) {
    by_mode<Ring>(m, norm, attrs(kMaxStageBytes));
    by_mode<Pipelined>(m, norm, attrs(kMaxStageBytes));
    by_mode<PipelinedDeep>(m, norm, attrs(kMaxStageBytes));
    for (int rows : {2, 4, 8, 16}) with_mma(rows, m, norm, attrs(kMmaSmemMax));
  };
  instances(gemv_out::store_f32, true);
  instances(gemv_out::store_f32, false);
  instances(gemv_out::silu_mul, true);
  instances(gemv_out::argmax, true);
  instances(gemv_out::add_f32, false);
}

}  // namespace qwen
