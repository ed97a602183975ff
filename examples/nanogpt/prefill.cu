// nanogpt/prefill.cu: the prefill (eager only): a set of kernels, one per operation, one block per
// prompt token, built from the same device functions as the decode step (device.cuh); the last
// samples the first new token.
#include "device.cuh"

#include <replay/launch.hpp>

namespace nanogpt::detail {
namespace {

/// x[row] = tok_emb[prompt[row]] + pos_emb[pos + row]. One warp per row. Launched without PDL
/// (kPdlFirst): it starts after everything before it on the stream has completed.
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

}  // namespace

void launch_prefill(const ModelParams& p, const StepMeta* meta, const Buffers& b, int rows, bool pdl, cudaStream_t s) {
  replay::launch(embed_prefill_kernel, kernel_config(s, rows, 32, kPdlFirst), p.tok_emb, p.pos_emb, meta, b);
  for (int l = 0; l < C::n_layer; ++l) {
    replay::launch(qkv_prefill_kernel, kernel_config(s, rows, kThreads, pdl), p.layer[l], l, meta, b);
    replay::launch(attention_prefill_kernel, kernel_config(s, rows, kThreads, pdl), p.layer[l], l, meta, b);
    replay::launch(ffn_prefill_kernel, kernel_config(s, rows, kThreads, pdl), p.layer[l], meta, b);
  }
  replay::launch(lm_head_prefill_kernel, kernel_config(s, 1, kThreads, pdl), p.lnf_w, p.lnf_b, p.head_w, p.head_b,
                 meta, b);
}

}  // namespace nanogpt::detail
