// nanogpt/model.cu: the decoder's kernels, their launchers, and the Model (see model.hpp).
//
// Layout of a step (decode, one token, B = 1):
//
//   embed_kernel            x = tok_emb[token] + pos_emb[pos]                      (token, pos: StepMeta)
//   for each of 4 layers:
//     attention_block_kernel  x += attn_proj(Attention(LN1(x)))   QKV, KV-cache write at slot pos,
//                                                                  attention over slots 0..pos
//     ffn_block_kernel        x += fc2(ReLU(fc1(LN2(x))))
//   lm_head_sample_kernel   logits = lm_head(LN_f(x)); token = sample(logits)    → pinned host slot
//
// Every kernel is one thread block of 128 threads (4 warps). The residual stream is 32 wide, so one
// row of it is one element per lane of a warp: a LayerNorm is two warp reductions, a matrix-vector
// product is one output row per thread with the input broadcast by warp shuffles. Each kernel is
// one transformer sublayer; the fusion inside a sublayer (LN + matvec + residual) is what keeps a
// step at 10 kernels instead of the ~50 of the seed's PyTorch code.
//
// Per-step values (token, position, sequence length, sampling settings) are read from StepMeta
// through a pointer, never passed by value: a graph captured once replays correctly at any
// position. Prefill uses the same device functions over a grid of one block per prompt token.
#include "model.hpp"

#include "common/rng.hpp"
#include "common/timing.hpp"

#include <replay/replay.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
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
};

constexpr int kThreads = 128;  // 4 warps per block
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == C::n_head, "attention maps one warp to one head");
static_assert(C::ffn_hidden == kThreads, "fc1 maps one hidden unit to one thread");
static_assert(C::vocab_size <= kThreads && 3 * C::n_embd <= kThreads);
constexpr int kCacheLayer = C::n_head * C::block_size * C::head_size;  // floats per layer per K/V

/// Which rows a kernel works on: one token (decode, row 0) or the prompt (prefill, one block each).
enum class Phase { decode, prefill };

// ============================================================================================
// Device building blocks
// ============================================================================================

/// Programmatic dependent launch: let the next kernel in the stream start (it runs its prologue and
/// then waits in pdl_wait). A no-op for kernels launched without the PDL attribute.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/// Wait until the previous kernel in the stream has finished and its writes are visible. Everything
/// before this call may only read constants (weights).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// 32 consecutive weights (one row of a [*, 32] matrix, or a 32-wide slice) in registers.
struct Row32 {
  float4 v[8];
};
__device__ __forceinline__ Row32 load_row32(const float* w) {
  const float4* p = reinterpret_cast<const float4*>(w);
  Row32 r;
#pragma unroll
  for (int i = 0; i < 8; ++i) r.v[i] = __ldg(p + i);
  return r;
}

/// dot(row, v) where v[j] is held by lane j of this warp. All 32 lanes must call it.
__device__ __forceinline__ float dot_lanes(const Row32& r, float v) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    acc = fmaf(r.v[i].x, __shfl_sync(0xffffffffu, v, 4 * i + 0), acc);
    acc = fmaf(r.v[i].y, __shfl_sync(0xffffffffu, v, 4 * i + 1), acc);
    acc = fmaf(r.v[i].z, __shfl_sync(0xffffffffu, v, 4 * i + 2), acc);
    acc = fmaf(r.v[i].w, __shfl_sync(0xffffffffu, v, 4 * i + 3), acc);
  }
  return acc;
}

/// LayerNorm of a 32-wide row held one element per lane (PyTorch semantics: biased variance, eps
/// inside the square root). Returns this lane's normalised, scaled and shifted element.
__device__ __forceinline__ float layer_norm_lane(float x, float gamma, float beta) {
  const float mean = warp_sum(x) * (1.0f / C::n_embd);
  const float d = x - mean;
  const float var = warp_sum(d * d) * (1.0f / C::n_embd);
  return d * rsqrtf(var + C::ln_eps) * gamma + beta;
}

