// nanogpt/model.cu: the decoder's kernels, their launchers, and the Model (see model.hpp).
//
// A decode step (one token, B = 1) is one kernel, decode_step_kernel, one block of 128 threads:
//
//   x = tok_emb[token] + pos_emb[pos]                                     (token, pos: StepMeta)
//   for each of 4 layers:
//     attention_sublayer   x += attn_proj(Attention(LN1(x)))   QKV, KV-cache write at slot pos,
//                                                               attention over slots 0..pos
//     ffn_sublayer         x += fc2(ReLU(fc1(LN2(x))))
//   logits = lm_head(LN_f(x)); token = sample(logits)                     → pinned host slot
//
// The step is a chain of small dependent computations, so its time is latency, not bandwidth or
// arithmetic. One block for the whole step replaces each kernel handoff by a barrier and keeps the
// residual row in shared memory; every weight is staged into shared memory by bulk copies that
// overlap the computation (see "The decode step" below).
//   - Every thread normalises the whole 32-wide residual row itself (sums in registers, no
//     shuffles, no barrier), then computes its output row of the linear layer as one 32-wide dot
//     product, the LayerNorm's scale and shift folded into the staged weights.
//   - Attention: warp h is head h; lanes 0-7 / 8-15 / 16-23 compute the head's query / key / value,
//     shuffles hand them to every lane, lane l scores the cache slots l and l + 32.
//
// Per-step values (token, position, sequence length, sampling settings) are read from StepMeta
// through a pointer, never passed by value: a graph captured once replays correctly at any
// position. Prefill (eager) is a separate set of kernels, one block per prompt token and one
// kernel per operation, built from the same device functions.
#include "model.hpp"

#include "common/rng.hpp"
#include "common/timing.hpp"

#include <replay/replay.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <source_location>
#include <stdexcept>
#include <utility>

