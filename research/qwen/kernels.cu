// research/qwen/kernels.cu: kernels of the Qwen3 decoder, then their launchers.
//
// Precision: bf16 weights and KV cache, fp32 accumulation everywhere, fp32 residual stream; the
// inputs of the projections are rounded to bf16 (as in a bf16 Hugging Face model).
#include "kernels.cuh"
#include "device_helpers.cuh"

#include <replay/error.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>
#include <utility>

namespace qwen {
namespace {

using namespace dev;

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

__global__ void fill_random_kernel(bf16* p, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::uint64_t h = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}

__global__ void fill_const_kernel(bf16* p, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(v);
}

__global__ void rope_table_kernel(float2* rope, int max_pos, int half, int head_dim, float theta) {
  const int total = max_pos * half;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int p = i / half, j = i % half;
    // As transformers computes it in fp32: inv_freq = 1 / theta^(2j/d); angle = pos * inv_freq.
    const float inv = 1.0f / powf(theta, static_cast<float>(2 * j) / static_cast<float>(head_dim));
    const float a = static_cast<float>(p) * inv;
    float s, c;
    sincosf(a, &s, &c);
    rope[i] = make_float2(c, s);
  }
}

__global__ void embed_kernel(const bf16* __restrict__ embed, int vocab, int hidden, RowMeta meta, float* residual,
                             unsigned long long* keys) {
  pdl_trigger();
  pdl_wait();
  const int r = blockIdx.x;
  int tok = meta.token[r];
  tok = tok < 0 ? 0 : (tok >= vocab ? vocab - 1 : tok);  // inputs are validated on the host; stay in bounds
  if (threadIdx.x == 0) keys[r] = 0ull;
  const bf16* src = embed + std::size_t(tok) * hidden;
  float* dst = residual + std::size_t(r) * hidden;
  for (int k = threadIdx.x * 8; k < hidden; k += blockDim.x * 8) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(src + k), f);
    *reinterpret_cast<float4*>(dst + k) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(dst + k + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
}

/// Stages the GEMV input for B batch rows in shared memory as bf16: x copied as is, or the fp32
/// residual RMS-normalised with in.norm_w (the layer's RMSNorm fused into the projection). Every
/// thread of the block takes part; the caller synchronises before reading xs.
/// The RMSNorm weights a thread of stage_x uses in its first two passes (k = 8 tid + 2048 i for 256
/// threads), loaded before griddepcontrol.wait: they do not depend on earlier kernels, and loading
/// them after it put one more round trip to L2 on the critical path.
template <int WARPS>
__device__ __forceinline__ void norm_weights_prefetch(const GemvIn& in, int K, uint4 (&g)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int k = threadIdx.x * 8 + i * (WARPS * 32) * 8;
    g[i] = in.norm_w != nullptr && k < K ? *reinterpret_cast<const uint4*>(in.norm_w + k) : make_uint4(0, 0, 0, 0);
  }
}

template <int B, bool NORM, int WARPS, bool PREG = false>
__device__ __forceinline__ void stage_x(const GemvIn& in, int K, bf16* xs, float (&red)[WARPS][B],
                                        const uint4 (&gpre)[2] = {}) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if constexpr (NORM) {
    float ss[B];
#pragma unroll
    for (int b = 0; b < B; ++b) ss[b] = 0.f;
    for (int k = tid * 4; k < K; k += (WARPS * 32) * 4) {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 v = *reinterpret_cast<const float4*>(in.x_f32 + std::size_t(b) * K + k);
        ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      ss[b] = warp_sum(ss[b]);
      if (lane == 0) red[warp][b] = ss[b];
    }
    __syncthreads();
    float rs[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w][b];
      rs[b] = rsqrtf(s / K + in.eps);
    }
    for (int k = tid * 8, pass = 0; k < K; k += (WARPS * 32) * 8, ++pass) {
      float g[8];
      unpack8(PREG && pass < 2 ? (pass == 0 ? gpre[0] : gpre[1]) : *reinterpret_cast<const uint4*>(in.norm_w + k), g);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 a = *reinterpret_cast<const float4*>(in.x_f32 + std::size_t(b) * K + k);
        const float4 c = *reinterpret_cast<const float4*>(in.x_f32 + std::size_t(b) * K + k + 4);
        uint4 o;
        o.x = pack2(a.x * rs[b] * g[0], a.y * rs[b] * g[1]);
        o.y = pack2(a.z * rs[b] * g[2], a.w * rs[b] * g[3]);
        o.z = pack2(c.x * rs[b] * g[4], c.y * rs[b] * g[5]);
        o.w = pack2(c.z * rs[b] * g[6], c.w * rs[b] * g[7]);
        *reinterpret_cast<uint4*>(xs + std::size_t(b) * K + k) = o;
      }
    }
  } else {
    for (int k = tid * 8; k < K; k += (WARPS * 32) * 8) {
#pragma unroll
      for (int b = 0; b < B; ++b)
        *reinterpret_cast<uint4*>(xs + std::size_t(b) * K + k) =
            *reinterpret_cast<const uint4*>(in.x_bf16 + std::size_t(b) * K + k);
    }
  }
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

/// One chunk of a warp's row(s): acc[r][b] += w[r][u] · x[b] for the U 16-byte pieces at
/// k0 + 256 u (k0 includes the lane's 8-element offset); pieces at or past K are skipped.
template <int B, int R, int U>
__device__ __forceinline__ void gemv_fma_chunk(const uint4 (&w)[R][U], const bf16* xs, int K, int k0,
                                               float (&acc)[R][B]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = k0 + u * 256;
    if (k < K) {
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) unpack8(w[r][u], wf[r]);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(xs + std::size_t(b) * K + k), xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][b] = fmaf(wf[r][j], xf[j], acc[r][b]);
      }
    }
  }
}

/// A warp's row n is complete: warp sums, lane 0 runs the epilogue of MODE and tracks the argmax,
/// and acc is cleared for the next row.
template <int B, int R, gemv_out MODE>
__device__ __forceinline__ void gemv_finish_row(float (&acc)[R][B], int n, int lane, float* y_f32, bf16* y_bf16,
                                                int ldy, float (&best_v)[B], int (&best_i)[B]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = warp_sum(acc[r][b]);
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      gemv_store<MODE>(y_f32, y_bf16, std::size_t(b) * ldy + n, acc[0][b], acc[R - 1][b]);
      if constexpr (MODE == gemv_out::argmax)
        if (acc[0][b] > best_v[b]) best_v[b] = acc[0][b], best_i[b] = n;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
}

/// A GEMV warp's state before its first row: accumulators zero, no argmax candidate yet.
template <int B, int R>
__device__ __forceinline__ void gemv_warp_init(float (&acc)[R][B], float (&best_v)[B], int (&best_i)[B]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
#pragma unroll
  for (int b = 0; b < B; ++b) best_v[b] = -INFINITY, best_i[b] = 0x7fffffff;
}

/// argmax epilogue of a GEMV block: each warp's best (value, row) per batch row, then one atomicMax of
/// the block's best key per batch row. Every thread of the block calls it.
template <int B>
__device__ __forceinline__ void gemv_argmax_block(const float (&best_v)[B], const int (&best_i)[B],
                                                  unsigned long long (&red_key)[kGemvWarps][B],
                                                  unsigned long long* keys) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < B; ++b) red_key[warp][b] = best_i[b] == 0x7fffffff ? 0ull : argmax_key(best_v[b], best_i[b]);
  }
  __syncthreads();
  if (tid < B) {
    unsigned long long k = 0;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) k = red_key[w][tid] > k ? red_key[w][tid] : k;
    if (k != 0) atomicMax(keys + tid, k);
  }
}