/// The weights one thread needs for the QKV projection, loaded before waiting on the previous kernel.
struct QkvPrefetch {
  Row32 w;      // row min(tid, 95) of qkv_w
  float gamma;  // ln1_w[lane]
  float beta;   // ln1_b[lane]
};
__device__ __forceinline__ QkvPrefetch prefetch_qkv(const LayerParams& p) {
  const int row = min(static_cast<int>(threadIdx.x), 3 * C::n_embd - 1);
  return {load_row32(p.qkv_w + row * C::n_embd), __ldg(p.ln1_w + lane_id()), __ldg(p.ln1_b + lane_id())};
}

/// QKV sublayer part for one token: q = LN1(x) Wq^T goes to q_out[32]; k and v go into the cache
/// slot `pos` of every head (and, when kv_out is given, to kv_out[0..63] = k then v, for the
/// decode kernel's own use). Called by all 128 threads; warps 0-2 each produce 32 of the 96 outputs.
__device__ __forceinline__ void qkv_phase(const QkvPrefetch& w, const float* x_row, int pos, float* q_out,
                                          float* k_layer, float* v_layer, float* kv_out) {
  const float xn = layer_norm_lane(x_row[lane_id()], w.gamma, w.beta);
  const float out = dot_lanes(w.w, xn);
  const int r = static_cast<int>(threadIdx.x);
  if (r < C::n_embd) {
    q_out[r] = out;
  } else if (r < 3 * C::n_embd) {
    const int c = (r - C::n_embd) % C::n_embd;  // column within k or v
    const int head = c / C::head_size;
    float* cache = r < 2 * C::n_embd ? k_layer : v_layer;
    cache[(head * C::block_size + pos) * C::head_size + c % C::head_size] = out;
    if (kv_out != nullptr) kv_out[r - C::n_embd] = out;
  }
}

/// The keys and values one lane scores: cache slots `lane` and `lane + 32` of one head.
struct KvRows {
  float4 k[2][2];  // [slot i][half]: slot lane + 32 i, elements 0-3 and 4-7
  float4 v[2][2];
};

/// Loads the slots 0..last of one head's cache (others zero). `last` may be -1 (nothing).
__device__ __forceinline__ KvRows load_kv_rows(const float* k_head, const float* v_head, int last) {
  KvRows r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int j = lane_id() + 32 * i;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    r.k[i][0] = r.k[i][1] = r.v[i][0] = r.v[i][1] = zero;
    if (j <= last) {
      const float4* k4 = reinterpret_cast<const float4*>(k_head + j * C::head_size);
      const float4* v4 = reinterpret_cast<const float4*>(v_head + j * C::head_size);
      r.k[i][0] = k4[0];
      r.k[i][1] = k4[1];
      r.v[i][0] = v4[0];
      r.v[i][1] = v4[1];
    }
  }
  return r;
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

/// Causal attention of one head for one query at position `pos`, over cache slots 0..pos (the
/// slots after pos are masked out, exactly like the seed's `kv_indices <= cache_pos`). `kv` holds
/// the slots this lane scores. Called by one whole warp; lane d < 8 gets output element d.
__device__ __forceinline__ float attend_head(const float* q, const KvRows& kv, int pos) {
  const int lane = lane_id();
  const float4* q4 = reinterpret_cast<const float4*>(q);
  const float4 qa = q4[0], qb = q4[1];
  constexpr float scale = 0.35355339059327373f;  // head_size ** -0.5
  float score[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    score[i] = lane + 32 * i <= pos ? dot8(qa, qb, kv.k[i][0], kv.k[i][1]) * scale : -INFINITY;
  // Softmax over the valid slots (slot 0 is always valid, so the max is finite).
  const float m = warp_max(fmaxf(score[0], score[1]));
  const float p0 = expf(score[0] - m);  // exp(-inf) = 0 for masked slots
  const float p1 = expf(score[1] - m);
  const float inv_sum = 1.0f / warp_sum(p0 + p1);
  const float v0[8] = {kv.v[0][0].x, kv.v[0][0].y, kv.v[0][0].z, kv.v[0][0].w,
                       kv.v[0][1].x, kv.v[0][1].y, kv.v[0][1].z, kv.v[0][1].w};
  const float v1[8] = {kv.v[1][0].x, kv.v[1][0].y, kv.v[1][0].z, kv.v[1][0].w,
                       kv.v[1][1].x, kv.v[1][1].y, kv.v[1][1].z, kv.v[1][1].w};
  float out = 0.0f;
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    const float acc = warp_sum(fmaf(p0, v0[d], p1 * v1[d]));
    if (lane == d) out = acc * inv_sum;
  }
  return out;
}