namespace nanogpt {
namespace {

using C = Config;

// ============================================================================================
// Parameters and buffers (device pointers; fixed for the Model's lifetime)
// ============================================================================================

/// One transformer block's parameters. Linear weights are row-major [out, in] as in PyTorch.
struct LayerParams {
  const float* ln1_w;   // [32]
  const float* ln1_b;   // [32]
  const float* qkv_w;   // [96, 32]: rows 0-31 query, 32-63 key, 64-95 value; head h = rows 8h..8h+7
  const float* proj_w;  // [32, 32]  attention output projection
  const float* proj_b;  // [32]
  const float* ln2_w;   // [32]
  const float* ln2_b;   // [32]
  const float* fc1_w;   // [128, 32]
  const float* fc1_b;   // [128]
  const float* fc2_w;   // [32, 128]
  const float* fc2_b;   // [32]
};

/// All parameters.
struct ModelParams {
  const float* tok_emb;  // [65, 32]
  const float* pos_emb;  // [64, 32]
  LayerParams layer[C::n_layer];
  const float* lnf_w;   // [32]
  const float* lnf_b;   // [32]
  const float* head_w;  // [65, 32]
  const float* head_b;  // [65]
};

/// Activations and caches. Allocated once from a frozen static_arena.
struct Buffers {
  float* x;                    // [block_size, 32] residual stream, one row per token (decode: row 0)
  float* q;                    // [block_size, 32] prompt queries (prefill only)
  float* k_cache;              // [n_layer, n_head, block_size, head_size]  static KV cache
  float* v_cache;              // [n_layer, n_head, block_size, head_size]
  float* logits;               // [vocab_size] of the last position processed
  const std::int32_t* prompt;  // [block_size] prompt token ids (step_meta_array, prefill only)
  std::int32_t* token_out;     // pinned host memory: the sampled token
  StepMeta* advance;           // MetaPath::device: the sampler writes the next step's metadata here
                               // (the StepMeta the kernels read); nullptr otherwise
};

constexpr int kThreads = 128;  // 4 warps per block
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == C::n_head, "attention maps one warp to one head");
static_assert(C::head_size == 8, "lanes 0-7 / 8-15 / 16-23 of a warp compute one head's query / key / value");
static_assert(C::ffn_hidden == kThreads, "fc1 maps one hidden unit to one thread");
static_assert(C::vocab_size <= kThreads && 3 * C::n_embd <= kThreads);
constexpr int kCacheLayer = C::n_head * C::block_size * C::head_size;  // floats per layer per K/V


// ============================================================================================
// Device building blocks
// ============================================================================================

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
/// this kernel has completed (it is launched without PDL, Launcher::pdl_first, or, chained in the
/// device loop, reads it after its own PDL wait), which makes these writes visible to it. The token
/// can therefore go to the host before this is written.
__device__ __forceinline__ void advance_meta(StepMeta* next, const StepMeta& m, int token) {
  if (next == nullptr) return;
  next->token = token;
  next->pos = m.seq_len;
  next->seq_len = m.seq_len + 1;
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
/// README items 15 and 16). Same inputs, same branch: eager and graph stay bit-identical.
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

// ============================================================================================
// Prefill kernels (eager only): one block per prompt token
// ============================================================================================

/// x[row] = tok_emb[prompt[row]] + pos_emb[pos + row]. One warp per row. Launched without PDL
/// (Launcher::pdl_first): it starts after everything before it on the stream has completed.
__global__ void __launch_bounds__(32) embed_prefill_kernel(const float* tok_emb, const float* pos_emb,
                                                           const StepMeta* meta, Buffers b) {
  replay::pdl::wait();
  replay::pdl::launch_dependents();
  const StepMeta m = load_meta(meta);
  const int row = static_cast<int>(blockIdx.x);
  const bool active = row < m.seq_len;
  const int token = active ? b.prompt[row] : 0;
  const int pos = active ? m.pos + row : 0;
  const int i = lane_id();
  const float e = load_weight(tok_emb + token * C::n_embd + i) + load_weight(pos_emb + pos * C::n_embd + i);
  if (active) b.x[row * C::n_embd + i] = e;
}

/// Part 1 of the attention sublayer: one block per prompt token writes its q and its k, v (every
/// token's k, v must be in the cache before any token attends). Thread t computes row t of the QKV
/// projection.
__global__ void __launch_bounds__(kThreads) qkv_prefill_kernel(LayerParams p, int layer,
                                                               const StepMeta* meta, Buffers b) {
  replay::pdl::launch_dependents();
  const int t = static_cast<int>(threadIdx.x);
  const NormLinearRow w_qkv =
      prefetch_norm_linear(p.qkv_w + min(t, 3 * C::n_embd - 1) * C::n_embd, p.ln1_w, p.ln1_b, 0.0f);
  const StepMeta m = load_meta(meta);
  const int row = static_cast<int>(blockIdx.x);
  replay::pdl::wait();
  if (row >= m.seq_len) return;
  Row32 x = load_activations(b.x + row * C::n_embd);
  const float rstd = center_rstd(x);
  const float out = norm_linear(w_qkv, x, rstd);
  const int pos = m.pos + row;
  if (t < C::n_embd) {
    b.q[row * C::n_embd + t] = out;
  } else if (t < 3 * C::n_embd) {
    const int c = (t - C::n_embd) % C::n_embd;  // column within k or v
    float* cache = (t < 2 * C::n_embd ? b.k_cache : b.v_cache) + layer * kCacheLayer;
    cache[((c / C::head_size) * C::block_size + pos) * C::head_size + c % C::head_size] = out;
  }
}

/// Part 2: one block per prompt token attends over slots 0..its position (causal), then
/// projection + residual.
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(LayerParams p, int layer,
                                                                     const StepMeta* meta, Buffers b) {
  replay::pdl::launch_dependents();
  const ProjSlice w_proj = prefetch_proj(p);
  const StepMeta m = load_meta(meta);
  const int row = static_cast<int>(blockIdx.x);
  replay::pdl::wait();
  if (row >= m.seq_len) return;
  const int h = warp_id();
  const int pos = m.pos + row;
  const int head_off = layer * kCacheLayer + h * C::block_size * C::head_size;
  const KvRows kv = load_kv_rows(b.k_cache + head_off, b.v_cache + head_off);
  const float4* q4 = reinterpret_cast<const float4*>(b.q + row * C::n_embd + h * C::head_size);
  const Head8 q = {__ldcg(q4), __ldcg(q4 + 1)};
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const Head8 head = attend_head(q, kv, pos, -INFINITY, {zero, zero});
  float* x_row = b.x + row * C::n_embd;
  project_residual(w_proj, head, __ldcg(x_row + lane_id()), x_row);
}

/// The feed-forward sublayer: x[row] += fc2(ReLU(fc1(LN2(x[row])))).
/// Thread t computes hidden unit t; then thread (warp w, lane i) multiplies hidden units
/// 32w..32w+31 (read from shared memory) by its slice of fc2's row i, and warp 0 sums the 4 slices.
__global__ void __launch_bounds__(kThreads) ffn_prefill_kernel(LayerParams p, const StepMeta* meta, Buffers b) {
  replay::pdl::launch_dependents();
  const int t = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const NormLinearRow w1 = prefetch_norm_linear(p.fc1_w + t * C::n_embd, p.ln2_w, p.ln2_b, load_weight(p.fc1_b + t));
  const Row32 w2 = load_row32(p.fc2_w + lane * C::ffn_hidden + warp * 32);
  const float b2 = load_weight(p.fc2_b + lane);
  const int row = static_cast<int>(blockIdx.x);
  const bool active = row < __ldcg(&meta->seq_len);
  replay::pdl::wait();
  if (!active) return;  // a row past the prompt
  float* x_row = b.x + row * C::n_embd;
  Row32 x = load_activations(x_row);
  const float x_lane = __ldcg(x_row + lane);
  const float rstd = center_rstd(x);
  __shared__ __align__(16) float hidden[C::ffn_hidden];
  __shared__ float share[kWarps][C::n_embd];
  const float hidden_t = fmaxf(norm_linear(w1, x, rstd), 0.0f);  // ReLU
  hidden[t] = hidden_t;
  __syncthreads();
  Row32 h;
#pragma unroll
  for (int i = 0; i < 8; ++i) h.v[i] = reinterpret_cast<const float4*>(hidden + warp * 32)[i];
  const float share_t = dot32(w2, h);
  share[warp][lane] = share_t;
  __syncthreads();
  if (warp == 0) x_row[lane] = x_lane + (((share[0][lane] + share[1][lane]) + (share[2][lane] + share[3][lane])) + b2);
}

// ============================================================================================
// Sampling (prefill and decode)
// ============================================================================================

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

/// Last kernel of a prefill: logits = lm_head(LN_f(x[last prompt row])), then sampling; the logits
/// go to b.logits and the token straight to pinned host memory. Thread t computes logit t.
__global__ void __launch_bounds__(kThreads) lm_head_prefill_kernel(const float* lnf_w, const float* lnf_b,
                                                                   const float* head_w, const float* head_b,
                                                                   const StepMeta* meta, Buffers b) {
  replay::pdl::launch_dependents();
  const int t = static_cast<int>(threadIdx.x);
  const int row_w = min(t, C::vocab_size - 1);
  const NormLinearRow w = prefetch_norm_linear(head_w + row_w * C::n_embd, lnf_w, lnf_b, load_weight(head_b + row_w));
  const StepMeta m = load_meta(meta);
  const float noise = sampling_noise(m, t);
  replay::pdl::wait();
  Row32 x = load_activations(b.x + (m.seq_len - 1) * C::n_embd);
  const float rstd = center_rstd(x);
  const float logit = norm_linear(w, x, rstd);
  if (t < C::vocab_size) b.logits[t] = logit;
  const int token = argmax_block(sampling_key(m, t, logit, noise));
  if (t == 0) {
    advance_meta(b.advance, m, token);
    *static_cast<volatile std::int32_t*>(b.token_out) = token;  // host polls it
  }
}

// ============================================================================================
// The decode step: one kernel, one block
// ============================================================================================
//
// A decode step of one token is a chain of small dependent computations; as separate kernels each
// link costs a kernel handoff and a re-read of the residual row from L2. decode_step_kernel runs
// the whole step in one block of 128 threads: the residual row lives in shared memory between
// sublayers (a barrier instead of a handoff), and every weight of the model is in shared memory.
//
// The weights reach shared memory as a StageImage: the Model prepares it once on the host (below,
// make_stage_image) in exactly the layout the kernel reads, and every step copies it with 9 bulk
// copies (cp.async.bulk, the Tensor Memory Accelerator), one per sublayer in the order the
// sublayers use them, each completing on its own mbarrier. A sublayer waits only for its own copy,
// so the copies of later layers overlap the computation of earlier ones; when the kernel is
// launched early by PDL (the device loop's chained steps) they all complete before its wait
// returns. The image holds each LayerNorm folded into the linear layer after it (its scale γ into
// the weight rows, its shift β into a per-row constant), and its matrices with 16-byte chunk c of
// row r at chunk c ^ (r & 7): the 8 threads of a quarter-warp read 8 different rows at the same
// column, which this places in 8 different bank groups (no shared-memory bank conflicts).

/// One layer's attention weights: LN1 folded into the QKV rows; the output projection.
struct AttnStage {
  float4 qkv[3 * C::n_embd][C::n_embd / 4];   // qkv_w[r][j] * ln1_w[j], swizzled rows
  float qkv_c[3 * C::n_embd];                 // sum_j qkv_w[r][j] * ln1_b[j]
  float4 proj[C::n_embd][C::n_embd / 4];      // swizzled rows
  float proj_b[C::n_embd];
};
/// One layer's feed-forward weights: LN2 folded into fc1.
struct FfnStage {
  float4 fc1[C::ffn_hidden][C::n_embd / 4];   // fc1_w[r][j] * ln2_w[j], swizzled rows
  float fc1_c[C::ffn_hidden];                 // sum_j fc1_w[r][j] * ln2_b[j] + fc1_b[r]
  float4 fc2[C::n_embd][C::ffn_hidden / 4];   // swizzled rows
  float fc2_b[C::n_embd];
};
/// The final LayerNorm folded into lm_head.
struct HeadStage {
  float4 w[C::vocab_size][C::n_embd / 4];     // head_w[r][j] * lnf_w[j], swizzled rows
  float c[C::vocab_size + 3];                 // sum_j head_w[r][j] * lnf_b[j] + head_b[r] (3 unused)
};
/// Every weight a decode step reads, in the order it reads them.
struct StageImage {
  float tok_emb[C::vocab_size][C::n_embd];
  float pos_emb[C::block_size][C::n_embd];
  struct Layer {
    AttnStage attn;
    FfnStage ffn;
  } layer[C::n_layer];
  HeadStage head;
};
static_assert(sizeof(StageImage) == sizeof(StageImage::tok_emb) + sizeof(StageImage::pos_emb) +
                                        C::n_layer * (sizeof(AttnStage) + sizeof(FfnStage)) + sizeof(HeadStage),
              "no padding: the bulk copies take the image as contiguous byte ranges");
/// The bulk copies: embeddings + layer 0 attention, then one per sublayer, then the head.
constexpr int kStageCopies = 2 * C::n_layer + 1;
constexpr unsigned stage_bytes(int i) {
  return i == 0 ? unsigned(sizeof(StageImage::tok_emb) + sizeof(StageImage::pos_emb) + sizeof(AttnStage))
         : i == kStageCopies - 1 ? unsigned(sizeof(HeadStage))
         : i % 2 == 1            ? unsigned(sizeof(FfnStage))
                                 : unsigned(sizeof(AttnStage));
}
constexpr unsigned stage_offset(int i) { return i == 0 ? 0u : stage_offset(i - 1) + stage_bytes(i - 1); }
static_assert(stage_offset(kStageCopies) == sizeof(StageImage));
static_assert(sizeof(AttnStage) % 16 == 0 && sizeof(FfnStage) % 16 == 0 && sizeof(HeadStage) % 16 == 0,
              "bulk copies move multiples of 16 bytes");

/// Everything decode_step_kernel keeps in shared memory (dynamic shared memory: above 48 KiB).
struct StepShared {
  StageImage w;
  float x[C::n_embd];                         // the residual row between sublayers
  float hidden[C::ffn_hidden];
  float share[kWarps][C::n_embd];             // per-warp partial sums of a projection
  unsigned long long staged[kStageCopies];    // mbarrier of each bulk copy
};
constexpr std::size_t kStepSharedBytes = sizeof(StepShared);
static_assert(kStepSharedBytes <= 227 * 1024, "the decode step's shared memory must fit one sm_90 block");

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
/// Thread 0: initialises the mbarriers and issues the bulk copies of the whole image. The caller
/// then synchronises the block once (nobody may wait on a barrier before it is initialised).
__device__ __forceinline__ void stage_weights(StepShared& s, const StageImage* image) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0) return;
  for (int i = 0; i < kStageCopies; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(&s.staged[i])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
  const char* src = reinterpret_cast<const char*>(image);
  char* dst = reinterpret_cast<char*>(&s.w);
  for (int i = 0; i < kStageCopies; ++i) {
    const unsigned bar = shared_address(&s.staged[i]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(stage_bytes(i)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     shared_address(dst + stage_offset(i))),
                 "l"(src + stage_offset(i)), "r"(stage_bytes(i)), "r"(bar)
                 : "memory");
  }
#else
  (void)s, (void)image;
  __trap();  // the Model refuses devices below sm_90 (shared memory per block)
#endif
}
/// Waits until bulk copy `i` has landed (every thread that reads it waits itself).
__device__ __forceinline__ void wait_staged(StepShared& s, int i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned bar = shared_address(&s.staged[i]);
  unsigned done = 0;
  while (done == 0)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
#else
  (void)s, (void)i;
#endif
}

/// 8 consecutive chunks of swizzled row `r` from chunk `first` (a multiple of 8): 32 floats.
template <int Chunks>
__device__ __forceinline__ Row32 staged_row(const float4 (*m)[Chunks], int r, int first = 0) {
  Row32 out;
#pragma unroll
  for (int i = 0; i < 8; ++i) out.v[i] = m[r][first + (i ^ (r & 7))];
  return out;
}
/// 32 floats of shared memory every thread reads (a broadcast).
__device__ __forceinline__ Row32 shared_row(const float* v) {
  Row32 out;
#pragma unroll
  for (int i = 0; i < 8; ++i) out.v[i] = reinterpret_cast<const float4*>(v)[i];
  return out;
}
__device__ __forceinline__ Row32 add(const Row32& a, const Row32& b) {
  Row32 out;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    out.v[i] = make_float4(a.v[i].x + b.v[i].x, a.v[i].y + b.v[i].y, a.v[i].z + b.v[i].z, a.v[i].w + b.v[i].w);
  return out;
}

/// Attention sublayer of one layer for the step's token: s.x = x + proj(Attention(LN1(x))), for the
/// residual row x (every thread holds it; x_lane: element lane of it). Warp h is head h; lanes
/// 0-7 / 8-15 / 16-23 compute its query / key / value (lanes 24-31 repeat the value rows), the key
/// and value go to cache slot pos, and attend_head weighs slots 0..pos-1 (`history`, loaded
/// before) and this token. Ends with the barrier that publishes the new x.
__device__ __forceinline__ void attention_sublayer(StepShared& s, Row32 x, float x_lane, const AttnStage& w,
                                                   const KvRows& history, float* k_head, float* v_head, int pos) {
  const int lane = lane_id(), h = warp_id();
  const float rstd = center_rstd(x);
  const int row = min(lane >> 3, 2) * C::n_embd + h * C::head_size + (lane & 7);
  const float out = fmaf(rstd, dot32(staged_row(w.qkv, row), x), w.qkv_c[row]);
  if (lane >= 8 && lane < 24) (lane < 16 ? k_head : v_head)[pos * C::head_size + (lane & 7)] = out;  // cache slot pos
  const auto from = [&](int l) { return __shfl_sync(0xffffffffu, out, l); };
  const Head8 q = {make_float4(from(0), from(1), from(2), from(3)), make_float4(from(4), from(5), from(6), from(7))};
  const Head8 k = {make_float4(from(8), from(9), from(10), from(11)), make_float4(from(12), from(13), from(14), from(15))};
  const Head8 v = {make_float4(from(16), from(17), from(18), from(19)), make_float4(from(20), from(21), from(22), from(23))};
  constexpr float scale = 0.35355339059327373f;  // head_size ** -0.5
  const Head8 head = attend_head(q, history, pos - 1, dot8(q.a, q.b, k.a, k.b) * scale, v);
  // Projection, split by head: lane i of warp h holds proj_w[i][8h .. 8h+7] (chunks 2h, 2h + 1).
  const float4 w0 = w.proj[lane][(2 * h) ^ (lane & 7)], w1 = w.proj[lane][(2 * h + 1) ^ (lane & 7)];
  s.share[h][lane] = dot8(w0, w1, head.a, head.b);
  __syncthreads();
  if (h == 0)
    s.x[lane] = x_lane + (((s.share[0][lane] + s.share[1][lane]) + (s.share[2][lane] + s.share[3][lane])) + w.proj_b[lane]);
  __syncthreads();
}

/// Feed-forward sublayer: s.x += fc2(ReLU(fc1(LN2(x)))). Thread t computes hidden unit t; then
/// thread (warp w, lane i) multiplies hidden units 32w..32w+31 by its slice of fc2's row i, and
/// warp 0 sums the 4 slices. Ends with the barrier that publishes the new x.
__device__ __forceinline__ void ffn_sublayer(StepShared& s, const FfnStage& w) {
  const int t = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  Row32 x = shared_row(s.x);
  const float x_lane = s.x[lane];
  const float rstd = center_rstd(x);
  s.hidden[t] = fmaxf(fmaf(rstd, dot32(staged_row(w.fc1, t), x), w.fc1_c[t]), 0.0f);  // ReLU
  __syncthreads();
  s.share[warp][lane] = dot32(staged_row(w.fc2, lane, 8 * warp), shared_row(s.hidden + 32 * warp));
  __syncthreads();
  if (warp == 0)
    s.x[lane] = x_lane + (((s.share[0][lane] + s.share[1][lane]) + (s.share[2][lane] + s.share[3][lane])) + w.fc2_b[lane]);
  __syncthreads();
}

/// One decode step for one token (StepMeta: token, pos, seq_len, sampling), in one block:
///   x = tok_emb[token] + pos_emb[pos]
///   for each layer: x += attention(LN1(x)) (k, v written to cache slot pos); x += FFN(LN2(x))
///   logits = lm_head(LN_f(x)); token = sample(logits)
/// The token goes to pinned host memory (the host polls it) or, in the device loop (`loop` not
/// null), to the loop's token buffer, which also decides whether the loop runs another step.
///
/// Before its PDL wait the kernel only stages weights: everything it reads that an earlier step
/// writes (the metadata, the KV cache, the loop's header) is read after it. Launched with PDL (the
/// device loop's chained steps) it starts while the previous step runs, so the staging is off the
/// critical path; launched without (the first step of a graph or of a run of the loop's body, and
/// eager steps) it starts once the previous step has completed.
__global__ void __launch_bounds__(kThreads, 1) decode_step_kernel(const StageImage* image, const StepMeta* meta,
                                                                  Buffers b, replay::token_loop_ref loop) {
  extern __shared__ float4 shared_mem[];
  StepShared& s = *reinterpret_cast<StepShared*>(shared_mem);
  replay::pdl::launch_dependents();
  const int t = static_cast<int>(threadIdx.x), lane = lane_id(), h = warp_id();
  stage_weights(s, image);
  __syncthreads();

  replay::pdl::wait();
  const StepMeta m = load_meta(meta);
  const replay::loop_header lh = loop.header != nullptr ? loop.read_header() : replay::loop_header{};
  if (lh.stopped != 0) {
    for (int i = 0; i < kStageCopies; ++i) wait_staged(s, i);  // leave no copy in flight
    return;  // the device loop stopped at an earlier step of this run of its body
  }
  const int head_off = h * C::block_size * C::head_size;
  KvRows history = load_kv_rows(b.k_cache + head_off, b.v_cache + head_off);  // layer 0; slots < pos are valid
  const float noise = sampling_noise(m, t);

#pragma unroll
  for (int l = 0; l < C::n_layer; ++l) {
    float* k_head = b.k_cache + l * kCacheLayer + head_off;
    float* v_head = b.v_cache + l * kCacheLayer + head_off;
    // The next layer's history is loaded while this layer computes.
    const KvRows next = l + 1 < C::n_layer ? load_kv_rows(k_head + kCacheLayer, v_head + kCacheLayer) : history;
    wait_staged(s, 2 * l);
    if (l == 0) {
      // The embedding: every thread builds the row itself (no barrier before layer 0).
      const Row32 x = add(shared_row(s.w.tok_emb[m.token]), shared_row(s.w.pos_emb[m.pos]));
      const float x_lane = s.w.tok_emb[m.token][lane] + s.w.pos_emb[m.pos][lane];
      attention_sublayer(s, x, x_lane, s.w.layer[l].attn, history, k_head, v_head, m.pos);
    } else {
      attention_sublayer(s, shared_row(s.x), s.x[lane], s.w.layer[l].attn, history, k_head, v_head, m.pos);
    }
    wait_staged(s, 2 * l + 1);
    ffn_sublayer(s, s.w.layer[l].ffn);
    history = next;
  }

  // lm_head + sampling: thread t computes logit t.
  wait_staged(s, kStageCopies - 1);
  const int row_w = min(t, C::vocab_size - 1);
  Row32 x = shared_row(s.x);
  const float rstd = center_rstd(x);
  const float logit = fmaf(rstd, dot32(staged_row(s.w.head.w, row_w), x), s.w.head.c[row_w]);
  if (t < C::vocab_size) b.logits[t] = logit;
  const int token = argmax_block(sampling_key(m, t, logit, noise));
  if (t == 0) {
    advance_meta(b.advance, m, token);
    if (loop.header != nullptr) {
      // The sequence fills the context once this token is in it. When the loop stops, the steps
      // left in this run of the body see the header's `stopped` and do nothing.
      (void)loop.append(lh, token, m.seq_len + 1 >= C::block_size);
    } else {
      *static_cast<volatile std::int32_t*>(b.token_out) = token;  // host polls it
    }
  }
}

/// The StageImage of `w` (host side, once per Model): LayerNorms folded into the linear layer
/// after them (in double), matrices swizzled as decode_step_kernel reads them.
std::unique_ptr<StageImage> make_stage_image(const Weights& w) {
  auto img = std::make_unique<StageImage>();
  std::memset(img.get(), 0, sizeof(StageImage));
  const auto t = [&](const std::string& name) { return w.tensor(name); };
  // Rows of `m` ([rows][cols], cols = 4 * chunks) scaled by gamma (if any), swizzled; the per-row
  // constants sum_j m[r][j] * beta[j] + bias[r] into c (if any).
  const auto put = [](float4* dst, int chunks, std::span<const float> m, int rows, std::span<const float> gamma,
                      std::span<const float> beta, std::span<const float> bias, float* c) {
    const int cols = 4 * chunks;
    for (int r = 0; r < rows; ++r) {
      double acc = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(r)];
      float row[C::ffn_hidden];
      for (int j = 0; j < cols; ++j) {
        const float v = m[static_cast<std::size_t>(r * cols + j)];
        row[j] = gamma.empty() ? v : v * gamma[static_cast<std::size_t>(j)];
        if (!beta.empty()) acc += static_cast<double>(v) * beta[static_cast<std::size_t>(j)];
      }
      for (int q = 0; q < chunks; ++q)
        dst[r * chunks + (q ^ (r & 7))] = make_float4(row[4 * q], row[4 * q + 1], row[4 * q + 2], row[4 * q + 3]);
      if (c != nullptr) c[r] = static_cast<float>(acc);
    }
  };
  const std::span<const float> none;
  std::copy_n(t("token_embedding_table.weight").data(), C::vocab_size * C::n_embd, &img->tok_emb[0][0]);
  std::copy_n(t("position_embedding_table.weight").data(), C::block_size * C::n_embd, &img->pos_emb[0][0]);
  for (int l = 0; l < C::n_layer; ++l) {
    const auto n = [&](std::string_view leaf) { return t(fmt::format("blocks.{}.{}", l, leaf)); };
    AttnStage& a = img->layer[l].attn;
    put(&a.qkv[0][0], C::n_embd / 4, n("sa.qkv.weight"), 3 * C::n_embd, n("ln1.weight"), n("ln1.bias"), none, a.qkv_c);
    put(&a.proj[0][0], C::n_embd / 4, n("sa.attn_proj.weight"), C::n_embd, none, none, none, nullptr);
    std::copy_n(n("sa.attn_proj.bias").data(), C::n_embd, a.proj_b);
    FfnStage& f = img->layer[l].ffn;
    put(&f.fc1[0][0], C::n_embd / 4, n("ffwd.net.0.weight"), C::ffn_hidden, n("ln2.weight"), n("ln2.bias"),
        n("ffwd.net.0.bias"), f.fc1_c);
    put(&f.fc2[0][0], C::ffn_hidden / 4, n("ffwd.net.2.weight"), C::n_embd, none, none, none, nullptr);
    std::copy_n(n("ffwd.net.2.bias").data(), C::n_embd, f.fc2_b);
  }
  put(&img->head.w[0][0], C::n_embd / 4, t("lm_head.weight"), C::vocab_size, t("ln_f.weight"), t("ln_f.bias"),
      t("lm_head.bias"), img->head.c);
  return img;
}