/// Fused GEMV for B batch rows: stage x (copied, or RMS-normalised from the fp32 residual) in shared
/// memory as bf16, then each warp computes output rows in a grid-stride loop with 16-byte streaming
/// loads of W, U of them in flight per row, fp32 accumulation, and the epilogue of MODE.
template <int B, gemv_out MODE, bool NORM, int U>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(const bf16* __restrict__ W, int N, int K, GemvIn in,
                                                            float* y_f32, bf16* y_bf16, int ldy,
                                                            unsigned long long* keys) {
  extern __shared__ uint4 smem_u4[];
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);  // [B][K]
  __shared__ float red[kGemvWarps][B];
  __shared__ unsigned long long red_key[kGemvWarps][B];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  pdl_trigger();
  {  // Weights do not depend on earlier kernels: start streaming this warp's first row into L2.
    const int n0 = blockIdx.x * kGemvWarps + warp;
    if (n0 < N) {
      for (int k = lane * 64; k < K; k += 32 * 64) prefetch_l2(W + std::size_t(n0) * K + k);
      if (MODE == gemv_out::silu_mul)
        for (int k = lane * 64; k < K; k += 32 * 64) prefetch_l2(W + std::size_t(n0 + N) * K + k);
    }
  }
  pdl_wait();
  stage_x<B, NORM, kGemvWarps>(in, K, xs, red);
  __syncthreads();

  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  float best_v[B];
  int best_i[B];
#pragma unroll
  for (int b = 0; b < B; ++b) best_v[b] = -INFINITY, best_i[b] = 0x7fffffff;

  for (int n = blockIdx.x * kGemvWarps + warp; n < N; n += gridDim.x * kGemvWarps) {
    const bf16* wrow[R];
    wrow[0] = W + std::size_t(n) * K;
    if constexpr (R == 2) wrow[R - 1] = W + std::size_t(n + N) * K;
    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.f;

    for (int k0 = lane * 8; k0 < K; k0 += 32 * 8 * U) {
      uint4 w[R][U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * 256;
#pragma unroll
        for (int r = 0; r < R; ++r) w[r][u] = k < K ? ld_stream(wrow[r] + k) : make_uint4(0, 0, 0, 0);
      }
      gemv_fma_chunk<B, R, U>(w, xs, K, k0, acc);
    }
    gemv_finish_row<B, R, MODE>(acc, n, lane, y_f32, y_bf16, ldy, best_v, best_i);
  }
  if constexpr (MODE == gemv_out::argmax) gemv_argmax_block<B>(best_v, best_i, red_key, keys);
}

// ------------------------------------------------------------------------------------------------
// Pipelined per-row GEMV (the default decode kernels of buckets 1..4)
//
// The per-row GEMV above issues a warp's U loads, waits for them, computes, and only then issues the
// next U: while a warp computes it has nothing in flight, so the bytes in flight per SM (what
// bandwidth needs) depend on how many other warps happen to be waiting. Here each warp walks the
// same (row, 256*U-wide chunk) sequence but keeps two chunks in two register sets, so it always has
// U loads per lane in flight. Chunk 0 (PRE = 1) or chunks 0 and 1 (PRE = 2) are loaded before
// griddepcontrol.wait (weights do not depend on earlier kernels). PRE = 2 keeps both register sets
// live across the x staging (68-74 registers instead of 61-64: 3 blocks of 256 threads per SM
// instead of 4): the launcher picks it where the round trip it hides costs more than the lost
// block (large matrices with long rows; H200, one GEMV type per graph: 4B down 17.6 -> 16.5 us per
// kernel, QKV 12.0 -> 11.1 us; 0.6B QKV 4.7 -> 5.1 us).
// ------------------------------------------------------------------------------------------------

template <int B, gemv_out MODE, bool NORM, int U, int PRE>
__global__ void __launch_bounds__(kGemvThreads) gemv_rowpipe_kernel(const bf16* __restrict__ W, int N, int K,
                                                                    GemvIn in, float* y_f32, bf16* y_bf16, int ldy,
                                                                    unsigned long long* keys) {
  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  constexpr int kChunk = 256 * U;  // weights per row per chunk (a warp's U loads per lane)
  extern __shared__ uint4 smem_u4[];
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);  // [B][K]
  __shared__ float red[kGemvWarps][B];
  __shared__ unsigned long long red_key[kGemvWarps][B];
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

  float acc[R][B];
  float best_v[B];
  int best_i[B];
  gemv_warp_init<B, R>(acc, best_v, best_i);

  auto compute = [&](const Regs& w, int row, int base) {
    gemv_fma_chunk<B, R, U>(w, xs, K, base + lane * 8, acc);
    if (base + kChunk >= K)  // the row is complete (warp-uniform)
      gemv_finish_row<B, R, MODE>(acc, row, lane, y_f32, y_bf16, ldy, best_v, best_i);
  };

  Regs wa, wb;
  int n = blockIdx.x * kGemvWarps + warp, kb = 0;
  pdl_trigger();
  load(wa, n, kb);  // weights do not depend on earlier kernels
  if constexpr (PRE == 1) {
    pdl_wait();
    stage_x<B, NORM, kGemvWarps>(in, K, xs, red);
    __syncthreads();
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
    pdl_wait();
    stage_x<B, NORM, kGemvWarps>(in, K, xs, red);
    __syncthreads();
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
  if constexpr (MODE == gemv_out::argmax) gemv_argmax_block<B>(best_v, best_i, red_key, keys);
}

// ------------------------------------------------------------------------------------------------
// Per-warp shared-memory ring GEMV (`ring` decode kernels)
//
// The register-pipelined GEMV fills every SM's register file (3-4 blocks of 256 threads), so the
// next kernel's blocks can only become resident, and start loading their weights, as this kernel's
// blocks exit: at every kernel boundary DRAM idles for the tail, the launch and the x staging. Here
// one block per SM owns a contiguous share of the rows and each warp streams its own rows through its
// own ring of shared-memory slots filled by bulk copies (cp.async.bulk, issued by lane 0, completing
// on one mbarrier per slot). The bytes in flight cost no registers, and a block takes about half an
// SM's shared memory, so the next kernel's block fits beside it: it launches (PDL) while this one
// runs and fills its whole ring before griddepcontrol.wait. For the 0.6B shape's layer matrices the
// rings hold the whole matrix, so the weights are in shared memory before the previous kernel ends.
// A slot holds one 1024-wide piece of a row (of the gate and the up row for silu_mul); lane l
// multiplies weights k0 + 256u + 8l .. +8 (u < 4) of each piece, in the same order as the pipelined
// GEMV with U = 4, so the two give bit-identical results. Each warp refills a slot as soon as its
// lanes have read it; no block-wide barrier after the x staging.
// ------------------------------------------------------------------------------------------------

constexpr int kRingPiece = 1024;  // weights per row per slot (2 KiB of bf16)
constexpr int kRingMaxSlots = 8;  // slots per warp at most
constexpr std::size_t kRingSmemBudget = 100 * 1024;  // dynamic shared memory per block (x + rings)

