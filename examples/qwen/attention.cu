// examples/qwen/attention.cu: decode attention over the paged KV cache, and prefill's K/V write.
//
// One block per (kv head, row, split) serves the G query heads that share the kv head, so each
// sequence's K/V is read once per step. Per-head RMSNorm (q_norm / k_norm) and RoPE are fused into
// the prologue; in decode the block that owns the row's last position also writes the new K/V into
// the pool. Before pdl::wait() the kernel reads the step metadata and the K/V of its first load
// iteration into registers, and of a short context's second into shared memory (decode only: this
// kernel is the step's only writer of the layer's cache). Long contexts are split over several
// blocks (AttnPlan) and merged by the last block to finish.
#include "kernels.cuh"
#include "device.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <utility>

namespace qwen {
namespace {

using namespace dev;

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
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  const int r = blockIdx.x, h = blockIdx.y;
  const float* row = qkv + std::size_t(r) * (q_dim + 2 * kv_dim);
  const int pos = meta.rows[r].pos;
  const int blk = meta.block_table[std::size_t(meta.rows[r].slot) * meta.table_width + pos / kv.block_size];
  write_kv_head<D>(row, q_dim, kv_dim, k_norm, eps, rope, pos, blk, kv, layer, h, threadIdx.x & 31);
}

constexpr int kAttnWarps = 8;  // warps per block at most (AttnPlan::warps: 4 or 8)
constexpr int kStaged = kAttnWarps * 8;  // positions of a block's second load iteration (8 per warp)

/// Split-KV, the last block of a (row, kv head): merges the chunks' states at `part` into the G heads'
/// outputs at `out` (bf16). The states come into shared memory by cp.async, every copy of a group in
/// flight at once (one round trip to L2 per group, not one per chunk): the maxima and sums of all
/// chunks with the first group, the outputs in groups of as many chunks as `acc_s` (`acc_bytes`, free
/// by now) holds. Each output is sum_c acc_c exp(m_c - max) / sum_c l_c exp(m_c - max), in chunk
/// order; max, over all chunks, is made once, with the first group. Kept out of line: inlined, its
/// registers spill in the attention loop.
template <int D, int G>
__device__ __noinline__ void merge_chunks(const float* part, int chunks, float* acc_s, std::size_t acc_bytes,
                                          bf16* out) {
  constexpr int P = attn_partial_floats(G, D);
  constexpr int kML = P - G * D;  // floats of a chunk's m and l
  constexpr int kItems = (G * D + kAttnWarps * 16 - 1) / (kAttnWarps * 16);  // outputs per thread (4-warp blocks)
  __shared__ __align__(16) float ml_s[kMaxAttnSplits * kML];
  const int tid = threadIdx.x, group = int(acc_bytes / (G * D * sizeof(float)));
  float L[kItems], A[kItems], M[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) L[k] = 0.f, A[k] = 0.f, M[k] = -INFINITY;
  for (int c0 = 0; c0 < chunks; c0 += group) {
    const int n = min(group, chunks - c0);
    if (c0 > 0) __syncthreads();  // every thread is done with the previous group
    if (c0 == 0)
      for (int i = tid; i < chunks * (kML / 4); i += blockDim.x) {
        const int c = i / (kML / 4), j = i % (kML / 4);
        cp_async16(ml_s + c * kML + 4 * j, part + std::size_t(c) * P + G * D + 4 * j, true);
      }
    for (int i = tid; i < n * (G * D / 4); i += blockDim.x) {
      const int c = i / (G * D / 4), j = i % (G * D / 4);
      cp_async16(acc_s + c * G * D + 4 * j, part + std::size_t(c0 + c) * P + 4 * j, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int idx = tid + k * int(blockDim.x), h = idx / D;
      if (idx >= G * D) break;
      if (c0 == 0)
        for (int c = 0; c < chunks; ++c) M[k] = fmaxf(M[k], ml_s[c * kML + h]);
      for (int c = 0; c < n; ++c) {
        const float f = __expf(ml_s[(c0 + c) * kML + h] - M[k]);
        L[k] += ml_s[(c0 + c) * kML + G + h] * f;
        A[k] += acc_s[c * G * D + idx] * f;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int idx = tid + k * int(blockDim.x);
    if (idx < G * D) out[idx] = __float2bfloat16(A[k] / L[k]);
  }
}

/// One block per (kv head, row, split): the G query heads sharing that kv head. LPT lanes per token
/// (DPL dims each), 8 positions per warp in flight; online softmax per lane group, then a combine
/// across groups (shuffles) and warps (shared memory). In decode the first iteration's K/V is on its
/// way into registers before the wait, and where the context is one chunk and the block has 8 warps,
/// the second's into shared memory (each lane copying the pieces it reads later, cp.async): a
/// context of up to 128 positions then reads no K/V after the wait.
/// Split-KV (AttnPlan, decode): a long context is cut into chunks of at least sp.min_chunk
/// positions, one block each (grid z; blocks past the last chunk exit at once). With one chunk the
/// block writes the output itself; otherwise each block stores its partial softmax state and the
/// last block to finish (a counter per (row, kv head)) combines the chunks and writes the output
/// (merge_chunks).
template <int D, int G, int MINB>
__global__ void __launch_bounds__(kAttnWarps * 32, MINB)
    attention_kernel(const float* qkv, int q_dim, int kv_dim, const bf16* q_norm, const bf16* k_norm, float eps,
                     const float2* rope, RowMeta meta, KvPool kv, int layer, int write_kv, AttnPlan sp, bf16* out) {
  constexpr int E = D / 64;
  // Lanes per position: 8, or 16 where the G heads' q and output in registers would leave one block
  // per SM (head_dim 128 with 3 or more heads per kv head).
  constexpr int LPT = D == 128 && G >= 3 ? 16 : 8;
  constexpr int DPL = D / LPT;  // dims per lane
  constexpr int NV = DPL / 8;   // uint4 loads per lane per token
  constexpr int PPW = 32 / LPT; // positions per warp and load round
  __shared__ float q_s[G][D];
  __shared__ float red_m[kAttnWarps][G], red_l[kAttnWarps][G];
  // The second iteration's K and V (read in the loop), then the warps' outputs (written after it).
  constexpr std::size_t kStageBytes = std::size_t(2) * kStaged * D * sizeof(bf16);
  constexpr std::size_t kRedBytes = std::size_t(kAttnWarps) * G * D * sizeof(float);
  __shared__ __align__(16) unsigned char scratch[kStageBytes > kRedBytes ? kStageBytes : kRedBytes];
  bf16* const stage_k = reinterpret_cast<bf16*>(scratch);
  bf16* const stage_v = stage_k + kStaged * D;
  float* const red_acc = reinterpret_cast<float*>(scratch);
  __shared__ __align__(16) bf16 k_new[D], v_new[D];  // decode: position pos's K/V as written to the cache

  const int kvh = blockIdx.x, r = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int sub = lane % LPT, grp = lane / LPT;
  const bf16* kbase = kv.base + std::size_t(layer) * kv.layer_stride();
  const bf16* vbase = kbase + kv.kv_stride();
  // Load rounds per iteration (their K/V loads are in flight together): 8 positions per warp and
  // iteration, the first iteration's loaded before the wait (more costs registers).
  constexpr int T = 8 / PPW;
  const int stride = nwarps * PPW;  // positions between a warp's load rounds
  auto kv_offset = [&](int blk, int t) {
    return ((std::size_t(blk) * kv.kv_heads + kvh) * kv.block_size + t % kv.block_size) * D + sub * DPL;
  };

  // Before waiting for the QKV projection: the step metadata (written before the step began) and,
  // in decode (write_kv: this kernel is the only writer of the layer's cache in the step, at
  // position pos), the first iteration's K/V of the earlier positions. In prefill the kernel before
  // this one writes the chunk's K/V, so everything is read after the wait.
  const bool pre = write_kv != 0;
  const int pos = meta.rows[r].pos;
  const int row_slot = meta.rows[r].slot;  // loaded with pos (the block table row depends on it)
  const int seq_len = pos + 1;
  // This block's positions [begin, end): chunk `split` of the context.
  int chunk = seq_len, chunks = 1;
  if (sp.splits > 1) {
    const int even = (seq_len + sp.splits - 1) / sp.splits;
    chunk = max(sp.min_chunk, (even + 63) / 64 * 64);
    chunks = (seq_len + chunk - 1) / chunk;
  }
  // The next kernel's blocks come onto the SMs once every block has let them: a context of one
  // chunk lets them after the wait, so that their weight prefetches do not compete with the QKV
  // projection this block waits on; a longer one at once, its loop hides their prefetches.
  if (chunks > 1) replay::pdl::launch_dependents();
  if (split >= chunks) {  // a short context needs fewer blocks than the grid has
    return;
  }
  const int begin = split * chunk, end = min(seq_len, begin + chunk);
  const bool owns_pos = end == seq_len;  // the last chunk holds position pos
  const std::int32_t* table = meta.block_table + std::size_t(row_slot) * meta.table_width;
  const int blk_pos = table[pos / kv.block_size];
  const int base0 = begin + warp * PPW;  // this warp's first position
  // The second iteration's positions go to shared memory where the context is one chunk and the
  // block has 8 warps (stage): slot u * stride + warp * PPW + grp, the position's offset from the
  // iteration's first (below kStaged). Both iterations' block-table entries are read first, in one
  // round trip. (Staging the chunks of a split context too took more from the step's other kernels
  // than it gave: see docs/perf-notes.md.)
  const bool stage = pre && chunks == 1 && nwarps == kAttnWarps;
  const int slot0 = (warp * PPW + grp) * D + sub * DPL;
  int blk_pre[2][T];
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base0 + (u + k * T) * stride + grp;
      blk_pre[k][u] = (k == 0 ? pre : stage) && t < pos && t < end ? table[t / kv.block_size] : -1;
    }
  uint4 kr[T][NV], vr[T][NV];
#pragma unroll
  for (int u = 0; u < T; ++u) {
    const int t = base0 + u * stride + grp;
    if (blk_pre[0][u] >= 0) {
      const std::size_t o = kv_offset(blk_pre[0][u], t);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
        vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
      }
    }
  }
  if (stage) {
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base0 + (u + T) * stride + grp;
      if (blk_pre[1][u] >= 0) {
        const std::size_t o = kv_offset(blk_pre[1][u], t);
        const int at = slot0 + u * stride * D;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          cp_async16(stage_k + at + i * 8, kbase + o + i * 8, true);
          cp_async16(stage_v + at + i * 8, vbase + o + i * 8, true);
        }
      }
    }
    cp_async_commit();
  }
  // The physical blocks of the positions of the iteration at `ahead`, read one iteration ahead (the
  // block table is fixed during the step), so that an iteration's K/V loads wait on one round trip
  // to L2, not two. The first fetch happens before the wait: the iteration after the one in
  // registers (decode), or the first (prefill). With four load rounds (16 lanes per position) the
  // registers this takes would spill: those instances read each iteration's blocks in it.
  constexpr bool kAhead = T <= 2;
  int blk_ahead[T];
  int ahead = base0 + (stage ? 2 : pre ? 1 : 0) * stride * T;
  auto fetch_blocks = [&]() {
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = ahead + u * stride + grp;
      blk_ahead[u] = t < end ? table[t / kv.block_size] : 0;
    }
  };
  if constexpr (kAhead) fetch_blocks();
  replay::pdl::wait();
  if (chunks == 1) replay::pdl::launch_dependents();

  const float* row = qkv + std::size_t(r) * (q_dim + 2 * kv_dim);
  const float scale = rsqrtf(static_cast<float>(D));

  for (int item = warp; item < G + (write_kv && owns_pos ? 1 : 0); item += nwarps) {
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

  float q[G][DPL];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DPL; ++j) q[h][j] = q_s[h][sub * DPL + j];
  SoftmaxState<G, DPL, LPT> sm;
  sm.init();

  for (int base = base0, it = 0; base < end; base += stride * T, ++it) {
    // In decode the first iteration's earlier positions are in registers already and, where staged,
    // the second's in shared memory; otherwise this iteration's blocks were fetched one iteration
    // ago (kAhead: then fetch the next iteration's).
    const bool in_regs = pre && it == 0, staged = stage && it == 1;
    int blk[T] = {};
    if (staged) cp_async_wait<0>();  // this lane's own copies
    if (!in_regs && !staged) {
      if constexpr (!kAhead) fetch_blocks();  // this iteration's
#pragma unroll
      for (int u = 0; u < T; ++u) blk[u] = blk_ahead[u];
      ahead += stride * T;
      if constexpr (kAhead) fetch_blocks();  // the next iteration's
    }
    bool valid[T];
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base + u * stride + grp;
      valid[u] = t < end;
      // Position pos (decode) was written above, also to shared memory (visible after the barrier):
      // no round trip to L2.
      if (valid[u] && pre && t == pos) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(k_new + sub * DPL + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(v_new + sub * DPL + i * 8);
        }
      } else if (valid[u] && staged) {
        const int at = slot0 + u * stride * D;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(stage_k + at + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(stage_v + at + i * 8);
        }
      } else if (valid[u] && !in_regs) {
        const std::size_t o = kv_offset(blk[u], t);
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
  // Combine the 4 lane groups of the warp.
  sm.combine_groups();
  if (stage) __syncthreads();  // every warp is past the staged K/V, which red_acc overwrites
  store_warp_state<G, DPL>(sm.m, sm.l, sm.acc, warp, grp, sub, &red_m[0][0], &red_l[0][0], red_acc, D);
  __syncthreads();
  // Split-KV: this chunk's state (unnormalised output, max and sum per query head) goes to
  // sp.partial[row][kv head][split] = {acc[G][D], m[G], l[G]} (attn_partial_floats).
  constexpr int P = attn_partial_floats(G, D);
  float* part = chunks > 1 ? sp.partial + (std::size_t(r) * kv.kv_heads + kvh) * sp.splits * P : nullptr;
  for (int idx = tid; idx < G * D; idx += blockDim.x) {
    const int h = idx / D, d = idx % D;
    const auto [mx, L, A] = merge_warp_states(&red_m[0][0], &red_l[0][0], red_acc, nwarps, G, D, h, d);
    if (part == nullptr) {
      out[std::size_t(r) * q_dim + (kvh * G + h) * D + d] = __float2bfloat16(A / L);
    } else {
      float* mine = part + std::size_t(split) * P;
      mine[idx] = A;
      if (d == 0) mine[G * D + h] = mx, mine[G * D + G + h] = L;
    }
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
  merge_chunks<D, G>(part, chunks, reinterpret_cast<float*>(scratch), sizeof(scratch),
                     out + std::size_t(r) * q_dim + kvh * G * D);
}

/// Calls f(attention_kernel<head_dim, G, MINB>): the one place that maps the runtime shape to an
/// instance. With up to 4 query heads per kv head the kernel is compiled for two blocks per SM (at
/// most 128 registers per thread, no spills): large buckets then run in half the waves, and the next
/// GEMV's block fits on an SM beside one; with more a cap would spill.
template <int D, class F>
void with_attention_d(int G, F&& f) {
  switch (G) {
    case 1: return f(attention_kernel<D, 1, 2>);
    case 2: return f(attention_kernel<D, 2, 2>);
    case 3: return f(attention_kernel<D, 3, 2>);
    case 4: return f(attention_kernel<D, 4, 2>);
    case 5: return f(attention_kernel<D, 5, 1>);
    case 6: return f(attention_kernel<D, 6, 1>);
    case 7: return f(attention_kernel<D, 7, 1>);
    case 8: return f(attention_kernel<D, 8, 1>);
    default:
      throw replay::usage_error(fmt::format("qwen attention: {} query heads per kv head (supported: 1..{})", G,
                                            kMaxGroup));
  }
}
template <class F>
void with_attention(int head_dim, int G, F&& f) {
  if (head_dim == 128) return with_attention_d<128>(G, std::forward<F>(f));
  if (head_dim == 64) return with_attention_d<64>(G, std::forward<F>(f));
  throw replay::usage_error(fmt::format("qwen attention: head_dim {} (supported: 64, 128)", head_dim));
}

}  // namespace