// ============================================================================================
// Launchers: each takes the stream, launches one kernel and checks the launch.
// ============================================================================================

struct Launcher {
  const ModelParams& p;
  const Buffers& b;
  const StageImage* image;  // device copy of the decode step's shared-memory image
  const StepMeta* meta;     // device address of the step metadata
  ModelOptions opt;
  /// The device loop (capture_loop_graph): the sampler appends its token there instead of handing
  /// it to the host. Null otherwise.
  replay::token_loop_ref loop{};

  /// The first kernel of a step or prefill is launched without PDL: it starts only once everything
  /// before it on the stream has completed, in particular the previous step's sampler, whose writes
  /// of the next StepMeta (advance_meta) it and every later kernel of its step then see. (In a
  /// captured graph the first kernel has no programmatic edge either way.)
  static constexpr bool pdl_first = false;

  /// `rows` blocks of `threads` threads, on `s`, with PDL when `pdl`.
  static replay::launch_config config(cudaStream_t s, int rows, int threads, bool pdl, std::size_t shared_bytes = 0,
                                      std::source_location where = std::source_location::current()) {
    return {.grid = dim3(static_cast<unsigned>(rows)), .block = dim3(static_cast<unsigned>(threads)),
            .shared_bytes = shared_bytes, .stream = replay::stream_ref(s), .pdl = pdl, .where = where};
  }