template <int B, gemv_out MODE, bool NORM>
__global__ void __launch_bounds__(kGemvThreads) gemv_ring_kernel(const bf16* __restrict__ W, int N, int K, GemvIn in,
                                                                 float* y_f32, bf16* y_bf16, int ldy,
                                                                 unsigned long long* keys, int slots,
                                                                 unsigned long long* trace) {
  constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
  constexpr int kSlotElems = R * kRingPiece;
  const unsigned long long t_start = trace != nullptr ? global_ns() : 0;
  extern __shared__ uint4 smem_u4[];
  bf16* xs = reinterpret_cast<bf16*>(smem_u4);  // [B][K] (K % 8 == 0: the rings stay 16-byte aligned)
  __shared__ unsigned long long bars[kGemvWarps][kRingMaxSlots];
  __shared__ float red[kGemvWarps][B];
  __shared__ unsigned long long red_key[kGemvWarps][B];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  bf16* ring = xs + std::size_t(B) * K + std::size_t(warp) * slots * kSlotElems;
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

  pdl_trigger();
  if (lane == 0) {  // weights do not depend on earlier kernels: fill the ring before the wait
    for (int s = 0; s < slots; ++s) mbar_init(bar + s, 1);
    mbar_fence_init();
    for (int t = 0; t < T && t < slots; ++t) issue(t, t);
  }
  __syncwarp();
  uint4 gpre[2];
  if constexpr (NORM) norm_weights_prefetch<kGemvWarps>(in, K, gpre);
  pdl_wait();
  const unsigned long long t_wait = trace != nullptr ? global_ns() : 0;
  stage_x<B, NORM, kGemvWarps, NORM>(in, K, xs, red, gpre);
  __syncthreads();
  const unsigned long long t_staged = trace != nullptr ? global_ns() : 0;

  float acc[R][B];
  float best_v[B];
  int best_i[B];
  gemv_warp_init<B, R>(acc, best_v, best_i);

  int s = 0, n = rb + warp, p = 0;
  unsigned parity = 0;
  unsigned long long t_data = 0;
  for (int t = 0; t < T; ++t) {
    mbar_wait(bar + s, parity, s);
    if (trace != nullptr && t == T - 1) t_data = global_ns();
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
    gemv_fma_chunk<B, R, 4>(w, xs, K, k0 + lane * 8, acc);
    if (p == P - 1) {
      gemv_finish_row<B, R, MODE>(acc, n, lane, y_f32, y_bf16, ldy, best_v, best_i);
      n += kGemvWarps, p = 0;
    } else {
      ++p;
    }
    if (++s == slots) s = 0, parity ^= 1u;
  }
  if constexpr (MODE == gemv_out::argmax) gemv_argmax_block<B>(best_v, best_i, red_key, keys);
  if (trace != nullptr) {  // diagnostics (QWEN_RING_TRACE): entry, wait released, x staged, this warp done
    unsigned long long* rec = trace + std::size_t(blockIdx.x) * (kGemvWarps + 4);
    if (tid == 0) rec[0] = t_start, rec[1] = t_wait, rec[2] = t_staged, rec[3 + kGemvWarps] = t_data;
    if (lane == 0) rec[3 + warp] = global_ns();
  }
}

/// launch_read_link: the read probe's loop, with its first loads issued before the PDL wait.
__global__ void __launch_bounds__(256) read_link_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  pdl_trigger();
  unsigned acc = 0;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
  pdl_wait();
  for (;;) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    i += 4 * stride;
    if (i >= n) break;
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // practically never; keeps the loads alive
}

/// Read-bandwidth probe: every thread streams 16-byte loads, 4 in flight, over `n` uint4 (grid-stride)
/// and folds them into one word so that the loads cannot be dropped.
__global__ void __launch_bounds__(256) read_probe_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = ld_stream(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // practically never; keeps the loads alive
}

__global__ void rmsnorm_kernel(const float* residual, const bf16* w, int hidden, float eps, bf16* out) {
  pdl_trigger();
  pdl_wait();
  const int r = blockIdx.x;
  const float* x = residual + std::size_t(r) * hidden;
  __shared__ float red[32];
  float ss = 0.f;
  for (int k = threadIdx.x; k < hidden; k += blockDim.x) ss += x[k] * x[k];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) s += red[i];
  const float rs = rsqrtf(s / hidden + eps);
  for (int k = threadIdx.x; k < hidden; k += blockDim.x)
    out[std::size_t(r) * hidden + k] = __float2bfloat16(x[k] * rs * __bfloat162float(w[k]));
}

__global__ void silu_mul_kernel(const float* gu, int N, int rows, bf16* act) {
  pdl_trigger();
  pdl_wait();
  const std::size_t total = std::size_t(rows) * N;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < total;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t r = i / N, n = i % N;
    const float g = gu[r * 2 * N + n], u = gu[r * 2 * N + N + n];
    act[i] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
  }
}

__global__ void argmax_kernel(const float* logits, int V, unsigned long long* keys) {
  pdl_trigger();
  pdl_wait();
  const int r = blockIdx.x;
  const float* x = logits + std::size_t(r) * V;
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const unsigned long long k = argmax_key(x[i], i);
    best = k > best ? k : best;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  __shared__ unsigned long long red[32];
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < int(blockDim.x >> 5); ++i) best = red[i] > best ? red[i] : best;
    keys[r] = best;
  }
}

__device__ __forceinline__ bf16* kv_slot_ptr(const KvPool& kv, bf16* layer_base, int blk, int head, int off) {
  return layer_base + ((std::size_t(blk) * kv.kv_heads + head) * kv.block_size + off) * kv.head_dim;
}

/// Norm + RoPE of K head `h` of row r, and its V, written into the paged pool at the row's position.
/// `blk` is the physical block holding position `pos` of the row's sequence.
template <int D>
__device__ __forceinline__ void write_kv_head(const float* qkv_row, int q_dim, int kv_dim, const bf16* k_norm,
                                              float eps, const float2* rope, int pos, int blk, const KvPool& kv,
                                              int layer, int h, int lane, bf16* k_s = nullptr,
                                              bf16* v_s = nullptr) {
  constexpr int E = D / 64;
  const int off = pos % kv.block_size;
  bf16* kbase = kv.base + std::size_t(layer) * kv.layer_stride();
  bf16* kp = kv_slot_ptr(kv, kbase, blk, h, off);
  bf16* vp = kv_slot_ptr(kv, kbase + kv.kv_stride(), blk, h, off);
  const float* v = qkv_row + q_dim + kv_dim + h * D;
  float vv[D / 32];  // V loaded together with K (one round trip)
#pragma unroll
  for (int i = 0; i < D / 32; ++i) vv[i] = __ldcg(v + lane + 32 * i);
  float lo[E], hi[E];
  norm_rope_head<D>(qkv_row + q_dim + h * D, k_norm, eps, rope + std::size_t(pos) * (D / 2), lane, lo, hi);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    kp[lane * E + e] = __float2bfloat16(lo[e]);
    kp[D / 2 + lane * E + e] = __float2bfloat16(hi[e]);
    if (k_s != nullptr) {
      k_s[lane * E + e] = __float2bfloat16(lo[e]);
      k_s[D / 2 + lane * E + e] = __float2bfloat16(hi[e]);
    }
  }
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const bf16 x = __float2bfloat16(vv[i]);
    vp[lane + 32 * i] = x;
    if (v_s != nullptr) v_s[lane + 32 * i] = x;
  }
}

