// examples/qwen/weights.hpp: host-side checks of a Hugging Face Qwen3 checkpoint against a config.
//
// Host-only (no CUDA), so bad weights are reported before any GPU work and the checks run in CI.
#pragma once

#include "config.hpp"

#include <common/safetensors.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

namespace qwen {

/// "model.layers.{i}.{suffix}"
inline std::string layer_tensor(int i, const char* suffix) { return fmt::format("model.layers.{}.{}", i, suffix); }

/// Checks every tensor the config needs in `st` (name, shape, BF16), and that the weights have no
/// more layers than the config. Throws input_error naming the problem.
inline void check_weights(const Config& c, const replay_examples::safetensors& st) {
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const std::int64_t Q = c.q_dim(), KV = c.kv_dim();
  auto expect = [&](const std::string& name, std::initializer_list<std::int64_t> shape) {
    try {
      (void)st.expect(name, replay_examples::dtype::BF16, shape);
    } catch (const replay_examples::safetensors_error& e) {
      throw input_error(fmt::format("weights do not match config {}: {}", c.name, e.what()));
    }
  };
  expect("model.embed_tokens.weight", {V, H});
  expect("model.norm.weight", {H});
  if (!c.tie_word_embeddings) expect("lm_head.weight", {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    expect(layer_tensor(i, "input_layernorm.weight"), {H});
    expect(layer_tensor(i, "post_attention_layernorm.weight"), {H});
    expect(layer_tensor(i, "self_attn.q_proj.weight"), {Q, H});
    expect(layer_tensor(i, "self_attn.k_proj.weight"), {KV, H});
    expect(layer_tensor(i, "self_attn.v_proj.weight"), {KV, H});
    expect(layer_tensor(i, "self_attn.o_proj.weight"), {H, Q});
    expect(layer_tensor(i, "self_attn.q_norm.weight"), {D});
    expect(layer_tensor(i, "self_attn.k_norm.weight"), {D});
    expect(layer_tensor(i, "mlp.gate_proj.weight"), {I, H});
    expect(layer_tensor(i, "mlp.up_proj.weight"), {I, H});
    expect(layer_tensor(i, "mlp.down_proj.weight"), {H, I});
  }
  const std::string prefix = "model.layers.";
  for (const auto& n : st.names()) {
    if (n.rfind(prefix, 0) != 0) continue;
    const int layer = std::atoi(n.c_str() + prefix.size());
    if (layer >= c.num_hidden_layers)
      throw input_error(fmt::format("weights do not match config {}: tensor {} belongs to layer {}, but the config "
                                    "has {} layers",
                                    c.name, n, layer, c.num_hidden_layers));
    if (n.find("bias") != std::string::npos)
      throw input_error(fmt::format("weights: tensor {} is a bias; Qwen3 projections have none", n));
  }
}

}  // namespace qwen