  /// One decode step: one kernel, what eager mode launches and graph mode captures. `chained`: the
  /// step follows another step in the same graph (the device loop's body), so it is launched with
  /// PDL and stages its weights while the previous step runs.
  void decode_step(cudaStream_t s, bool chained = false) const {
    replay::launch(decode_step_kernel, config(s, 1, kThreads, chained ? opt.pdl : pdl_first, kStepSharedBytes),
                   image, meta, b, loop);
  }

  /// Prefill of `rows` prompt tokens (eager only): embedding, per layer {QKV, attention, FFN},
  /// lm_head + sampling; one block per prompt token.
  void prefill(cudaStream_t s, int rows) const {
    replay::launch(embed_prefill_kernel, config(s, rows, 32, pdl_first), p.tok_emb, p.pos_emb, meta, b);
    for (int l = 0; l < C::n_layer; ++l) {
      replay::launch(qkv_prefill_kernel, config(s, rows, kThreads, opt.pdl), p.layer[l], l, meta, b);
      replay::launch(attention_prefill_kernel, config(s, rows, kThreads, opt.pdl), p.layer[l], l, meta, b);
      replay::launch(ffn_prefill_kernel, config(s, rows, kThreads, opt.pdl), p.layer[l], meta, b);
    }
    replay::launch(lm_head_prefill_kernel, config(s, 1, kThreads, opt.pdl), p.lnf_w, p.lnf_b, p.head_w, p.head_b,
                   meta, b);
  }
};

}  // namespace