/// The weights the attention output projection needs (warp 0 uses them).
struct ProjPrefetch {
  Row32 w;     // row `lane` of proj_w
  float bias;  // proj_b[lane]
};
__device__ __forceinline__ ProjPrefetch prefetch_proj(const LayerParams& p) {
  return {load_row32(p.proj_w + lane_id() * C::n_embd), __ldg(p.proj_b + lane_id())};
}

/// Attention sublayer part for one token: all heads (warp h = head h, `kv` = its slots) attend
/// over slots 0..pos, then x_row += attn_proj(heads). q is the token's 32-wide query.
/// Called by all 128 threads.
__device__ __forceinline__ void attention_phase(const ProjPrefetch& w, const float* q, int pos, const KvRows& kv,
                                                float* x_row) {
  __shared__ float heads[C::n_embd];  // concatenated head outputs
  const int h = warp_id();
  const float o = attend_head(q + h * C::head_size, kv, pos);
  if (lane_id() < C::head_size) heads[h * C::head_size + lane_id()] = o;
  __syncthreads();
  if (h == 0) {
    const float y = dot_lanes(w.w, heads[lane_id()]) + w.bias;
    x_row[lane_id()] += y;  // residual
  }
}

/// First kernel of a step: x[row] = tok_emb[token] + pos_emb[pos]. One warp per row.
template <Phase P>
__global__ void __launch_bounds__(32) embed_kernel(const float* tok_emb, const float* pos_emb,
                                                   const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  // The metadata and the prompt were copied before this step's first kernel started, and the
  // embeddings are constants: all can be read before waiting for the previous kernel.
  const int row = P == Phase::decode ? 0 : static_cast<int>(blockIdx.x);
  const bool active = row < (P == Phase::decode ? 1 : meta->seq_len);
  const int token = !active ? 0 : P == Phase::decode ? meta->token : b.prompt[row];
  const int pos = !active ? 0 : meta->pos + row;
  const int i = lane_id();
  const float e = __ldg(tok_emb + token * C::n_embd + i) + __ldg(pos_emb + pos * C::n_embd + i);
  pdl_wait();
  if (active) b.x[row * C::n_embd + i] = e;
}

/// Decode: the whole attention sublayer for the step's token in one block:
/// LN1 → QKV → write k, v into cache slot pos → attention over slots 0..pos → projection + residual.
/// Before waiting for the previous kernel it loads its weights, the step metadata and the cache
/// slots 0..pos-1 (written by earlier steps, so already complete): after the wait only the residual
/// stream row is read.
__global__ void __launch_bounds__(kThreads) attention_block_kernel(LayerParams p, int layer,
                                                                   const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  const QkvPrefetch wq = prefetch_qkv(p);
  const ProjPrefetch wp = prefetch_proj(p);
  const int pos = meta->pos;
  const int h = warp_id();
  float* k_layer = b.k_cache + layer * kCacheLayer;
  float* v_layer = b.v_cache + layer * kCacheLayer;
  const int head_off = h * C::block_size * C::head_size;
  KvRows kv = load_kv_rows(k_layer + head_off, v_layer + head_off, pos - 1);
  pdl_wait();
  __shared__ __align__(16) float q[C::n_embd];
  __shared__ __align__(16) float kv_new[2 * C::n_embd];  // this token's k (0-31) and v (32-63)
  qkv_phase(wq, b.x, pos, q, k_layer, v_layer, kv_new);
  __syncthreads();  // q, and this token's k and v, in shared memory
  // The lane that scores slot pos takes this token's key and value from shared memory.
  if (lane_id() == pos % 32) {
    const float4* k4 = reinterpret_cast<const float4*>(kv_new + h * C::head_size);
    const float4* v4 = reinterpret_cast<const float4*>(kv_new + C::n_embd + h * C::head_size);
    if (pos < 32) {
      kv.k[0][0] = k4[0], kv.k[0][1] = k4[1], kv.v[0][0] = v4[0], kv.v[0][1] = v4[1];
    } else {
      kv.k[1][0] = k4[0], kv.k[1][1] = k4[1], kv.v[1][0] = v4[0], kv.v[1][1] = v4[1];
    }
  }
  attention_phase(wp, q, pos, kv, b.x);
}

