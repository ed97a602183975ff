// nanogpt/kernels.cuh: what the host model (model.cu) and the kernels (decode_step.cu, prefill.cu)
// share: the device pointers of the parameters and buffers, the decode step's weight image and
// shared-memory layout, and the launchers. Internal to the example (namespace nanogpt::detail).
#pragma once

#include "config.hpp"

#include <replay/device_loop.hpp>
#include <replay/launch.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <source_location>

namespace nanogpt::detail {

using C = Config;

// ---- parameters and buffers (device pointers; fixed for the Model's lifetime) -------------------

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

// ---- the decode step's weight image (decode_step.cu) -------------------------------------------

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

// ---- launchers: each takes the stream, launches its kernels and checks the launches ------------

/// The first kernel of a step or prefill is launched without PDL: it starts only once everything
/// before it on the stream has completed, in particular the previous step's sampler, whose writes
/// of the next StepMeta (advance_meta) it and every later kernel of its step then see. (In a
/// captured graph the first kernel has no programmatic edge either way.)
inline constexpr bool kPdlFirst = false;

/// `rows` blocks of `threads` threads, on `s`, with PDL when `pdl`.
inline replay::launch_config kernel_config(cudaStream_t s, int rows, int threads, bool pdl,
                                           std::size_t shared_bytes = 0,
                                           std::source_location where = std::source_location::current()) {
  return {.grid = dim3(static_cast<unsigned>(rows)), .block = dim3(static_cast<unsigned>(threads)),
          .shared_bytes = shared_bytes, .stream = replay::stream_ref(s), .pdl = pdl, .where = where};
}

/// Lets the decode step's kernel use kStepSharedBytes of dynamic shared memory (once per Model, on a
/// device whose blocks may use that much). (decode_step.cu)
void set_decode_step_attributes();

/// One decode step: one kernel of one block, what eager mode launches and graph mode captures.
/// `loop` not null: the device loop's step, which appends its token there. `pdl`: launched with
/// PDL (a step chained behind another in the device loop's body). (decode_step.cu)
void launch_decode_step(const StageImage* image, const StepMeta* meta, const Buffers& b, replay::token_loop_ref loop,
                        bool pdl, cudaStream_t s);

/// Prefill of `rows` prompt tokens (eager only): embedding, per layer {QKV, attention, FFN},
/// lm_head + sampling; one block per prompt token. The first kernel is launched without PDL, the
/// others with PDL when `pdl`. (prefill.cu)
void launch_prefill(const ModelParams& p, const StepMeta* meta, const Buffers& b, int rows, bool pdl, cudaStream_t s);

}  // namespace nanogpt::detail
