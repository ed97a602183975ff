// nanogpt/config.hpp: the model's shape, the per-step metadata struct and the sampling settings.
//
// The shape is the seed's character-level GPT (examples/nanogpt/README.md): 4 layers, 4 heads of 8,
// a 32-wide residual stream, a 64-token context. The kernels are written for exactly this shape
// (compile-time constants), so a weights file of another shape is rejected when it is loaded.
#pragma once

#include "common/host_device.hpp"

#include <cstdint>
#include <type_traits>

namespace nanogpt {

/// The model's hyper-parameters (the seed's values). Compile-time constants used by the kernels.
struct Config {
  static constexpr int vocab_size = 65;             ///< characters in the vocabulary (vocab.hpp)
  static constexpr int n_embd = 32;                 ///< width of the residual stream
  static constexpr int n_head = 4;                  ///< attention heads per layer
  static constexpr int head_size = n_embd / n_head; ///< 8: width of one head
  static constexpr int n_layer = 4;                 ///< transformer blocks
  static constexpr int block_size = 64;             ///< context length = KV-cache slots per head
  static constexpr int ffn_hidden = 4 * n_embd;     ///< 128: hidden width of the feed-forward net
  static constexpr float ln_eps = 1e-5f;            ///< LayerNorm epsilon (PyTorch's default)
};
static_assert(Config::n_embd == 32, "the kernels map one residual-stream element to one warp lane");
static_assert(Config::n_head * Config::head_size == Config::n_embd);

/// Everything that changes from one step to the next, at a fixed device address (replay::step_meta's
/// device copy, see MetaPath). Kernels read it through a pointer, so a captured
/// graph reads the current values on every replay instead of the values that were current at
/// capture time. 16-byte aligned: the kernels read it as two 16-byte loads.
struct alignas(16) StepMeta {
  std::int32_t token = 0;       ///< decode: the input token of this step (prefill: unused)
  std::int32_t pos = 0;         ///< decode: position of `token` = the KV-cache slot written;
                                ///< prefill: position of the first prompt token (0)
  std::int32_t seq_len = 0;     ///< tokens in the cache after this step: decode pos + 1,
                                ///< prefill the prompt length. The sampled token gets index seq_len
  std::int32_t greedy = 0;      ///< 1: take the argmax instead of sampling
  float temperature = 1.0f;     ///< logits are divided by it before the softmax (> 0)
  std::uint32_t reserved = 0;   ///< unused: keeps the struct 32 bytes (two 16-byte loads)
  std::uint64_t seed = 1337;    ///< RNG seed: the draw for the token at index i is uniform01(seed, i)
};
static_assert(std::is_trivially_copyable_v<StepMeta> && sizeof(StepMeta) == 32);

/// The metadata after `steps` decode steps from `m` whose last sampled `token`: that token, at the
/// index it was sampled for (m.seq_len + steps - 1), the sampling settings unchanged. The one rule
/// for the next step's metadata: the sampler applies it on the device (MetaPath::device, the
/// device loop) and the host applies it to know what the device then holds. A prefill's metadata
/// (seq_len = prompt length) follows it too.
REPLAY_EXAMPLES_HD StepMeta next_step_meta(StepMeta m, std::int32_t token, std::int32_t steps = 1) {
  m.token = token;
  m.pos = m.seq_len + steps - 1;
  m.seq_len = m.seq_len + steps;
  return m;
}

/// Sampling settings of one generation (copied into StepMeta for every step).
struct Sampling {
  float temperature = 1.0f;   ///< > 0; ignored when greedy
  std::uint64_t seed = 1337;  ///< same seed, same prompt, same weights: same tokens, eager or graph
  bool greedy = false;        ///< argmax decoding (lowest index wins ties)
};

}  // namespace nanogpt