// ============================================================================================
// Model
// ============================================================================================

std::string require_device() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw no_device_error(fmt::format("no usable CUDA device ({}: {})", cudaGetErrorName(err),
                                      cudaGetErrorString(err)));
  }
  if (count == 0) throw no_device_error("no CUDA device found");
  cudaDeviceProp prop{};
  REPLAY_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.name;
}

struct Model::Impl {
  ModelOptions options;
  replay::stream stream;
  replay::device_buffer<float> params_mem;           // all parameters, packed (weights.hpp)
  ModelParams params{};
  replay::device_buffer<StageImage> stage_image;     // the decode step's weights (make_stage_image)
  replay::static_arena arena;                        // activations + KV cache, frozen
  Buffers buffers{};
  replay::step_meta<StepMeta> meta;                  // token, pos, seq_len, sampling
  replay::step_meta_array<std::int32_t> prompt;      // prompt token ids for prefill
  replay::pinned_buffer<std::int32_t> token_out;     // the sampler writes the token here
  replay::graph_exec exec;                           // the captured decode step
  std::size_t graph_nodes = 0;
  std::size_t graph_kernel_nodes = 0;
  replay::token_loop loop;                           // the device loop's token buffer (up to a context)
  replay::graph_exec loop_exec;                      // the captured device loop (capture_loop_graph)
  int loop_steps_per_iteration = 0;
  bool step_in_flight = false;    // a step was enqueued and its token not waited for
  // MetaPath::device and the device loop: the metadata of the step in flight, and what the device
  // holds after it (the sampler's prediction, known once its token has been read).
  StepMeta issued{};
  StepMeta predicted{};
  bool predicted_valid = false;
  std::size_t meta_writes = 0;    // Model::meta_writes()