/// Prefill, part 1 of the attention sublayer: one block per prompt token writes its q and its k, v
/// (every token's k, v must be in the cache before any token attends).
__global__ void __launch_bounds__(kThreads) qkv_prefill_kernel(LayerParams p, int layer,
                                                               const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  const QkvPrefetch wq = prefetch_qkv(p);
  pdl_wait();
  const int row = static_cast<int>(blockIdx.x);
  if (row >= meta->seq_len) return;
  qkv_phase(wq, b.x + row * C::n_embd, meta->pos + row, b.q + row * C::n_embd,
            b.k_cache + layer * kCacheLayer, b.v_cache + layer * kCacheLayer, nullptr);
}

/// Prefill, part 2: one block per prompt token attends over slots 0..its position (causal),
/// then projection + residual.
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(LayerParams p, int layer,
                                                                     const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  const ProjPrefetch wp = prefetch_proj(p);
  pdl_wait();
  const int row = static_cast<int>(blockIdx.x);
  if (row >= meta->seq_len) return;
  const int pos = meta->pos + row;
  const int head_off = warp_id() * C::block_size * C::head_size;
  const KvRows kv = load_kv_rows(b.k_cache + layer * kCacheLayer + head_off,
                                 b.v_cache + layer * kCacheLayer + head_off, pos);
  attention_phase(wp, b.q + row * C::n_embd, pos, kv, b.x + row * C::n_embd);
}

/// The feed-forward sublayer: x[row] += fc2(ReLU(fc1(LN2(x[row])))).
/// Thread t computes hidden unit t; warp w then holds hidden units 32w..32w+31, exactly the slice
/// of fc2's input it multiplies, so fc2 is four per-warp partial dot products summed in shared memory.
template <Phase P>
__global__ void __launch_bounds__(kThreads) ffn_block_kernel(LayerParams p, const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  const int lane = lane_id(), warp = warp_id();
  const Row32 w1 = load_row32(p.fc1_w + threadIdx.x * C::n_embd);
  const float b1 = __ldg(p.fc1_b + threadIdx.x);
  const Row32 w2 = load_row32(p.fc2_w + lane * C::ffn_hidden + warp * 32);
  const float b2 = __ldg(p.fc2_b + lane);
  const float gamma = __ldg(p.ln2_w + lane), beta = __ldg(p.ln2_b + lane);
  const int row = P == Phase::decode ? 0 : static_cast<int>(blockIdx.x);
  const bool active = row < (P == Phase::decode ? 1 : meta->seq_len);
  pdl_wait();
  if (!active) return;
  float* x_row = b.x + row * C::n_embd;
  const float x = x_row[lane];
  const float xn = layer_norm_lane(x, gamma, beta);
  const float hidden = fmaxf(dot_lanes(w1, xn) + b1, 0.0f);  // ReLU
  __shared__ float partial[kWarps][C::n_embd];
  partial[warp][lane] = dot_lanes(w2, hidden);
  __syncthreads();
  if (warp == 0) {
    float y = partial[0][lane];
#pragma unroll
    for (int i = 1; i < kWarps; ++i) y += partial[i][lane];
    x_row[lane] = x + (y + b2);  // residual
  }
}

