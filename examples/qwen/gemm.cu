// examples/qwen/gemm.cu: the tensor-core GEMM of buckets above kGemvMaxRows rows and of prefill.
//
// y = W·x for up to 64 batch rows per block on mma.sync m16n8k16 (bf16 in, fp32 accumulate), with
// the fused GEMV's epilogues (store, residual add, SiLU(gate)·up, logits + argmax), so every bucket
// runs one kernel per matrix and reads each weight once per step.
//
// The operands come straight from global memory into mma fragments, with no shared-memory staging:
// a lane loads 16 contiguous bytes of a weight row and 16 contiguous bytes of an x row at the same
// k, and the two MMAs of a 32-wide k step use the first and the second half of them. The order of
// the k values inside a step is thereby permuted, but identically for W and x, so the dot product
// is unchanged. A block owns 32 weight rows (for silu_mul: 16 gate rows and the 16 matching up rows)
// and all batch rows; its 8 warps take every 8th k step of the block's k range and are summed in
// shared memory in a fixed order. Where the tiles alone would leave SMs idle, the k range is split
// over `splits` blocks (grid y): each writes its partial tile to scratch and the last to arrive sums
// the partials in split order and runs the epilogue, so the result does not depend on timing.
#include "kernels.cuh"
#include "device.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <algorithm>
#include <cstdint>

namespace qwen {
namespace {

using namespace dev;

constexpr int kGemmWarps = 8;
constexpr int kGemmThreads = kGemmWarps * 32;
constexpr int kGemmTileRows = 32;  // weight rows per block: two 16-row MMA tiles
constexpr int kGemmCols = 64;      // batch rows per block: up to 8 MMA n-tiles of 8
#ifndef QWEN_GEMM_MAX_SPLITS_EXPERIMENT
constexpr int kGemmMaxSplits = 16;
#else
constexpr int kGemmMaxSplits = QWEN_GEMM_MAX_SPLITS_EXPERIMENT;
#endif

/// c += a·b for one m16n8k16 tile (row-major A 16x16, column-major B 16x8, fp32 C).
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/// NT: n-tiles of 8 batch rows (1, 2, 4 or 8). Dynamic shared memory: kGemmWarps * NT * 1 KiB.
template <int NT, gemv_out MODE>
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(const bf16* __restrict__ W, int N, int K,
                                                            const bf16* __restrict__ x, int rows, float* y_f32,
                                                            bf16* y_bf16, int ldy, unsigned long long* keys,
                                                            float* partial, unsigned* arrived) {
  constexpr bool kSilu = MODE == gemv_out::silu_mul;
  constexpr int kOut = kSilu ? 16 : kGemmTileRows;  // output rows per block
  constexpr int U = NT >= 8 ? 1 : 2;                // k steps per warp per stage
  constexpr int kElems = 2 * NT * 4;                // accumulators per lane
  extern __shared__ float red[];                    // [kGemmWarps][kElems][32]
  __shared__ float out[kGemmTileRows][kGemmCols];
  __shared__ bool last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y, col0 = blockIdx.z * kGemmCols;
  const int n0 = tile * kOut;

  // This lane's weight rows: MMA tile m, row g (h = 0) and g + 8 (h = 1); null past N.
  const bf16* wrow[2][2];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m * 16 + h * 8 + g;
      const int n = n0 + (kSilu ? (i & 15) : i);
      wrow[m][h] = n < N ? W + (std::size_t(kSilu && m == 1 ? N + n : n)) * K : nullptr;
    }
  // The block's k steps [s0, s1); this warp's are s0 + warp, s0 + warp + 8, ...
  const int steps = (K + 31) / 32;
  const int s0 = static_cast<int>(static_cast<long long>(split) * steps / splits);
  const int s1 = static_cast<int>(static_cast<long long>(split + 1) * steps / splits);
  // Blocks of different tiles walk the k range from different starting points, so that they do not
  // all read the same x lines from L2 at once; phys() maps a step of the walk to the k step it reads.
  const int range = s1 - s0 > 0 ? s1 - s0 : 1;
  const int rot = static_cast<int>((static_cast<long long>(tile) * 8 * kGemmWarps) % range);
  auto phys = [&](int s) {
    const int p = s - s0 + rot;
    return s0 + (p >= range ? p - range : p);
  };