  Impl(const Weights& w, ModelOptions opt)
      : options(opt),
        params_mem(w.data.size()),
        stage_image(1),
        arena(static_cast<std::size_t>(2 * C::block_size * C::n_embd + 2 * C::n_layer * kCacheLayer +
                                       C::vocab_size) * sizeof(float) +
              10 * replay::static_arena::default_alignment),
        prompt(C::block_size),
        token_out(1),
        loop(static_cast<std::size_t>(C::block_size)) {
    // The decode step keeps the model's weights in shared memory (decode_step_kernel).
    int device = 0, shared_optin = 0;
    REPLAY_CHECK(cudaGetDevice(&device));
    REPLAY_CHECK(cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (static_cast<std::size_t>(shared_optin) < kStepSharedBytes)
      throw no_device_error(fmt::format("the decode step needs {} bytes of shared memory per block; this device "
                                        "allows {} (an sm_90 GPU allows 232448)",
                                        kStepSharedBytes, shared_optin));
    REPLAY_CHECK(cudaFuncSetAttribute(decode_step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kStepSharedBytes)));
    if (w.data.size() != packed_size())
      throw std::invalid_argument(fmt::format("nanogpt::Model: weights hold {} floats, expected {}",
                                              w.data.size(), packed_size()));
    const replay::stream_ref s(stream.get());
    params_mem.copy_from_host(std::span<const float>(w.data), s);
    const auto at = [&](std::string_view name) { return params_mem.data() + spec(name).offset; };
    params.tok_emb = at("token_embedding_table.weight");
    params.pos_emb = at("position_embedding_table.weight");
    for (int l = 0; l < C::n_layer; ++l) {
      const auto n = [&](std::string_view leaf) { return at(fmt::format("blocks.{}.{}", l, leaf)); };
      params.layer[l] = {n("ln1.weight"), n("ln1.bias"),          n("sa.qkv.weight"),     n("sa.attn_proj.weight"),
                         n("sa.attn_proj.bias"), n("ln2.weight"), n("ln2.bias"),          n("ffwd.net.0.weight"),
                         n("ffwd.net.0.bias"),   n("ffwd.net.2.weight"), n("ffwd.net.2.bias")};
    }
    params.lnf_w = at("ln_f.weight");
    params.lnf_b = at("ln_f.bias");
    params.head_w = at("lm_head.weight");
    params.head_b = at("lm_head.bias");
    const std::unique_ptr<StageImage> image = make_stage_image(w);
    stage_image.copy_from_host(std::span<const StageImage>(image.get(), 1), s);

    buffers.x = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.q = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.k_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.v_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.logits = arena.allocate<float>(C::vocab_size).data();
    arena.freeze();  // from here on no address changes: safe to capture
    buffers.prompt = prompt.device();
    buffers.token_out = token_out.data();  // pinned host memory is device-accessible under UVA
    buffers.advance = options.meta == MetaPath::device ? meta.device() : nullptr;
    REPLAY_CHECK(cudaMemsetAsync(arena.base(), 0, arena.capacity(), stream.get()));
    token_out[0] = -1;
    stream.synchronize();
  }

  ~Impl() { (void)cudaStreamSynchronize(stream.get()); }

  [[nodiscard]] Launcher launcher() const { return {params, buffers, stage_image.data(), meta.device(), options}; }

  /// Waits for a step enqueued without reading its token (enqueue_decode_step).
  void settle() {
    if (!step_in_flight) return;
    REPLAY_CHECK(cudaStreamSynchronize(stream.get()));
    step_in_flight = false;
  }

  /// Makes `v` the metadata the next kernels read: staged and pushed (push, eager graph_copy, and
  /// the device-advanced paths unless the device already holds it) or staged for the graph's own
  /// copy (graph_copy, graph mode). `device_advances`: the work about to run writes the next
  /// step's metadata itself (MetaPath::device, the device loop), so the host may skip the push.
  void set_meta(const StepMeta& v, bool graph_copies_it, bool device_advances) {
    // Pushed (below) unless the device already holds it: the previous step's sampler wrote it and
    // its token was read, so the write is complete. A push is stream-ordered after that step.
    const bool held = device_advances && predicted_valid && std::memcmp(&predicted, &v, sizeof v) == 0;
    predicted_valid = false;
    issued = v;
    if (held) return;
    ++meta_writes;
    if (graph_copies_it) {
      meta.graph_staging() = v;
    } else {
      meta.staging() = v;
      meta.push(replay::stream_ref(stream.get()));
    }
  }

  /// Issues one decode step: the metadata (set_meta), then the kernels (eager) or the replay
  /// (graph). The token slot is poisoned first, so a step that did not run cannot hand back a
  /// stale token.
  void issue_step(const StepMeta& v, Mode mode) {
    const replay::stream_ref s(stream.get());
    if (mode == Mode::graph && !exec)
      throw replay::usage_error("nanogpt::Model: Mode::graph before capture_decode_graph()");
    token_out[0] = -1;
    const bool advances = options.meta == MetaPath::device;
    if (mode == Mode::graph) {
      const bool in_graph = options.meta == MetaPath::graph_copy;
      set_meta(v, in_graph, advances);
      exec.launch(s);
    } else {
      set_meta(v, false, advances);
      launcher().decode_step(stream.get());
    }
    step_in_flight = true;
  }

