// nanogpt/device.cuh: the device functions the decode step (decode_step.cu) and the prefill
// (prefill.cu) are built from: reading and advancing the step metadata, a 32-wide row in registers,
// LayerNorm folded into a linear layer, attention of one head over the KV cache, the attention
// projection, and sampling. Internal to the example (namespace nanogpt::detail, every function
// inline).
#pragma once

#include "kernels.cuh"

#include "common/rng.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace nanogpt::detail {

/// Reads the step metadata from L2, never from L1: with MetaPath::device and in the device loop the
/// previous step's sampler rewrote it in place (before this step was launched), so a line left in
/// this SM's L1 could be stale.
__device__ __forceinline__ StepMeta load_meta(const StepMeta* meta) {
  const int4* p = reinterpret_cast<const int4*>(meta);
  const int4 lo = __ldcg(p), hi = __ldcg(p + 1);
  StepMeta m;
  static_assert(sizeof(StepMeta) == 2 * sizeof(int4));
  memcpy(&m, &lo, sizeof(int4));
  memcpy(reinterpret_cast<char*>(&m) + sizeof(int4), &hi, sizeof(int4));
  return m;
}

/// MetaPath::device and the device loop: the sampler of a step (or a prefill) writes the metadata of
/// the step that follows it, the token it sampled at position seq_len, so the host need not write
/// anything for an ordinary next step. (The sampler's random draw is a function of the seed and
/// seq_len: advancing seq_len advances it.) Called after the kernel's wait, once every kernel of
/// the step has read the metadata. No fence: the next step's kernel reads the metadata only after
/// this kernel has completed (it is launched without PDL, kPdlFirst, or, chained in the
/// device loop, reads it after its own PDL wait), which makes these writes visible to it. The token
/// can therefore go to the host before this is written.
__device__ __forceinline__ void advance_meta(StepMeta* next, const StepMeta& m, int token) {
  if (next == nullptr) return;
  const StepMeta n = next_step_meta(m, token);
  next->token = n.token;
  next->pos = n.pos;
  next->seq_len = n.seq_len;
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// 32 consecutive floats (a residual-stream row, or one row of a [*, 32] weight matrix) in registers.
struct Row32 {
  float4 v[8];
};
/// Weights, loaded before the PDL wait. An ordinary cached load (ld.global.ca), not the read-only
/// path (__ldg, ld.global.nc): ptxas moves read-only loads past griddepcontrol.wait to save
/// registers, which puts them on the critical path; it keeps ordinary loads where they are.
__device__ __forceinline__ float load_weight(const float* w) { return __ldca(w); }
__device__ __forceinline__ float4 load_weight(const float4* w) { return __ldca(w); }
__device__ __forceinline__ Row32 load_row32(const float* w) {
  const float4* p = reinterpret_cast<const float4*>(w);
  Row32 r;
#pragma unroll
  for (int i = 0; i < 8; ++i) r.v[i] = load_weight(p + i);
  return r;
}
/// Activations written by the previous kernel (on another SM): read from L2.
__device__ __forceinline__ Row32 load_activations(const float* x) {
  const float4* p = reinterpret_cast<const float4*>(x);
  Row32 r;
#pragma unroll
  for (int i = 0; i < 8; ++i) r.v[i] = __ldcg(p + i);
  return r;
}

/// Sum of the 32 elements, as a tree (depth 5 instead of a chain of 31 additions).
__device__ __forceinline__ float sum32(const Row32& a) {
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = (a.v[i].x + a.v[i].y) + (a.v[i].z + a.v[i].w);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
/// dot(a, b) of two register rows: 8 independent chains of 4 FMAs, then a tree.
__device__ __forceinline__ float dot32(const Row32& a, const Row32& b) {
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    s[i] = fmaf(a.v[i].w, b.v[i].w, fmaf(a.v[i].z, b.v[i].z, fmaf(a.v[i].y, b.v[i].y, a.v[i].x * b.v[i].x)));
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
__device__ __forceinline__ float dot8(float4 qa, float4 qb, float4 ka, float4 kb) {
  float s = qa.x * ka.x;
  s = fmaf(qa.y, ka.y, s);
  s = fmaf(qa.z, ka.z, s);
  s = fmaf(qa.w, ka.w, s);
  s = fmaf(qb.x, kb.x, s);
  s = fmaf(qb.y, kb.y, s);
  s = fmaf(qb.z, kb.z, s);
  return fmaf(qb.w, kb.w, s);
}

/// One output row of Linear(LayerNorm(x)), with the LayerNorm's scale γ and shift β folded into the
/// row: w_j γ_j, and c = Σ_j w_j β_j + bias. Prepared before the wait, so that after it
/// out = rstd · Σ_j (w_j γ_j)(x_j − mean) + c  is one dot product (LayerNorm: PyTorch semantics,
/// biased variance, eps inside the square root; the same function, summed in another order).
struct NormLinearRow {
  Row32 w;  // w_j γ_j
  float c;  // Σ_j w_j β_j + bias
};
__device__ __forceinline__ NormLinearRow prefetch_norm_linear(const float* w_row, const float* gamma,
                                                              const float* beta, float bias) {
  const Row32 w = load_row32(w_row), g = load_row32(gamma), b = load_row32(beta);
  NormLinearRow r;
  r.c = bias + dot32(w, b);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    r.w.v[i] = make_float4(w.v[i].x * g.v[i].x, w.v[i].y * g.v[i].y, w.v[i].z * g.v[i].z, w.v[i].w * g.v[i].w);
  return r;
}
/// LayerNorm statistics of a row every thread holds: x ← x − mean(x); returns 1/sqrt(var(x) + eps).
__device__ __forceinline__ float center_rstd(Row32& x) {
  const float mean = sum32(x) * (1.0f / C::n_embd);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x.v[i].x -= mean;
    x.v[i].y -= mean;
    x.v[i].z -= mean;
    x.v[i].w -= mean;
  }
  return rsqrtf(dot32(x, x) * (1.0f / C::n_embd) + C::ln_eps);
}
/// The output of `row` for the centred input `xc` (from center_rstd).
__device__ __forceinline__ float norm_linear(const NormLinearRow& row, const Row32& xc, float rstd) {
  return fmaf(rstd, dot32(row.w, xc), row.c);
}

/// The keys and values one lane scores: cache slots `lane` and `lane + 32` of one head.
struct KvRows {
  float4 k[2][2];  // [slot i][half]: slot lane + 32 i, elements 0-3 and 4-7
  float4 v[2][2];
};

/// Loads this lane's two slots of one head's cache from L2, whatever the position: slots past the
/// current one hold zeros or an earlier sequence's values, all finite, and attend_head masks them.
/// Not depending on the position lets the decode kernel issue these loads before the step metadata
/// has arrived.
__device__ __forceinline__ KvRows load_kv_rows(const float* k_head, const float* v_head) {
  KvRows r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int j = lane_id() + 32 * i;
    const float4* k4 = reinterpret_cast<const float4*>(k_head + j * C::head_size);
    const float4* v4 = reinterpret_cast<const float4*>(v_head + j * C::head_size);
    r.k[i][0] = __ldcg(k4);
    r.k[i][1] = __ldcg(k4 + 1);
    r.v[i][0] = __ldcg(v4);
    r.v[i][1] = __ldcg(v4 + 1);
  }
  return r;
}

/// 8 floats (one head's query, key, value or output) as two float4.
struct Head8 {
  float4 a, b;
};

/// The 9 sums of a head's softmax over its 64 cache slots for the weights p0, p1 of this lane's slots
/// lane and lane + 32 in `kv`: Σp·v for the 8 value elements and Σp (acc[8]), in one butterfly.
/// Every lane gets bit-identical sums (each level adds a pair in either order), so branches on them
/// are warp-uniform.
__device__ __forceinline__ void weighted_sums(float p0, float p1, const KvRows& kv, float acc[9]) {
  const float v0[8] = {kv.v[0][0].x, kv.v[0][0].y, kv.v[0][0].z, kv.v[0][0].w,
                       kv.v[0][1].x, kv.v[0][1].y, kv.v[0][1].z, kv.v[0][1].w};
  const float v1[8] = {kv.v[1][0].x, kv.v[1][0].y, kv.v[1][0].z, kv.v[1][0].w,
                       kv.v[1][1].x, kv.v[1][1].y, kv.v[1][1].z, kv.v[1][1].w};
  acc[8] = p0 + p1;
#pragma unroll
  for (int d = 0; d < 8; ++d) acc[d] = fmaf(p0, v0[d], p1 * v1[d]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < 9; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
}

/// Causal attention of one head for one query q: softmax over the scores of the cache slots 0..last
/// held in `kv` (slot lane + 32 i in lane `lane`; slots after `last` are masked exactly like the
/// seed's `kv_indices <= cache_pos`: score -inf, weight 0, whatever they hold) plus one extra slot
/// every lane holds (decode: this token's own key and value, whose score is `extra_score`; prefill:
/// extra_score = -inf). Called by a whole warp; every lane gets the head's 8 outputs.
///
/// The weights are first exp(score) unshifted, so that no maximum has to be reduced across the warp
/// before the butterfly (5 dependent shuffles). Where the sum of the weights lies in [2^-60, 2^60] no
/// weight overflows and any weight that underflows is below 2^-66 of the sum, so the result is the
/// softmax's up to rounding; outside it (a score beyond about ±41) the head is recomputed shifted by
/// the maximum score, as PyTorch's softmax. The exponential and the reciprocal are the hardware's
/// (MUFU: within a few ulp, a third of the cycles of expf and of an IEEE division on this chain;
/// docs/perf-notes.md, NanoGPT decode). Same inputs, same branch: eager and graph stay
/// bit-identical.
__device__ __forceinline__ Head8 attend_head(Head8 q, const KvRows& kv, int last, float extra_score, Head8 extra_v) {
  const int lane = lane_id();
  constexpr float scale = 0.35355339059327373f;  // head_size ** -0.5
  float score[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    score[i] = lane + 32 * i <= last ? dot8(q.a, q.b, kv.k[i][0], kv.k[i][1]) * scale : -INFINITY;
  float pe = __expf(extra_score);  // exp(-inf) = 0 for masked slots and for prefill's extra slot
  float acc[9];
  weighted_sums(__expf(score[0]), __expf(score[1]), kv, acc);
  float sum = acc[8] + pe;
  if (!(sum >= 0x1p-60f && sum <= 0x1p60f)) {
    // At least one slot is valid (slot 0 in prefill, this token in decode), so m is finite.
    const float m = fmaxf(warp_max(fmaxf(score[0], score[1])), extra_score);
    pe = __expf(extra_score - m);
    weighted_sums(__expf(score[0] - m), __expf(score[1] - m), kv, acc);
    sum = acc[8] + pe;
  }
  const float inv_sum = __fdividef(1.0f, sum);
  Head8 out;
  out.a = make_float4(fmaf(pe, extra_v.a.x, acc[0]) * inv_sum, fmaf(pe, extra_v.a.y, acc[1]) * inv_sum,
                      fmaf(pe, extra_v.a.z, acc[2]) * inv_sum, fmaf(pe, extra_v.a.w, acc[3]) * inv_sum);
  out.b = make_float4(fmaf(pe, extra_v.b.x, acc[4]) * inv_sum, fmaf(pe, extra_v.b.y, acc[5]) * inv_sum,
                      fmaf(pe, extra_v.b.z, acc[6]) * inv_sum, fmaf(pe, extra_v.b.w, acc[7]) * inv_sum);
  return out;
}

/// attn_proj, split by head: lane i of warp h holds attn_proj.weight[i][8h .. 8h+7] and computes
/// head h's share of output i; the shares of the 4 heads are summed through shared memory.
struct ProjSlice {
  Head8 w;     // proj_w[lane][8h .. 8h+7]
  float bias;  // proj_b[lane]
};
__device__ __forceinline__ ProjSlice prefetch_proj(const LayerParams& p) {
  const float4* w = reinterpret_cast<const float4*>(p.proj_w + lane_id() * C::n_embd + warp_id() * C::head_size);
  return {{load_weight(w), load_weight(w + 1)}, load_weight(p.proj_b + lane_id())};
}
/// x_row[i] = x_i + attn_proj(heads)[i]: every warp passes its head's output; warp 0 writes the row.
/// Called by all 128 threads (one barrier).
__device__ __forceinline__ void project_residual(const ProjSlice& w, Head8 head, float x_lane, float* x_row) {
  __shared__ float share[kWarps][C::n_embd];
  const int lane = lane_id(), h = warp_id();
  share[h][lane] = dot8(w.w.a, w.w.b, head.a, head.b);
  __syncthreads();
  if (h == 0) x_row[lane] = x_lane + (((share[0][lane] + share[1][lane]) + (share[2][lane] + share[3][lane])) + w.bias);
}

// ---- sampling (prefill and decode) ---------------------------------------------------------------

/// Sampling by the Gumbel-max trick: the token is argmax_t (logit_t / T + g_t) with independent
/// Gumbel noise g_t = -log(-log(u_t)), which draws exactly from softmax(logits / T). u_t is uniform
/// in (0, 1), a pure function of (seed, seq_len, t) (common/rng.hpp), so the noise is drawn before
/// the logits are known, and once they are the draw is one argmax: no maximum, no exponentials and
/// no scan on the critical path. Greedy (or temperature <= 0): g = 0, T = 1, i.e. the argmax of the
/// logits. Deterministic: the same inputs give the same token on every run.
__device__ __forceinline__ float gumbel_noise(const StepMeta& m, int t) {
  const std::uint64_t bits =
      replay_examples::random_bits(m.seed, static_cast<std::uint64_t>(m.seq_len) * C::vocab_size + t);
  const float u = (static_cast<float>(bits >> 41) + 0.5f) * (1.0f / 8388608.0f);  // [2^-24, 1 - 2^-24]
  return -logf(-logf(u));
}
/// The key thread t offers to the argmax: logit / T + noise, or -inf past the vocabulary.
__device__ __forceinline__ float sampling_key(const StepMeta& m, int t, float logit, float noise) {
  const bool greedy = m.greedy != 0 || !(m.temperature > 0.0f);
  return t < C::vocab_size ? fmaf(logit, greedy ? 1.0f : 1.0f / m.temperature, noise) : -INFINITY;
}
__device__ __forceinline__ float sampling_noise(const StepMeta& m, int t) {
  const bool greedy = m.greedy != 0 || !(m.temperature > 0.0f);
  return greedy || t >= C::vocab_size ? 0.0f : gumbel_noise(m, t);
}

/// The index of the largest `key` over the block (thread t offers key for index t), lowest index on
/// ties. Called by all threads (one barrier); the result is meaningful in thread 0.
__device__ __forceinline__ int argmax_block(float key) {
  __shared__ float warp_key[kWarps];
  __shared__ int warp_idx[kWarps];
  float best = key;
  int idx = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  if (lane_id() == 0) warp_key[warp_id()] = best, warp_idx[warp_id()] = idx;
  __syncthreads();
  best = warp_key[0];
  idx = warp_idx[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w)
    if (warp_key[w] > best) best = warp_key[w], idx = warp_idx[w];  // later warps hold higher indices
  return idx;
}

}  // namespace nanogpt::detail