  struct Stage {
    uint4 w[U][2][2];
    uint4 b[U][NT];
  };
  auto load_w = [&](Stage& st, int ks) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = ks + u * kGemmWarps, k = phys(s) * 32 + t * 8;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          st.w[u][m][h] = s < s1 && k < K && wrow[m][h] != nullptr ? ld_stream(wrow[m][h] + k) : make_uint4(0, 0, 0, 0);
    }
  };
  auto load_x = [&](Stage& st, int ks) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = ks + u * kGemmWarps, k = phys(s) * 32 + t * 8;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = col0 + j * 8 + g;
        st.b[u][j] = s < s1 && k < K && col < rows ? *reinterpret_cast<const uint4*>(x + std::size_t(col) * K + k)
                                                   : make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[2][NT][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][j][c] = 0.f;
  auto compute = [&](const Stage& st) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 &a0 = st.w[u][m][0], &a1 = st.w[u][m][1], &b = st.b[u][j];
          mma_bf16(acc[m][j], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
          mma_bf16(acc[m][j], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
        }
  };

  // Two stages in flight: the next stage's loads are issued before the current one is multiplied.
  // Two per trip, so that the stages never swap (a register copy would wait for the loads).
  constexpr int kStride = U * kGemmWarps;
  replay::pdl::launch_dependents();
  Stage sa, sb;
  int ks = s0 + warp;
  load_w(sa, ks);  // weights do not depend on earlier kernels
  replay::pdl::wait();
  load_x(sa, ks);
  while (ks < s1) {
    load_w(sb, ks + kStride);
    load_x(sb, ks + kStride);
    compute(sa);
    ks += kStride;
    if (ks >= s1) break;
    load_w(sa, ks + kStride);
    load_x(sa, ks + kStride);
    compute(sb);
    ks += kStride;
  }

  // Sum the 8 warps (fixed order) into out[row][col]: C fragment c of tile (m, j) is row
  // m*16 + g (+8 for c >= 2), column j*8 + 2t (+1 for odd c).
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[(warp * kElems + (m * NT + j) * 4 + c) * 32 + lane] = acc[m][j][c];
  __syncthreads();
  for (int idx = tid; idx < kElems * 32; idx += kGemmThreads) {
    const int e = idx / 32, ln = idx % 32;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kGemmWarps; ++w) v += red[w * kElems * 32 + idx];
    const int m = e / (NT * 4), j = (e / 4) % NT, c = e % 4;
    out[m * 16 + (ln >> 2) + (c >= 2 ? 8 : 0)][j * 8 + 2 * (ln & 3) + (c & 1)] = v;
  }
  constexpr int kCols = NT * 8;
  if (splits > 1) {  // split-K: the last block of this tile sums the partials in split order
    float* mine = partial + ((std::size_t(blockIdx.z) * gridDim.x + tile) * splits + split) * kGemmTileRows * kCols;
    __syncthreads();
    for (int idx = tid; idx < kGemmTileRows * kCols; idx += kGemmThreads) mine[idx] = out[idx / kCols][idx % kCols];
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      unsigned* counter = arrived + std::size_t(blockIdx.z) * gridDim.x + tile;
      last = atomicAdd(counter, 1u) == unsigned(splits - 1);
      if (last) *counter = 0u;  // ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* first = mine - std::size_t(split) * kGemmTileRows * kCols;
    for (int idx = tid; idx < kGemmTileRows * kCols; idx += kGemmThreads) {
      float v = 0.f;
      for (int s = 0; s < splits; ++s) v += __ldcg(first + std::size_t(s) * kGemmTileRows * kCols + idx);
      out[idx / kCols][idx % kCols] = v;
    }
  }
  __syncthreads();

  // Epilogue: thread (col, row0) handles column col, rows row0, row0 + 256 / kCols, ...
  const int col = tid % kCols, b = col0 + col;
  unsigned long long best = 0;
  for (int i = tid / kCols; b < rows && i < kOut && n0 + i < N; i += kGemmThreads / kCols) {
    const int n = n0 + i;
    const std::size_t o = std::size_t(b) * ldy + n;
    const float v = out[i][col];
    if constexpr (MODE == gemv_out::store_f32 || MODE == gemv_out::argmax) {
      y_f32[o] = v;
    } else if constexpr (MODE == gemv_out::add_f32) {
      y_f32[o] += v;  // the block is the only writer of this element
    } else {
      const float up = out[16 + i][col];
      y_bf16[o] = __float2bfloat16(v / (1.f + __expf(-v)) * up);
    }
    if constexpr (MODE == gemv_out::argmax) {
      const unsigned long long key = argmax_key(v, n);
      best = key > best ? key : best;
    }
  }
  if constexpr (MODE == gemv_out::argmax) {
    __shared__ unsigned long long block_best[kGemmCols];
    if (tid < kCols) block_best[tid] = 0;
    __syncthreads();
    if (best != 0) atomicMax(&block_best[col], best);
    __syncthreads();
    // Most blocks' best is below the running maximum by now: reading it first skips their atomics.
    if (tid < kCols && col0 + tid < rows) {
      const unsigned long long k = block_best[tid];
      if (k > *reinterpret_cast<volatile unsigned long long*>(keys + col0 + tid)) atomicMax(keys + col0 + tid, k);
    }
  }
}