template <int D>
__global__ void kv_write_kernel(const float* qkv, int q_dim, int kv_dim, const bf16* k_norm, float eps,
                                const float2* rope, RowMeta meta, KvPool kv, int layer) {
  pdl_trigger();
  pdl_wait();
  const int r = blockIdx.x, h = blockIdx.y;
  const float* row = qkv + std::size_t(r) * (q_dim + 2 * kv_dim);
  const int pos = meta.pos[r];
  const int blk = meta.block_table[std::size_t(meta.slot[r]) * meta.table_width + pos / kv.block_size];
  write_kv_head<D>(row, q_dim, kv_dim, k_norm, eps, rope, pos, blk, kv, layer, h, threadIdx.x & 31);
}

constexpr int kAttnWarps = 8;

/// One block per (kv head, row, split): the G query heads sharing that kv head. 8 lanes per token
/// (DPL dims each), 4 tokens per warp and 32 per block in flight; online softmax per lane group,
/// then a combine across groups (shuffles) and warps (shared memory).
/// Split-KV (AttnSplit, decode): a long context is cut into chunks of at least sp.min_chunk
/// positions, one block each (grid z; blocks past the last chunk exit at once). With one chunk the
/// block writes the output itself; otherwise each block stores its partial softmax state and the
/// last block to finish (a counter per (row, kv head)) combines the chunks and writes the output.
template <int D, int G, int MINB>
__global__ void __launch_bounds__(kAttnWarps * 32, MINB)
    attention_kernel(const float* qkv, int q_dim, int kv_dim, const bf16* q_norm, const bf16* k_norm, float eps,
                     const float2* rope, RowMeta meta, KvPool kv, int layer, int write_kv, AttnSplit sp, bf16* out,
                     unsigned long long* trace) {
  const unsigned long long t_start = trace != nullptr ? global_ns() : 0;
  constexpr int E = D / 64;
  constexpr int DPL = D / 8;  // dims per lane
  constexpr int NV = DPL / 8; // uint4 loads per lane per token
  __shared__ float q_s[G][D];
  __shared__ float red_m[kAttnWarps][G], red_l[kAttnWarps][G];
  __shared__ float red_acc[kAttnWarps][G][D];
  __shared__ __align__(16) bf16 k_new[D], v_new[D];  // decode: position pos's K/V as written to the cache

  pdl_trigger();
  const int kvh = blockIdx.x, r = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane & 7, grp = lane >> 3;
  const bf16* kbase = kv.base + std::size_t(layer) * kv.layer_stride();
  const bf16* vbase = kbase + kv.kv_stride();
  // Tokens per lane group per iteration (their K/V loads are in flight together): 64 positions per
  // block and iteration, the first iteration's loaded before the wait. (4, i.e. 128 positions before
  // the wait, took 149 -> 204 registers for head_dim 128 and two query heads per kv head and measured
  // slower: H200, 0.6B graph step 0.70 -> 0.73 ms.)
  constexpr int T = 2;
  auto kv_offset = [&](int blk, int t) {
    return ((std::size_t(blk) * kv.kv_heads + kvh) * kv.block_size + t % kv.block_size) * D + sub * DPL;
  };

  // Before waiting for the QKV projection: the step metadata (written before the step began) and,
  // in decode (write_kv: this kernel is the only writer of the layer's cache in the step, at
  // position pos), the first iteration's K/V of the earlier positions. In prefill the kernel before
  // this one writes the chunk's K/V, so everything is read after the wait.
  const bool pre = write_kv != 0;
  const int pos = meta.pos[r];
  const int row_slot = meta.slot[r];  // loaded with pos (the block table row depends on it)
  const int seq_len = pos + 1;
  // This block's positions [begin, end): chunk `split` of the context.
  int chunk = seq_len, chunks = 1;
  if (sp.splits > 1) {
    const int even = (seq_len + sp.splits - 1) / sp.splits;
    chunk = max(sp.min_chunk, (even + 63) / 64 * 64);
    chunks = (seq_len + chunk - 1) / chunk;
  }
  if (split >= chunks) {  // a short context needs fewer blocks than the grid has
    if (trace != nullptr && threadIdx.x == 0)  // diagnostics: no record for this block this step
      trace[(std::size_t(blockIdx.z) * gridDim.y * gridDim.x + blockIdx.y * gridDim.x + blockIdx.x) * (kGemvWarps + 4) + 1] = 0;
    return;
  }
  const int begin = split * chunk, end = min(seq_len, begin + chunk);
  const bool owns_pos = end == seq_len;  // the last chunk holds position pos
  const std::int32_t* table = meta.block_table + std::size_t(row_slot) * meta.table_width;
  const int blk_pos = table[pos / kv.block_size];
  uint4 kr[T][NV], vr[T][NV];
#pragma unroll
  for (int u = 0; u < T; ++u) {
    const int t = begin + warp * 4 + u * kAttnWarps * 4 + grp;
    if (pre && t < pos && t < end) {
      const std::size_t o = kv_offset(table[t / kv.block_size], t);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
        vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
      }
    }
  }
  // Diagnostics: when this thread's K/V prefetch was issued (its address chain: pos/slot, table).
  unsigned long long t_issue = 0;
  if (trace != nullptr) {
    asm volatile("" ::: "memory");
    t_issue = global_ns();
  }
  pdl_wait();
  const unsigned long long t_wait = trace != nullptr ? global_ns() : 0;

  const float* row = qkv + std::size_t(r) * (q_dim + 2 * kv_dim);
  const float scale = rsqrtf(static_cast<float>(D));

  for (int item = warp; item < G + (write_kv && owns_pos ? 1 : 0); item += kAttnWarps) {
    if (item < G) {
      float lo[E], hi[E];
      norm_rope_head<D>(row + (kvh * G + item) * D, q_norm, eps, rope + std::size_t(pos) * (D / 2), lane, lo, hi);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        q_s[item][lane * E + e] = lo[e] * scale;
        q_s[item][D / 2 + lane * E + e] = hi[e] * scale;
      }
    } else {
      write_kv_head<D>(row, q_dim, kv_dim, k_norm, eps, rope, pos, blk_pos, kv, layer, kvh, lane, k_new, v_new);
    }
  }
  __syncthreads();
  const unsigned long long t_staged = trace != nullptr ? global_ns() : 0;

  float q[G][DPL];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DPL; ++j) q[h][j] = q_s[h][sub * DPL + j];
  SoftmaxState<G, DPL> sm;
  sm.init();

  for (int base = begin + warp * 4; base < end; base += kAttnWarps * 4 * T) {
    bool valid[T];
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base + u * kAttnWarps * 4 + grp;
      valid[u] = t < end;
      // The first iteration's earlier positions are in registers already; position pos (decode) was
      // written above, also to shared memory (visible after the barrier): no round trip to L2.
      if (valid[u] && pre && t == pos) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(k_new + sub * DPL + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(v_new + sub * DPL + i * 8);
        }
      } else if (valid[u] && (base != begin + warp * 4 || !pre)) {
        const std::size_t o = kv_offset(table[t / kv.block_size], t);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < T; ++u) sm.add(q, kr[u], vr[u], valid[u]);
  }
  const unsigned long long t_loop = trace != nullptr ? global_ns() : 0;
  // Combine the 4 lane groups of the warp.
  sm.combine_groups();
  store_warp_state<G, DPL>(sm.m, sm.l, sm.acc, warp, grp, sub, &red_m[0][0], &red_l[0][0], &red_acc[0][0][0], D);
  __syncthreads();
  const unsigned long long t_comb = trace != nullptr ? global_ns() : 0;
  // Split-KV: this chunk's state (max, sum, unnormalised output per query head) goes to
  // sp.partial[row][kv head][split] = {m[G], l[G], acc[G][D]}.
  constexpr int P = G * (D + 2);
  float* part = chunks > 1 ? sp.partial + (std::size_t(r) * kv.kv_heads + kvh) * sp.splits * P : nullptr;
  for (int idx = tid; idx < G * D; idx += kAttnWarps * 32) {
    const int h = idx / D, d = idx % D;
    const auto [mx, L, A] = merge_warp_states<kAttnWarps>(&red_m[0][0], &red_l[0][0], &red_acc[0][0][0], G, D, h, d);
    if (part == nullptr) {
      out[std::size_t(r) * q_dim + (kvh * G + h) * D + d] = __float2bfloat16(A / L);
    } else {
      float* mine = part + std::size_t(split) * P;
      mine[2 * G + idx] = A;
      if (d == 0) mine[h] = mx, mine[G + h] = L;
    }
  }
  if (trace != nullptr && tid == 0) {  // diagnostics (QWEN_RING_TRACE): entry, wait, q/k/v written, output
    unsigned long long* rec =
        trace + (std::size_t(blockIdx.z) * gridDim.y * gridDim.x + blockIdx.y * gridDim.x + blockIdx.x) * (kGemvWarps + 4);
    rec[0] = t_start, rec[1] = t_wait, rec[2] = t_staged;
    // Attention's records: [3] after the cross-warp combine's barrier, [4..9] the end, [10] when
    // the K/V prefetch was issued, and in the "last data" column's place the end of warp 0's
    // position loop.
    const unsigned long long t_end = global_ns();
    rec[3] = t_comb;
    for (int w = 1; w < kGemvWarps - 1; ++w) rec[3 + w] = t_end;
    rec[2 + kGemvWarps] = t_issue;
    rec[3 + kGemvWarps] = t_loop;
  }
  if (part == nullptr) return;
  // The last chunk to arrive combines them all (release: fence, then count; acquire: count, fence).
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    unsigned* arrived = sp.arrived + std::size_t(r) * kv.kv_heads + kvh;
    last = atomicAdd(arrived, 1u) == unsigned(chunks - 1);
    if (last) *arrived = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int idx = tid; idx < G * D; idx += kAttnWarps * 32) {
    const int h = idx / D;
    float mx = -INFINITY;
    for (int c = 0; c < chunks; ++c) mx = fmaxf(mx, __ldcg(part + std::size_t(c) * P + h));
    float L = 0.f, A = 0.f;
    for (int c = 0; c < chunks; ++c) {
      const float* other = part + std::size_t(c) * P;
      const float f = __expf(__ldcg(other + h) - mx);
      L += __ldcg(other + G + h) * f;
      A += __ldcg(other + 2 * G + idx) * f;
    }
    out[std::size_t(r) * q_dim + (kvh * G + h) * D + idx % D] = __float2bfloat16(A / L);
  }
}