/// Samples a token from 65 logits in shared memory; called by one whole warp, every lane returns it.
/// Greedy (or temperature <= 0): argmax, lowest index on ties. Otherwise softmax(logits / T) and an
/// inverse-CDF draw with u = uniform01(seed, seq_len): lane l owns tokens 2l and 2l+1 (lane 31 also
/// token 64), an inclusive warp scan gives each lane its CDF interval, the lane whose interval holds
/// u picks within its tokens. Deterministic: the same inputs give the same token on every run.
__device__ int sample_warp(const float* logits, const StepMeta& m) {
  const int lane = lane_id();
  const float a = logits[2 * lane], c = logits[2 * lane + 1];
  const float e = lane == 31 ? logits[C::vocab_size - 1] : -INFINITY;
  if (m.greedy != 0 || !(m.temperature > 0.0f)) {
    float best = a;
    int idx = 2 * lane;
    if (c > best) best = c, idx = 2 * lane + 1;
    if (e > best) best = e, idx = C::vocab_size - 1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
    }
    return idx;
  }
  const float inv_t = 1.0f / m.temperature;
  const float mx = warp_max(fmaxf(fmaxf(a, c), e));
  const float pa = expf((a - mx) * inv_t);
  const float pc = expf((c - mx) * inv_t);
  const float pe = lane == 31 ? expf((e - mx) * inv_t) : 0.0f;
  float incl = pa + pc + pe;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  float excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.0f;
  const float total = __shfl_sync(0xffffffffu, incl, 31);
  const float u = replay_examples::uniform01(m.seed, static_cast<std::uint64_t>(m.seq_len)) * total;
  const unsigned hit = __ballot_sync(0xffffffffu, u >= excl && u < incl);
  // u == total can only happen by rounding: fall back to the last lane with probability mass.
  const int owner = hit != 0 ? __ffs(hit) - 1 : 31 - __clz(__ballot_sync(0xffffffffu, incl > excl));
  int idx;  // meaningful in the owner lane: which of its tokens holds u
  if (u < excl + pa) idx = 2 * lane;
  else if (lane != 31 || u < excl + pa + pc) idx = 2 * lane + 1;
  else idx = C::vocab_size - 1;
  return __shfl_sync(0xffffffffu, idx, owner);
}

/// Last kernel of a step: logits = lm_head(LN_f(x[last row])), then sampling; the token goes
/// straight to pinned host memory (no copy node), the logits to b.logits.
template <Phase P>
__global__ void __launch_bounds__(kThreads) lm_head_sample_kernel(const float* lnf_w, const float* lnf_b,
                                                                  const float* head_w, const float* head_b,
                                                                  const StepMeta* meta, Buffers b) {
  pdl_launch_dependents();
  const int lane = lane_id();
  const int t = static_cast<int>(threadIdx.x);
  const int row_w = min(t, C::vocab_size - 1);
  const Row32 w = load_row32(head_w + row_w * C::n_embd);
  const float bias = __ldg(head_b + row_w);
  const float gamma = __ldg(lnf_w + lane), beta = __ldg(lnf_b + lane);
  const StepMeta m = *meta;
  pdl_wait();
  const int row = P == Phase::decode ? 0 : m.seq_len - 1;
  const float xn = layer_norm_lane(b.x[row * C::n_embd + lane], gamma, beta);
  const float logit = dot_lanes(w, xn) + bias;
  __shared__ float logits[C::vocab_size];
  if (t < C::vocab_size) {
    logits[t] = logit;
    b.logits[t] = logit;
  }
  __syncthreads();
  if (warp_id() == 0) {
    const int token = sample_warp(logits, m);
    if (lane == 0) *static_cast<volatile std::int32_t*>(b.token_out) = token;  // host polls it
  }
}

// ============================================================================================
// Launchers: each takes the stream, launches one kernel and checks the launch.
// ============================================================================================

/// Launches `kernel` with the PDL attribute when `pdl` is set (otherwise a plain launch).
template <class... Params, class... Args>
void launch(const char* name, bool pdl, void (*kernel)(Params...), int grid, int block, cudaStream_t s,
            Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(block));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cfg.attrs = pdl ? attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  REPLAY_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "kernel {}", name);
}

struct Launcher {
  const ModelParams& p;
  const Buffers& b;
  const StepMeta* meta;  // device address of the step metadata
  bool pdl;

