// nanogpt/decode_step.cu: the decode step's kernel and its launcher.
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
// overlap the computation (see the notes on the weight image below).
//   - Every thread normalises the whole 32-wide residual row itself (sums in registers, no
//     shuffles, no barrier), then computes its output row of the linear layer as one 32-wide dot
//     product, the LayerNorm's scale and shift folded into the staged weights.
//   - Attention: warp h is head h; lanes 0-7 / 8-15 / 16-23 compute the head's query / key / value,
//     shuffles hand them to every lane, lane l scores the cache slots l and l + 32.
//
// Per-step values (token, position, sequence length, sampling settings) are read from StepMeta
// through a pointer, never passed by value: a graph captured once replays correctly at any
// position. Prefill (eager, prefill.cu) is a separate set of kernels, one block per prompt token
// and one kernel per operation, built from the same device functions (device.cuh).
#include "device.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

namespace nanogpt::detail {
namespace {

// A decode step of one token is a chain of small dependent computations; as separate kernels each
// link costs a kernel handoff and a re-read of the residual row from L2. decode_step_kernel runs
// the whole step in one block of 128 threads: the residual row lives in shared memory between
// sublayers (a barrier instead of a handoff), and every weight of the model is in shared memory.
//
// The weights reach shared memory as a StageImage: the Model prepares it once on the host
// (make_stage_image, model.cu) in exactly the layout the kernel reads, and every step copies it
// with 9 bulk copies (cp.async.bulk, the Tensor Memory Accelerator), one per sublayer in the order
// the sublayers use them, each completing on its own mbarrier. A sublayer waits only for its own copy,
// so the copies of later layers overlap the computation of earlier ones; when the kernel is
// launched early by PDL (the device loop's chained steps) they all complete before its wait
// returns. The image holds each LayerNorm folded into the linear layer after it (its scale γ into
// the weight rows, its shift β into a per-row constant), and its matrices with 16-byte chunk c of
// row r at chunk c ^ (r & 7): the 8 threads of a quarter-warp read 8 different rows at the same
// column, which this places in 8 different bank groups (no shared-memory bank conflicts). The
// image's layout (StageImage, StepShared) is in kernels.cuh, since the Model allocates it.

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

}  // namespace

void set_decode_step_attributes() {
  REPLAY_CHECK(cudaFuncSetAttribute(decode_step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kStepSharedBytes)));
}

void launch_decode_step(const StageImage* image, const StepMeta* meta, const Buffers& b, replay::token_loop_ref loop,
                        bool pdl, cudaStream_t s) {
  replay::launch(decode_step_kernel, kernel_config(s, 1, kThreads, pdl, kStepSharedBytes), image, meta, b, loop);
}

}  // namespace nanogpt::detail