// ------------------------------------------------------------------------------------------------
// Launch helpers
// ------------------------------------------------------------------------------------------------

bool g_pdl = true;
int g_gemv_loads = 4;  // U of the legacy GEMV: 16-byte loads in flight per row and lane (4 or 8)
bool g_gemv_rowpipe = true;  // software-pipelined per-row GEMV (gemv_rowpipe_kernel), else gemv_kernel
bool g_gemv_ring = false;    // per-warp shared-memory ring GEMV (gemv_ring_kernel) where it fits

/// Ring GEMV timing trace (QWEN_RING_TRACE=1, diagnostics): per launch of a step, per block, the
/// global timer at entry, after griddepcontrol.wait, after the x staging and at each warp's end.
struct RingTrace {
  static constexpr int kLaunches = 1024, kBlocks = 256, kPerBlock = kGemvWarps + 4;
  unsigned long long* dev = nullptr;
  int next = 0;
  struct Launch { int N, K, mode, grid; };
  std::vector<Launch> launches;
  static bool enabled() {
    static const bool on = [] {
      const char* v = std::getenv("QWEN_RING_TRACE");
      return v != nullptr && *v != '\0' && *v != '0';
    }();
    return on;
  }
  unsigned long long* slot(int N, int K, gemv_out mode, int grid) {
    if (!enabled() || grid > kBlocks || next >= kLaunches) return nullptr;
    if (dev == nullptr) {
      const std::size_t bytes = std::size_t(kLaunches) * kBlocks * kPerBlock * sizeof(unsigned long long);
      REPLAY_CHECK(cudaMalloc(&dev, bytes));
      REPLAY_CHECK(cudaMemset(dev, 0, bytes));
    }
    launches.push_back({N, K, static_cast<int>(mode), grid});
    return dev + std::size_t(next++) * kBlocks * kPerBlock;
  }
};
RingTrace g_ring_trace;

/// Launches `kernel` with the programmatic-stream-serialization attribute (PDL) when enabled: in a
/// stream or a captured graph the kernel may start while its predecessor finishes; the kernels'
/// pdl_wait() keeps every data dependency.
template <class... KArgs, class... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t s, const char* name,
            Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = g_pdl ? 1 : 0;
  REPLAY_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "launching {}", name);
}