  void embed(cudaStream_t s, Phase phase, int rows) const {
    if (phase == Phase::decode)
      launch("embed_kernel<decode>", pdl, embed_kernel<Phase::decode>, 1, 32, s, p.tok_emb, p.pos_emb, meta, b);
    else
      launch("embed_kernel<prefill>", pdl, embed_kernel<Phase::prefill>, rows, 32, s, p.tok_emb, p.pos_emb, meta, b);
  }
  void attention_block(cudaStream_t s, int layer) const {
    launch("attention_block_kernel", pdl, attention_block_kernel, 1, kThreads, s, p.layer[layer], layer, meta, b);
  }
  void qkv_prefill(cudaStream_t s, int layer, int rows) const {
    launch("qkv_prefill_kernel", pdl, qkv_prefill_kernel, rows, kThreads, s, p.layer[layer], layer, meta, b);
  }
  void attention_prefill(cudaStream_t s, int layer, int rows) const {
    launch("attention_prefill_kernel", pdl, attention_prefill_kernel, rows, kThreads, s, p.layer[layer], layer,
           meta, b);
  }
  void ffn_block(cudaStream_t s, int layer, Phase phase, int rows) const {
    if (phase == Phase::decode)
      launch("ffn_block_kernel<decode>", pdl, ffn_block_kernel<Phase::decode>, 1, kThreads, s, p.layer[layer], meta, b);
    else
      launch("ffn_block_kernel<prefill>", pdl, ffn_block_kernel<Phase::prefill>, rows, kThreads, s, p.layer[layer],
             meta, b);
  }
  void lm_head_sample(cudaStream_t s, Phase phase) const {
    if (phase == Phase::decode)
      launch("lm_head_sample_kernel<decode>", pdl, lm_head_sample_kernel<Phase::decode>, 1, kThreads, s, p.lnf_w,
             p.lnf_b, p.head_w, p.head_b, meta, b);
    else
      launch("lm_head_sample_kernel<prefill>", pdl, lm_head_sample_kernel<Phase::prefill>, 1, kThreads, s, p.lnf_w,
             p.lnf_b, p.head_w, p.head_b, meta, b);
  }

  /// One decode step: the sequence of launches that eager mode issues and graph mode captures.
  void decode_step(cudaStream_t s) const {
    embed(s, Phase::decode, 1);
    for (int l = 0; l < C::n_layer; ++l) {
      attention_block(s, l);
      ffn_block(s, l, Phase::decode, 1);
    }
    lm_head_sample(s, Phase::decode);
  }