/// Calls f(kernel) with the instance for (n-tiles, mode).
template <class F>
void with_gemm(int nt, gemv_out mode, F&& f) {
  auto by_mode = [&](auto ntc) {
    constexpr int NT = decltype(ntc)::value;
    switch (mode) {
      case gemv_out::store_f32: return f(gemm_kernel<NT, gemv_out::store_f32>);
      case gemv_out::add_f32: return f(gemm_kernel<NT, gemv_out::add_f32>);
      case gemv_out::silu_mul: return f(gemm_kernel<NT, gemv_out::silu_mul>);
      case gemv_out::argmax: return f(gemm_kernel<NT, gemv_out::argmax>);
    }
  };
  switch (nt) {
    case 1: return by_mode(std::integral_constant<int, 1>{});
    case 2: return by_mode(std::integral_constant<int, 2>{});
    case 4: return by_mode(std::integral_constant<int, 4>{});
    case 8: return by_mode(std::integral_constant<int, 8>{});
    default: throw replay::usage_error("qwen::gemm: n-tiles must be 1, 2, 4 or 8");
  }
}

/// n-tiles of 8 batch rows a block computes for `rows` rows: the next power of two, at most 8.
int gemm_ntiles(int rows) {
  int nt = 1;
  while (nt * 8 < rows && nt < 8) nt *= 2;
  return nt;
}

}  // namespace

GemmPlan plan_gemm(const Linear& op, int rows, int num_sms) {
  if (op.W == nullptr || op.N < 1 || op.K < 8 || op.K % 8 != 0 || rows < 1)
    throw replay::usage_error("qwen::gemm: needs W, N >= 1, K a positive multiple of 8 and rows >= 1");
  GemmPlan p;
  p.tiles = (op.N + (op.mode == gemv_out::silu_mul ? 16 : kGemmTileRows) - 1) /
            (op.mode == gemv_out::silu_mul ? 16 : kGemmTileRows);
  p.groups = (rows + kGemmCols - 1) / kGemmCols;
  // Split the k range where the tiles leave SMs idle: aim at two blocks per SM, each warp keeping at
  // least two k steps.
  const int steps = (op.K + 31) / 32;
  if (p.groups == 1 && p.tiles < 2 * num_sms) {
    const int want = (2 * num_sms + p.tiles - 1) / p.tiles;
    const int most = steps / (2 * kGemmWarps);
    p.splits = std::max(1, std::min({want, most, kGemmMaxSplits}));
  }
  return p;
}

std::size_t gemm_scratch_floats(int num_sms) {
  // splits > 1 only where tiles < 2 * num_sms, and then tiles * splits < 4 * num_sms.
  return std::size_t(4) * num_sms * kGemmTileRows * kGemmCols;
}
std::size_t gemm_counters(int num_sms) { return std::size_t(2) * num_sms; }

void launch_gemm(const Linear& op, const bf16* x, int rows, const GemmPlan& plan, GemmScratch scratch,
                 replay::stream_ref s) {
  if (plan.tiles < 1 || x == nullptr || reinterpret_cast<std::uintptr_t>(op.W) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(x) % 16 != 0)
    throw replay::usage_error("qwen::launch_gemm: needs a plan (plan_gemm) and 16-byte aligned W and x");
  if (plan.splits > 1 && (scratch.partial == nullptr || scratch.arrived == nullptr))
    throw replay::usage_error("qwen::launch_gemm: a split plan needs scratch");
  const int nt = plan.groups > 1 ? 8 : gemm_ntiles(rows);
  const replay::launch_config c{.grid = dim3(plan.tiles, plan.splits, plan.groups), .block = dim3(kGemmThreads),
                                .shared_bytes = std::size_t(kGemmWarps) * nt * 1024, .stream = s, .pdl = true};
  with_gemm(nt, op.mode, [&](auto k) {
    replay::launch(k, c, op.W, op.N, op.K, x, rows, op.y_f32, op.y_bf16, op.ldy, op.keys, scratch.partial,
                   scratch.arrived);
  });
}

void init_gemm_attributes() {
  for (int nt : {1, 2, 4, 8})
    for (gemv_out m : {gemv_out::store_f32, gemv_out::silu_mul, gemv_out::argmax, gemv_out::add_f32})
      with_gemm(nt, m, [&](auto kernel) {
        REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemmWarps * nt * 1024));
        REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)));
      });
}

}  // namespace qwen