void init_attention_attributes() {
  for (int d : {64, 128})
    for (int g = 1; g <= kMaxGroup; ++g)
      with_attention(d, g, [](auto kernel) {
        REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)));
      });
}

AttnPlan plan_attention(int rows, int q_heads, int kv_heads, int head_dim, int num_sms) {
  int per_sm = 0;  // 8-warp blocks resident per SM
  with_attention(head_dim, q_heads / kv_heads, [&](auto kernel) {
    REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAttnWarps * 32, 0));
  });
  per_sm = per_sm < 1 ? 1 : per_sm;
  AttnPlan p;
  const int blocks = rows * kv_heads;
  if (blocks > per_sm * num_sms) {
    // A second wave would double the step's attention time; 4-warp blocks take a few more load
    // rounds each but fit twice as many on an SM (the register cap is per thread).
    p.warps = kAttnWarps / 2;
  } else if (blocks < num_sms) {
    // Only a grid that leaves SMs idle is split (a bigger one is already spread over the GPU, and its
    // extra blocks would cost launch slots at every length); then into one wave of blocks for a
    // context long enough to fill them.
    const int want = per_sm * num_sms / blocks;
    p.splits = want < 1 ? 1 : want > kMaxAttnSplits ? kMaxAttnSplits : want;
  }
  return p;
}