  /// Waits for the token the sampler writes into pinned host memory. Polling that memory is the
  /// cheapest wake-up; if the token takes unusually long (a slow tool such as compute-sanitizer, or
  /// a failed kernel) the stream is synchronised, which also reports any CUDA error.
  std::int32_t wait_token() {
    const volatile std::int32_t* slot = token_out.data();
    for (int i = 0; i < (1 << 22); ++i) {
      const std::int32_t t = *slot;
      if (t >= 0 && t < C::vocab_size) return arrived(t);
    }
    REPLAY_CHECK(cudaStreamSynchronize(stream.get()));
    const std::int32_t t = *slot;
    if (t < 0 || t >= C::vocab_size)
      throw std::runtime_error(fmt::format("nanogpt: the step produced no valid token ({})", t));
    return arrived(t);
  }

  /// The token of the step in flight arrived: every kernel of the step has read the metadata by
  /// now, and (MetaPath::device) the device holds the next step's metadata.
  std::int32_t arrived(std::int32_t t) {
    step_in_flight = false;
    if (options.meta == MetaPath::device) {
      predicted = issued;
      predicted.token = t;
      predicted.pos = issued.seq_len;
      predicted.seq_len = issued.seq_len + 1;
      predicted_valid = true;
    }
    return t;
  }

  /// One launch of the device loop starting from `v`: at most `max_steps` decode steps, fewer when
  /// the stop token comes or the context fills. Appends the tokens to `out`. The metadata is
  /// pushed only when the device does not already hold it (the previous launch left it there).
  LoopLaunch run_loop(const StepMeta& v, int max_steps, std::int32_t stop_token, std::vector<std::int32_t>& out) {
    if (!loop_exec) throw replay::usage_error("nanogpt::Model: decode_loop() before capture_loop_graph()");
    settle();
    const replay::stream_ref s(stream.get());
    set_meta(v, false, /*device_advances=*/true);
    loop.arm(s, max_steps, stop_token);
    loop_exec.launch(s);
    const replay::loop_result r = loop.wait(s);  // polls the count, the stop reason and the tokens
    if (r.tokens.empty()) throw std::runtime_error("nanogpt: the device loop produced no token");
    out.insert(out.end(), r.tokens.begin(), r.tokens.end());
    const int n = static_cast<int>(r.tokens.size());
    predicted = v;  // what the last step's sampler wrote
    predicted.token = r.tokens.back();
    predicted.pos = v.seq_len + n - 1;
    predicted.seq_len = v.seq_len + n;
    predicted_valid = true;
    return {n, r.stop == replay::loop_stop::stop_token};
  }
};

static StepMeta make_meta(std::int32_t token, int pos, int seq_len, const Sampling& s) {
  StepMeta m;
  m.token = token;
  m.pos = pos;
  m.seq_len = seq_len;
  m.greedy = s.greedy ? 1 : 0;
  m.temperature = s.temperature;
  m.seed = s.seed;
  return m;
}

static void check_sampling(const Sampling& s) {
  if (!s.greedy && !(s.temperature > 0.0f && std::isfinite(s.temperature)))
    throw std::invalid_argument(fmt::format("temperature must be a positive number (got {}); use greedy "
                                            "decoding for temperature 0",
                                            s.temperature));
}

Model::Model(const Weights& weights, ModelOptions options) {
  (void)require_device();
  impl_ = std::make_unique<Impl>(weights, options);
}
Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

std::int32_t Model::prefill(std::span<const std::int32_t> prompt, const Sampling& sampling) {
  if (prompt.empty() || prompt.size() > static_cast<std::size_t>(C::block_size))
    throw std::invalid_argument(fmt::format("prefill: the prompt has {} tokens; it needs 1 to {}", prompt.size(),
                                            C::block_size));
  for (auto t : prompt)
    if (t < 0 || t >= C::vocab_size)
      throw std::invalid_argument(fmt::format("prefill: token id {} outside [0, {})", t, C::vocab_size));
  check_sampling(sampling);
  Impl& m = *impl_;
  m.settle();
  const replay::stream_ref s(m.stream.get());
  auto staged = m.prompt.staging();
  std::copy(prompt.begin(), prompt.end(), staged.begin());
  m.prompt.push(s, prompt.size());
  const int rows = static_cast<int>(prompt.size());
  m.token_out[0] = -1;
  m.set_meta(make_meta(0, 0, rows, sampling), false, false);
  m.launcher().prefill(s.get(), rows);
  return m.wait_token();
}

std::int32_t Model::decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode) {
  if (token < 0 || token >= C::vocab_size)
    throw std::invalid_argument(fmt::format("decode_step: token id {} outside [0, {})", token, C::vocab_size));
  if (pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(
        fmt::format("decode_step: position {} outside the context [0, {})", pos, C::block_size));
  check_sampling(sampling);
  impl_->settle();  // a step enqueued before must not hand its token to this one
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
  return impl_->wait_token();
}

void Model::enqueue_decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode) {
  if (token < 0 || token >= C::vocab_size || pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(fmt::format("enqueue_decode_step: token {} or position {} out of range", token, pos));
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
}

void Model::synchronize() {
  REPLAY_CHECK(cudaStreamSynchronize(impl_->stream.get()));
  impl_->step_in_flight = false;
}

void Model::record_decode_step(cudaStream_t s) {
  Impl& m = *impl_;
  if (m.options.meta == MetaPath::graph_copy) m.meta.capture_copy(replay::stream_ref(s));  // every replay starts by copying StepMeta
  m.launcher().decode_step(s);
}

void Model::capture_decode_graph() {
  Impl& m = *impl_;
  const replay::stream_ref s(m.stream.get());
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { record_decode_step(cs.get()); });
  m.graph_nodes = g.node_count();
  m.graph_kernel_nodes = g.kernel_node_count();
  m.exec = g.instantiate({.upload_stream = s.get()});
  s.synchronize();
}