  /// Prefill of `rows` prompt tokens (eager only).
  void prefill(cudaStream_t s, int rows) const {
    embed(s, Phase::prefill, rows);
    for (int l = 0; l < C::n_layer; ++l) {
      qkv_prefill(s, l, rows);
      attention_prefill(s, l, rows);
      ffn_block(s, l, Phase::prefill, rows);
    }
    lm_head_sample(s, Phase::prefill);
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
  replay::static_arena arena;                        // activations + KV cache, frozen
  Buffers buffers{};
  replay::step_meta<StepMeta> meta;                  // token, pos, seq_len, sampling
  replay::step_meta_array<std::int32_t> prompt;      // prompt token ids for prefill
  replay::pinned_buffer<std::int32_t> token_out;     // the sampler writes the token here
  replay::graph_exec exec;                           // the captured decode step
  std::size_t graph_nodes = 0;
  std::size_t graph_kernel_nodes = 0;

  Impl(const Weights& w, ModelOptions opt)
      : options(opt),
        params_mem(w.data.size()),
        arena(static_cast<std::size_t>(2 * C::block_size * C::n_embd + 2 * C::n_layer * kCacheLayer +
                                       C::vocab_size) * sizeof(float) + 8 * replay::static_arena::default_alignment),
        prompt(C::block_size),
        token_out(1) {
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

    buffers.x = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.q = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.k_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.v_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.logits = arena.allocate<float>(C::vocab_size).data();
    arena.freeze();  // from here on no address changes: safe to capture
    buffers.prompt = prompt.device();
    buffers.token_out = token_out.data();  // pinned host memory is device-accessible under UVA
    REPLAY_CHECK(cudaMemsetAsync(arena.base(), 0, arena.capacity(), stream.get()));
    token_out[0] = -1;
    stream.synchronize();
  }

  ~Impl() { (void)cudaStreamSynchronize(stream.get()); }

  [[nodiscard]] Launcher launcher() const { return {params, buffers, meta.device(), options.pdl}; }

  /// Issues one decode step: metadata to the device, then the kernels (eager) or the replay
  /// (graph). With meta_in_graph the replay itself starts with the metadata copy (capture_copy).
  void issue_step(const StepMeta& v, Mode mode) {
    const replay::stream_ref s(stream.get());
    token_out[0] = -1;  // poison: a step that did not run cannot hand back a stale token
    if (mode == Mode::graph) {
      if (!exec) throw replay::usage_error("nanogpt::Model: Mode::graph before capture_decode_graph()");
      if (options.meta_in_graph) {
        meta.graph_staging() = v;
        exec.launch(s);
        meta.launched(s);
      } else {
        meta.staging() = v;
        meta.push(s);
        exec.launch(s);
      }
    } else {
      meta.staging() = v;
      meta.push(s);
      launcher().decode_step(stream.get());
    }
  }

  /// Waits for the token the sampler writes into pinned host memory. Polling that memory is the
  /// cheapest wake-up; if the token takes unusually long (a slow tool such as compute-sanitizer, or
  /// a failed kernel) the stream is synchronised, which also reports any CUDA error.
  std::int32_t wait_token() {
    const volatile std::int32_t* slot = token_out.data();
    for (int i = 0; i < (1 << 22); ++i) {
      const std::int32_t t = *slot;
      if (t >= 0 && t < C::vocab_size) return t;
    }
    REPLAY_CHECK(cudaStreamSynchronize(stream.get()));
    const std::int32_t t = *slot;
    if (t < 0 || t >= C::vocab_size)
      throw std::runtime_error(fmt::format("nanogpt: the step produced no valid token ({})", t));
    return t;
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
  const replay::stream_ref s(m.stream.get());
  auto staged = m.prompt.staging();
  std::copy(prompt.begin(), prompt.end(), staged.begin());
  m.prompt.push(s, prompt.size());
  const int rows = static_cast<int>(prompt.size());
  m.token_out[0] = -1;
  m.meta.staging() = make_meta(0, 0, rows, sampling);
  m.meta.push(s);
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
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
  return impl_->wait_token();
}

void Model::enqueue_decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode) {
  if (token < 0 || token >= C::vocab_size || pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(fmt::format("enqueue_decode_step: token {} or position {} out of range", token, pos));
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
}

void Model::synchronize() { REPLAY_CHECK(cudaStreamSynchronize(impl_->stream.get())); }

void Model::capture_decode_graph() {
  Impl& m = *impl_;
  const Launcher l = m.launcher();
  const replay::stream_ref s(m.stream.get());
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    if (m.options.meta_in_graph) m.meta.capture_copy(cs);  // every replay starts by copying StepMeta
    l.decode_step(cs.get());
  });
  m.graph_nodes = g.node_count();
  m.graph_kernel_nodes = g.kernel_node_count();
  m.exec = g.instantiate({.upload_stream = s.get()});
  s.synchronize();
}

bool Model::has_graph() const noexcept { return static_cast<bool>(impl_->exec); }
std::size_t Model::graph_nodes() const noexcept { return impl_->graph_nodes; }
std::size_t Model::graph_kernel_nodes() const noexcept { return impl_->graph_kernel_nodes; }
const ModelOptions& Model::options() const noexcept { return impl_->options; }
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
                        const Sampling& sampling, bool fresh_capture) {
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
  for (int i = 1; i < n_tokens; ++i, ++pos) {
    sw.restart();
    token = model.decode_step(token, pos, sampling, mode);
    r.step_us.push_back(sw.elapsed_us());
    r.tokens.push_back(token);
  }
  r.decode_us = decode.elapsed_us();
  r.total_us = total.elapsed_us();
  return r;
}

}  // namespace nanogpt