void launch_attention(const float* qkv, int q_heads, const bf16* q_norm, const bf16* k_norm, float eps,
                      const float2* rope, RowMeta meta, int rows, KvPool kv, int layer, bool write_kv, AttnPlan sp,
                      bf16* out, replay::stream_ref s) {
  if (sp.splits < 1 || sp.splits > kMaxAttnSplits || (sp.splits > 1 && (sp.partial == nullptr || sp.arrived == nullptr)))
    throw replay::usage_error("qwen::launch_attention: split-KV needs 1..kMaxAttnSplits splits and its scratch");
  if (sp.min_chunk < 64 || sp.min_chunk % 64 != 0)
    throw replay::usage_error("qwen::launch_attention: min_chunk must be a positive multiple of 64");
  if (sp.warps != kAttnWarps && sp.warps != kAttnWarps / 2)
    throw replay::usage_error("qwen::launch_attention: 4 or 8 warps per block");
  if (kv.kv_heads < 1 || q_heads % kv.kv_heads != 0)
    throw replay::usage_error("qwen::launch_attention: query heads must be a multiple of kv heads");
  const int D = kv.head_dim, q_dim = q_heads * D, kv_dim = kv.kv_heads * D;
  const replay::launch_config c{.grid = dim3(kv.kv_heads, rows, sp.splits), .block = dim3(sp.warps * 32),
                                .stream = s, .pdl = true};
  with_attention(D, q_heads / kv.kv_heads, [&](auto kernel) {
    replay::launch(kernel, c, qkv, q_dim, kv_dim, q_norm, k_norm, eps, rope, meta, kv, layer, write_kv ? 1 : 0, sp, out);
  });
}

void launch_kv_write(const float* qkv, int q_heads, const bf16* k_norm, float eps, const float2* rope, RowMeta meta,
                     int rows, KvPool kv, int layer, replay::stream_ref s) {
  const int q_dim = q_heads * kv.head_dim, kv_dim = kv.kv_heads * kv.head_dim;
  const replay::launch_config c{.grid = dim3(rows, kv.kv_heads), .block = dim3(32), .stream = s, .pdl = true};
  if (kv.head_dim == 128)
    replay::launch(kv_write_kernel<128>, c, qkv, q_dim, kv_dim, k_norm, eps, rope, meta, kv, layer);
  else if (kv.head_dim == 64)
    replay::launch(kv_write_kernel<64>, c, qkv, q_dim, kv_dim, k_norm, eps, rope, meta, kv, layer);
  else
    throw replay::usage_error(fmt::format("qwen::launch_kv_write: head_dim {} (supported: 64, 128)", kv.head_dim));
}

}  // namespace qwen