void Model::capture_loop_graph(int steps_per_iteration) {
  if (steps_per_iteration < 1 || steps_per_iteration > C::block_size)
    throw std::invalid_argument(fmt::format("capture_loop_graph: {} steps per iteration (1 to {})",
                                            steps_per_iteration, C::block_size));
  Impl& m = *impl_;
  Buffers b = m.buffers;
  b.advance = m.meta.device();  // every step of the loop writes the next step's metadata
  const replay::stream_ref s(m.stream.get());
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    m.loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      const Launcher l{m.params, b, m.stage_image.data(), m.meta.device(), m.options, ref};
      // Several steps per run of the body, each chained to the previous one by PDL (it stages its
      // weights while the previous step runs, then waits for it): the handoff between two steps is
      // then one kernel handoff, not the end of a run of the body and the start of the next.
      for (int i = 0; i < steps_per_iteration; ++i) l.decode_step(body.get(), /*chained=*/i > 0);
    });
  });
  m.loop_steps_per_iteration = steps_per_iteration;
  m.loop_exec = g.instantiate({.upload_stream = s.get()});
  s.synchronize();
}

LoopLaunch Model::decode_loop(std::int32_t token, int pos, const Sampling& sampling, int max_steps,
                              std::int32_t stop_token, std::vector<std::int32_t>& out) {
  if (token < 0 || token >= C::vocab_size)
    throw std::invalid_argument(fmt::format("decode_loop: token id {} outside [0, {})", token, C::vocab_size));
  if (pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(
        fmt::format("decode_loop: position {} outside the context [0, {})", pos, C::block_size));
  if (max_steps < 1 || pos + max_steps > C::block_size)
    throw std::invalid_argument(fmt::format("decode_loop: {} steps from position {} pass the context of {}",
                                            max_steps, pos, C::block_size));
  check_sampling(sampling);
  return impl_->run_loop(make_meta(token, pos, pos + 1, sampling), max_steps, stop_token, out);
}

bool Model::has_loop_graph() const noexcept { return static_cast<bool>(impl_->loop_exec); }
int Model::loop_steps_per_iteration() const noexcept { return impl_->loop_steps_per_iteration; }

bool Model::has_graph() const noexcept { return static_cast<bool>(impl_->exec); }
std::size_t Model::graph_nodes() const noexcept { return impl_->graph_nodes; }
std::size_t Model::graph_kernel_nodes() const noexcept { return impl_->graph_kernel_nodes; }
const ModelOptions& Model::options() const noexcept { return impl_->options; }
std::size_t Model::meta_writes() const noexcept { return impl_->meta_writes; }

cudaStream_t Model::stream() const noexcept { return impl_->stream.get(); }

std::vector<float> Model::logits() const {
  std::vector<float> out(C::vocab_size);
  REPLAY_CHECK(cudaMemcpyAsync(out.data(), impl_->buffers.logits, out.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, impl_->stream.get()));
  REPLAY_CHECK(cudaStreamSynchronize(impl_->stream.get()));
  return out;
}

void check_lengths(std::size_t prompt_len, long long n_tokens) {
  if (prompt_len == 0) throw std::invalid_argument("the prompt is empty; give at least one character");
  if (prompt_len > static_cast<std::size_t>(C::block_size))
    throw std::invalid_argument(fmt::format("the prompt has {} tokens but the context holds only {}",
                                            prompt_len, C::block_size));
  if (n_tokens < 1) throw std::invalid_argument(fmt::format("--tokens must be at least 1 (got {})", n_tokens));
  if (static_cast<long long>(prompt_len) + n_tokens > C::block_size)
    throw std::invalid_argument(fmt::format(
        "the prompt ({} tokens) plus {} new tokens is {}, past the context of {}; at most {} new tokens fit "
        "after this prompt",
        prompt_len, n_tokens, static_cast<long long>(prompt_len) + n_tokens, C::block_size,
        C::block_size - static_cast<long long>(prompt_len)));
}

GenerateResult generate(Model& model, std::span<const std::int32_t> prompt, int n_tokens, Mode mode,
                        const Sampling& sampling, bool fresh_capture, std::int32_t stop_token) {
  check_lengths(prompt.size(), n_tokens);
  GenerateResult r;
  r.tokens.reserve(static_cast<std::size_t>(n_tokens));
  r.step_us.reserve(static_cast<std::size_t>(n_tokens));
  replay_examples::stopwatch total;
  replay_examples::stopwatch sw;
  std::int32_t token = model.prefill(prompt, sampling);
  r.prefill_us = sw.elapsed_us();
  r.tokens.push_back(token);
  if (mode == Mode::graph && (fresh_capture || !model.has_graph())) {
    sw.restart();
    model.capture_decode_graph();
    r.capture_us = sw.elapsed_us();
  }
  replay_examples::stopwatch decode;
  int pos = static_cast<int>(prompt.size());
  for (int i = 1; i < n_tokens && token != stop_token; ++i, ++pos) {
    sw.restart();
    token = model.decode_step(token, pos, sampling, mode);
    r.step_us.push_back(sw.elapsed_us());
    r.tokens.push_back(token);
  }
  r.stopped = token == stop_token;
  r.decode_us = decode.elapsed_us();
  r.total_us = total.elapsed_us();
  return r;
}

GenerateResult generate_looped(Model& model, std::span<const std::int32_t> prompt, int n_tokens,
                               int tokens_per_launch, const Sampling& sampling, bool fresh_capture,
                               std::int32_t stop_token) {
  check_lengths(prompt.size(), n_tokens);
  if (tokens_per_launch < 1 || tokens_per_launch > C::block_size)
    throw std::invalid_argument(fmt::format("--tokens-per-launch must be 1 to {} (got {})", C::block_size,
                                            tokens_per_launch));
  GenerateResult r;
  r.tokens.reserve(static_cast<std::size_t>(n_tokens));
  replay_examples::stopwatch total;
  replay_examples::stopwatch sw;
  std::int32_t token = model.prefill(prompt, sampling);
  r.prefill_us = sw.elapsed_us();
  r.tokens.push_back(token);
  if (fresh_capture || !model.has_loop_graph()) {
    sw.restart();
    model.capture_loop_graph(std::min(tokens_per_launch, Model::default_loop_steps_per_iteration));
    r.capture_us = sw.elapsed_us();
  }
  replay_examples::stopwatch decode;
  int pos = static_cast<int>(prompt.size());
  int remaining = n_tokens - 1;
  bool stopped = token == stop_token;
  while (remaining > 0 && !stopped) {
    sw.restart();
    const LoopLaunch l =
        model.decode_loop(token, pos, sampling, std::min(tokens_per_launch, remaining), stop_token, r.tokens);
    r.launch_us.push_back(sw.elapsed_us());
    pos += l.steps;
    remaining -= l.steps;
    token = r.tokens.back();
    stopped = l.stopped;
  }
  r.stopped = stopped;
  r.decode_us = decode.elapsed_us();
  r.total_us = total.elapsed_us();
  return r;
}

}  // namespace nanogpt