int fill_grid(std::size_t n) {
  const std::size_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

template <int B, gemv_out MODE, bool NORM>
void gemv_instance(const bf16* W, int N, int K, GemvIn in, float* y_f32, bf16* y_bf16, int ldy,
                   unsigned long long* keys, int num_sms, cudaStream_t s) {
  // rowpipe: both register sets loaded before the wait (PRE = 2) for 1-2 batch rows, rows of three
  // chunks or more and a matrix of 16 MiB or more: where it measured faster (H200, graph step: 4B
  // 2.77 -> 2.64 ms). For the 0.6B shape's down projection (6 MiB) and at 4 batch rows it measured
  // slower. QWEN_GEMV_PRE=1 or 2 forces one or the other (diagnostics).
  static const int pre_env = [] {
    const char* v = std::getenv("QWEN_GEMV_PRE");
    return v != nullptr ? std::atoi(v) : 0;
  }();
  const bool pre2 = pre_env == 2 || (pre_env != 1 && B <= 2 && (K + 256 * g_gemv_loads - 1) / (256 * g_gemv_loads) >= 3 &&
                                     std::size_t(N) * (MODE == gemv_out::silu_mul ? 2 : 1) * K * sizeof(bf16) >= (16u << 20));
  if (g_gemv_ring) {
    // Ring GEMV: one block per SM (at most one per row), slots per warp from the shared-memory
    // budget left after x; a shape whose x leaves room for fewer than 2 slots, or unaligned
    // weights, takes the pipelined GEMV below.
    constexpr int R = MODE == gemv_out::silu_mul ? 2 : 1;
    const std::size_t xbytes = std::size_t(B) * K * sizeof(bf16);
    const std::size_t slot_bytes = std::size_t(kGemvWarps) * R * kRingPiece * sizeof(bf16);
    const int slots = xbytes >= kRingSmemBudget ? 0 : static_cast<int>((kRingSmemBudget - xbytes) / slot_bytes);
    // By default only where every warp's share fits its ring (all of it loaded before the wait: the
    // 0.6B shape's layer matrices); streaming through the ring measured slower than the pipelined
    // GEMV (H200, 4B graph step 2.63 -> 3.76 ms). QWEN_RING=all uses it for every matrix.
    static const bool ring_all = [] {
      const char* v = std::getenv("QWEN_RING");
      return v != nullptr && std::string_view(v) == "all";
    }();
    const int ns = slots < kRingMaxSlots ? slots : kRingMaxSlots;
    const int grid = N < num_sms ? N : num_sms;
    const int rows_per_block = (N + grid - 1) / grid;
    const int items_per_warp = (rows_per_block + kGemvWarps - 1) / kGemvWarps * ((K + kRingPiece - 1) / kRingPiece);
    // The rings take the whole budget even where a warp's share needs fewer slots: sized to the
    // share, the blocks let more later kernels' blocks onto the SMs, whose prefetches then compete
    // with the critical path (H200, 0.6B graph step 0.70 -> 0.79 ms).
    if (slots >= 2 && reinterpret_cast<std::uintptr_t>(W) % 16 == 0 && (ring_all || items_per_warp <= ns)) {
      launch(gemv_ring_kernel<B, MODE, NORM>, grid, kGemvThreads, xbytes + ns * slot_bytes, s,
             "qwen::gemv_ring_kernel", W, N, K, in, y_f32, y_bf16, ldy, keys, ns, g_ring_trace.slot(N, K, MODE, grid));
      return;
    }
  }
  auto kernel = g_gemv_rowpipe
                    ? (g_gemv_loads == 8 ? (pre2 ? gemv_rowpipe_kernel<B, MODE, NORM, 8, 2> : gemv_rowpipe_kernel<B, MODE, NORM, 8, 1>)
                                         : (pre2 ? gemv_rowpipe_kernel<B, MODE, NORM, 4, 2> : gemv_rowpipe_kernel<B, MODE, NORM, 4, 1>))
                    : (g_gemv_loads == 8 ? gemv_kernel<B, MODE, NORM, 8> : gemv_kernel<B, MODE, NORM, 4>);
  const std::size_t smem = std::size_t(B) * K * sizeof(bf16);
  // Occupancy per (kernel, shared-memory size), computed once: the grid is capped at what fits at
  // once, so x is staged once per resident block.
  static std::map<std::pair<std::size_t, int>, int> resident;
  const auto key = std::make_pair(smem, g_gemv_loads * 4 + (g_gemv_rowpipe ? 1 : 0) + (pre2 ? 2 : 0));
  auto it = resident.find(key);
  if (it == resident.end()) {
    int per_sm = 0;
    REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvThreads, smem));
    it = resident.emplace(key, per_sm < 1 ? 1 : per_sm).first;
  }
  const int rows_per_block = kGemvWarps;
  int grid = (N + rows_per_block - 1) / rows_per_block;
  const int cap = it->second * num_sms;
  if (grid > cap) grid = cap;
  launch(kernel, grid, kGemvThreads, smem, s, "qwen::gemv_kernel", W, N, K, in, y_f32, y_bf16, ldy, keys);
}

template <int B>
void gemv_rows(const bf16* W, int N, int K, GemvIn in, gemv_out mode, float* y_f32, bf16* y_bf16, int ldy,
               unsigned long long* keys, int num_sms, cudaStream_t s) {
  const bool norm = in.norm_w != nullptr;
  if (norm && mode == gemv_out::store_f32)
    gemv_instance<B, gemv_out::store_f32, true>(W, N, K, in, y_f32, y_bf16, ldy, keys, num_sms, s);
  else if (norm && mode == gemv_out::silu_mul)
    gemv_instance<B, gemv_out::silu_mul, true>(W, N, K, in, y_f32, y_bf16, ldy, keys, num_sms, s);
  else if (norm && mode == gemv_out::argmax)
    gemv_instance<B, gemv_out::argmax, true>(W, N, K, in, y_f32, y_bf16, ldy, keys, num_sms, s);
  else if (!norm && mode == gemv_out::add_f32)
    gemv_instance<B, gemv_out::add_f32, false>(W, N, K, in, y_f32, y_bf16, ldy, keys, num_sms, s);
  else
    throw replay::usage_error("qwen::launch_gemv: unsupported (input, output) combination");
}

/// Every kernel of the decode step asks for the same L1 / shared-memory split (the most shared
/// memory): an SM only runs blocks of kernels with one configuration at a time, so kernels wanting
/// different splits could not overlap under programmatic dependent launch.
/// QWEN_CARVEOUT=default leaves the driver's choice (diagnostics).
template <class F>
void set_carveout(F kernel) {
  static const bool skip = [] {
    const char* v = std::getenv("QWEN_CARVEOUT");
    return v != nullptr && std::string_view(v) == "default";
  }();
  if (skip) return;
  REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    static_cast<int>(cudaSharedmemCarveoutMaxShared)));
}

template <class F>
void set_max_smem(F kernel) {
  REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  set_carveout(kernel);
}

template <int B, int U>
void init_gemv_attrs_u() {
  set_max_smem(gemv_kernel<B, gemv_out::store_f32, true, U>);
  set_max_smem(gemv_kernel<B, gemv_out::silu_mul, true, U>);
  set_max_smem(gemv_kernel<B, gemv_out::argmax, true, U>);
  set_max_smem(gemv_kernel<B, gemv_out::add_f32, false, U>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::store_f32, true, U, 1>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::silu_mul, true, U, 1>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::argmax, true, U, 1>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::add_f32, false, U, 1>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::store_f32, true, U, 2>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::silu_mul, true, U, 2>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::argmax, true, U, 2>);
  set_max_smem(gemv_rowpipe_kernel<B, gemv_out::add_f32, false, U, 2>);
}
template <int B>
void init_gemv_attrs() {
  set_max_smem(gemv_ring_kernel<B, gemv_out::store_f32, true>);
  set_max_smem(gemv_ring_kernel<B, gemv_out::silu_mul, true>);
  set_max_smem(gemv_ring_kernel<B, gemv_out::argmax, true>);
  set_max_smem(gemv_ring_kernel<B, gemv_out::add_f32, false>);
  init_gemv_attrs_u<B, 4>();
  init_gemv_attrs_u<B, 8>();
}

/// Calls f(attention_kernel<head_dim, G>): the one place that maps the runtime shape to an instance.
/// Attention for 1-2 query heads per kv head compiled for two blocks per SM (at most 128 registers
/// per thread instead of 154 for head_dim 128, no spills), so that it leaves room for the next
/// GEMVs' blocks: H200, 0.6B graph step 0.709-0.716 -> 0.697-0.700 ms (QWEN_ATTN_REGS=free: no cap,
/// for comparison). With more query heads per kv head a cap would spill (254 registers at 4).
bool attention_reg_cap() {
  static const bool cap = [] {
    const char* v = std::getenv("QWEN_ATTN_REGS");
    return v == nullptr || std::string_view(v) != "free";
  }();
  return cap;
}
template <int D, class F>
auto with_attention_kernel_d(int G, F&& f) {
  const bool cap = attention_reg_cap();
  switch (G) {
    case 1: return cap ? f(attention_kernel<D, 1, 2>) : f(attention_kernel<D, 1, 1>);
    case 2: return cap ? f(attention_kernel<D, 2, 2>) : f(attention_kernel<D, 2, 1>);
    case 4: return f(attention_kernel<D, 4, 1>);
    case 8: return f(attention_kernel<D, 8, 1>);
    default: throw replay::usage_error("qwen attention: query heads per kv head must be 1, 2, 4 or 8");
  }
}
template <class F>
auto with_attention_kernel(int head_dim, int G, F&& f) {
  if (head_dim == 128) return with_attention_kernel_d<128>(G, f);
  if (head_dim == 64) return with_attention_kernel_d<64>(G, f);
  throw replay::usage_error("qwen attention: head_dim must be 64 or 128");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------

void set_pdl(bool on) { g_pdl = on; }
bool pdl_enabled() { return g_pdl; }
void set_gemv_loads(int u) {
  if (u != 4 && u != 8) throw replay::usage_error("qwen::set_gemv_loads: 4 or 8 loads in flight");
  g_gemv_loads = u;
}
int gemv_loads() { return g_gemv_loads; }
void set_gemv_rowpipe(bool on) { g_gemv_rowpipe = on; }
bool gemv_rowpipe() { return g_gemv_rowpipe; }
void set_gemv_ring(bool on) { g_gemv_ring = on; }

void ring_trace_begin_step() {
  g_ring_trace.next = 0;
  g_ring_trace.launches.clear();
}

std::string ring_trace_summary(replay::stream_ref s) {
  auto& tr = g_ring_trace;
  if (!RingTrace::enabled() || tr.dev == nullptr || tr.launches.empty()) return {};
  REPLAY_CHECK(cudaStreamSynchronize(s.get()));
  const int L = static_cast<int>(tr.launches.size());
  std::vector<unsigned long long> h(std::size_t(L) * RingTrace::kBlocks * RingTrace::kPerBlock);
  REPLAY_CHECK(cudaMemcpy(h.data(), tr.dev, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
  struct Agg { double n = 0, lead = 0, gap = 0, spread = 0, stage = 0, compute = 0, warp_spread = 0, total = 0, data = 0; };
  std::map<std::tuple<int, int, int>, Agg> agg;
  double prev_end = 0;
  const double t0 = [&] {
    unsigned long long m = ~0ull;
    for (int b = 0; b < tr.launches[0].grid; ++b)
      if (h[std::size_t(b) * RingTrace::kPerBlock + 1] != 0) m = std::min(m, h[std::size_t(b) * RingTrace::kPerBlock + 1]);
    return double(m);
  }();
  for (int i = 0; i < L; ++i) {
    const auto& ln = tr.launches[i];
    const unsigned long long* r = h.data() + std::size_t(i) * RingTrace::kBlocks * RingTrace::kPerBlock;
    double s_max = 0, w_min = 1e300, w_max = 0, x_max = 0, e_max = 0, ws = 0, d_max = 0;
    for (int b = 0; b < ln.grid; ++b) {
      const unsigned long long* q = r + std::size_t(b) * RingTrace::kPerBlock;
      if (q[1] == 0) continue;  // an attention block with no positions (exited before the wait)
      s_max = std::max(s_max, double(q[0]) - t0);
      w_min = std::min(w_min, double(q[1]) - t0);
      w_max = std::max(w_max, double(q[1]) - t0);
      x_max = std::max(x_max, double(q[2]) - t0);
      if (q[3 + kGemvWarps] != 0) d_max = std::max(d_max, double(q[3 + kGemvWarps]) - double(q[2]));
      double bmin = 1e300, bmax = 0;
      for (int w = 0; w < (ln.N < 0 ? kGemvWarps - 1 : kGemvWarps); ++w) {  // attention: [10] is t_issue
        const double e = double(q[3 + w]) - t0;
        bmin = std::min(bmin, e), bmax = std::max(bmax, e);
      }
      e_max = std::max(e_max, bmax);
      ws = std::max(ws, bmax - bmin);
    }
    auto& a = agg[{ln.N, ln.K, ln.mode}];
    a.n += 1;
    a.lead += w_min - s_max;
    a.gap += i > 0 ? w_min - prev_end : 0;
    a.spread += w_max - w_min;
    a.stage += x_max - w_max;
    a.compute += e_max - x_max;
    a.warp_spread += ws;
    a.data += d_max;
    a.total += i > 0 ? e_max - prev_end : e_max;
    prev_end = e_max;
  }
  double chain = 0, chain_n = 0;
  for (int i = 0; i < L; ++i) {
    if (tr.launches[i].N >= 0) continue;
    const unsigned long long* r = h.data() + std::size_t(i) * RingTrace::kBlocks * RingTrace::kPerBlock;
    double m = 0;
    for (int b = 0; b < tr.launches[i].grid; ++b) {
      const unsigned long long* q = r + std::size_t(b) * RingTrace::kPerBlock;
      if (q[1] != 0) m = std::max(m, double(q[2 + kGemvWarps]) - double(q[0]));
    }
    chain += m, chain_n += 1;
  }
  std::string out = chain_n > 0 ? fmt::format("attention: entry -> K/V prefetch issued {:.0f} ns (max over blocks, mean over launches); "
                                              "its columns: x staged = q/K/V written, last data = position loop, "
                                              "end spread = output\n", chain / chain_n)
                                : std::string();
  out += fmt::format(
      "ring trace, last step ({} ring launches, {:.1f} us from the first wait to the last end; ns, mean per launch):\n"
      "| N | K | mode | launches | all resident before wait | prev end -> first wait | wait spread | x staged | "
      "staged -> last warp end | warp end spread (max per block) | warp 0 staged -> its last data (max) | per launch |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      L, prev_end / 1e3);
  for (const auto& [k, a] : agg)
    out += fmt::format("| {} | {} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |\n",
                       std::get<0>(k) < 0 ? std::string("attention") : std::to_string(std::get<0>(k)), std::get<1>(k),
                       std::get<2>(k), a.n, a.lead / a.n, a.gap / a.n, a.spread / a.n, a.stage / a.n, a.compute / a.n,
                       a.warp_spread / a.n, a.data / a.n, a.total / a.n);
  return out;
}

void init_kernel_attributes() {
  set_carveout(embed_kernel);
  for (int d : {64, 128})
    for (int g : {1, 2, 4, 8}) with_attention_kernel(d, g, [](auto kernel) { set_carveout(kernel); });
  init_gemv_attrs<1>();
  init_gemv_attrs<2>();
  init_gemv_attrs<3>();
  init_gemv_attrs<4>();
}

void launch_fill_random(bf16* p, std::size_t n, std::uint64_t seed, float scale, replay::stream_ref s) {
  fill_random_kernel<<<fill_grid(n), 256, 0, s.get()>>>(p, n, seed, scale);
  REPLAY_CHECK_LAUNCH("qwen::fill_random_kernel");
}

void launch_fill_const(bf16* p, std::size_t n, float value, replay::stream_ref s) {
  fill_const_kernel<<<fill_grid(n), 256, 0, s.get()>>>(p, n, value);
  REPLAY_CHECK_LAUNCH("qwen::fill_const_kernel");
}

void launch_rope_table(float2* rope, int max_pos, int head_dim, double theta, replay::stream_ref s) {
  const int half = head_dim / 2;
  rope_table_kernel<<<fill_grid(std::size_t(max_pos) * half), 256, 0, s.get()>>>(rope, max_pos, half, head_dim,
                                                                                  static_cast<float>(theta));
  REPLAY_CHECK_LAUNCH("qwen::rope_table_kernel");
}

void launch_embed(const bf16* embed, int vocab, int hidden, RowMeta meta, int rows, float* residual,
                  unsigned long long* keys, replay::stream_ref s) {
  if (hidden % 8 != 0) throw replay::usage_error("qwen::launch_embed: hidden must be a multiple of 8");
  launch(embed_kernel, rows, 128, 0, s.get(), "qwen::embed_kernel", embed, vocab, hidden, meta, residual, keys);
}

void launch_gemv(const bf16* W, int N, int K, int rows, GemvIn in, gemv_out mode, float* y_f32, bf16* y_bf16,
                 int ldy, unsigned long long* keys, int num_sms, replay::stream_ref s) {
  if (K % 8 != 0) throw replay::usage_error("qwen::launch_gemv: K must be a multiple of 8");
  if (std::size_t(rows) * K * sizeof(bf16) > 200 * 1024)
    throw replay::usage_error("qwen::launch_gemv: rows * K too large for the shared-memory stage");
  switch (rows) {
    case 1: gemv_rows<1>(W, N, K, in, mode, y_f32, y_bf16, ldy, keys, num_sms, s.get()); break;
    case 2: gemv_rows<2>(W, N, K, in, mode, y_f32, y_bf16, ldy, keys, num_sms, s.get()); break;
    case 3: gemv_rows<3>(W, N, K, in, mode, y_f32, y_bf16, ldy, keys, num_sms, s.get()); break;
    case 4: gemv_rows<4>(W, N, K, in, mode, y_f32, y_bf16, ldy, keys, num_sms, s.get()); break;
    default: throw replay::usage_error("qwen::launch_gemv: rows must be 1..4");
  }
}

void launch_read_probe(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s) {
  read_probe_kernel<<<num_sms * 8, 256, 0, s.get()>>>(static_cast<const uint4*>(p), bytes / 16, sink);
  REPLAY_CHECK_LAUNCH("qwen::read_probe_kernel");
}

void launch_read_link(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s) {
  if (bytes % 16 != 0) throw replay::usage_error("qwen::launch_read_link: bytes must be a multiple of 16");
  launch(read_link_kernel, bytes == 0 ? 1 : num_sms * 8, 256, 0, s.get(), "qwen::read_link_kernel",
         static_cast<const uint4*>(p), bytes / 16, sink);
}

void launch_rmsnorm(const float* residual, const bf16* w, int hidden, float eps, int rows, bf16* out,
                    replay::stream_ref s) {
  launch(rmsnorm_kernel, rows, 256, 0, s.get(), "qwen::rmsnorm_kernel", residual, w, hidden, eps, out);
}

void launch_silu_mul(const float* gu, int N, int rows, bf16* act, replay::stream_ref s) {
  launch(silu_mul_kernel, fill_grid(std::size_t(rows) * N), 256, 0, s.get(), "qwen::silu_mul_kernel", gu, N, rows, act);
}

void launch_argmax(const float* logits, int V, int rows, unsigned long long* keys, replay::stream_ref s) {
  launch(argmax_kernel, rows, 1024, 0, s.get(), "qwen::argmax_kernel", logits, V, keys);
}

void launch_kv_write(const float* qkv, int q_heads, const bf16* k_norm, float eps, const float2* rope, RowMeta meta,
                     int rows, KvPool kv, int layer, replay::stream_ref s) {
  const int q_dim = q_heads * kv.head_dim, kv_dim = kv.kv_heads * kv.head_dim;
  const dim3 grid(rows, kv.kv_heads);
  if (kv.head_dim == 128)
    launch(kv_write_kernel<128>, grid, 32, 0, s.get(), "qwen::kv_write_kernel", qkv, q_dim, kv_dim, k_norm, eps, rope, meta, kv, layer);
  else if (kv.head_dim == 64)
    launch(kv_write_kernel<64>, grid, 32, 0, s.get(), "qwen::kv_write_kernel", qkv, q_dim, kv_dim, k_norm, eps, rope, meta, kv, layer);
  else
    throw replay::usage_error("qwen::launch_kv_write: head_dim must be 64 or 128");
}


int attention_splits(int rows, int q_heads, int kv_heads, int head_dim, int num_sms) {
  static const int cap = [] {
    const char* v = std::getenv("QWEN_ATTN_SPLITS");  // diagnostics: 1 turns split-KV off
    const int n = v != nullptr ? std::atoi(v) : kMaxAttnSplits;
    return n < 1 ? 1 : n > kMaxAttnSplits ? kMaxAttnSplits : n;
  }();
  // Resident blocks per SM of the kernel instance, computed once per instance.
  static std::map<const void*, int> resident;
  const int per_sm = with_attention_kernel(head_dim, q_heads / kv_heads, [](auto kernel) {
    auto it = resident.find(reinterpret_cast<const void*>(kernel));
    if (it == resident.end()) {
      int b = 0;
      REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kAttnWarps * 32, 0));
      it = resident.emplace(reinterpret_cast<const void*>(kernel), b < 1 ? 1 : b).first;
    }
    return it->second;
  });
  // Only a grid that leaves SMs idle is split (a bigger one is already spread over the GPU, and its
  // extra blocks would cost launch slots at every length); then into as many blocks as fit on the
  // GPU at once (one wave) when every row's context is long.
  if (rows * kv_heads >= num_sms) return 1;
  const int want = per_sm * num_sms / (rows * kv_heads);
  return want < 1 ? 1 : want > cap ? cap : want;
}

int attention_min_chunk() {
  static const int chunk = [] {
    const char* v = std::getenv("QWEN_ATTN_MIN_CHUNK");  // diagnostics
    const int n = v != nullptr ? std::atoi(v) : kAttnMinChunk;
    return n < 64 ? 64 : (n + 63) / 64 * 64;
  }();
  return chunk;
}

void launch_attention(const float* qkv, int q_heads, const bf16* q_norm, const bf16* k_norm, float eps,
                      const float2* rope, RowMeta meta, int rows, KvPool kv, int layer, bool write_kv, AttnSplit sp,
                      bf16* out, replay::stream_ref s) {
  if (sp.splits < 1 || sp.splits > kMaxAttnSplits || (sp.splits > 1 && (sp.partial == nullptr || sp.arrived == nullptr)))
    throw replay::usage_error("qwen::launch_attention: split-KV needs 1..kMaxAttnSplits splits and its scratch");
  if (sp.min_chunk < 64 || sp.min_chunk % 64 != 0)
    throw replay::usage_error("qwen::launch_attention: min_chunk must be a positive multiple of 64");
  const int D = kv.head_dim, q_dim = q_heads * D, kv_dim = kv.kv_heads * D;
  const dim3 grid(kv.kv_heads, rows, sp.splits);
  const int wk = write_kv ? 1 : 0;
  with_attention_kernel(D, q_heads / kv.kv_heads, [&](auto kernel) {
    launch(kernel, grid, kAttnWarps * 32, 0, s.get(), "qwen::attention_kernel", qkv, q_dim, kv_dim, q_norm, k_norm,
           eps, rope, meta, kv, layer, wk, sp, out,
           write_kv ? g_ring_trace.slot(-1, D, gemv_out::store_f32, static_cast<int>(grid.x * grid.y * grid.z)) : nullptr);
  });
}

}  // namespace qwen
