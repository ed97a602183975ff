// examples/qwen/weights.hpp: host-side checks of a Hugging Face Qwen3 checkpoint against a config.
//
// Host-only (no CUDA), so bad weights are reported before any GPU work and the checks run in CI.
#pragma once

#include "config.hpp"

#include <common/safetensors.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace qwen {

/// The tensors of one decoder layer, after "model.layers.{i}.".
inline constexpr std::array<std::string_view, 11> layer_suffixes = {
    "input_layernorm.weight",      "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",     "self_attn.v_proj.weight",         "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",     "self_attn.k_norm.weight",         "mlp.gate_proj.weight",
    "mlp.up_proj.weight",          "mlp.down_proj.weight"};

/// The layer index of a tensor name: decimal digits, no sign, no leading zeros ("0" itself is
/// fine), at most Config::max_layers; nullopt otherwise.
inline std::optional<int> parse_layer_index(std::string_view s) {
  if (s.empty() || s.size() > 7 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  int v = 0;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  if (v > Config::max_layers) return std::nullopt;
  return v;
}

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
  // Every other tensor must be a parameter of this config too: layer tensors are
  // model.layers.{i}.{suffix} with i written in decimal without a sign or leading zeros.
  const std::string prefix = "model.layers.";
  for (const auto& n : st.names()) {
    if (n.rfind(prefix, 0) != 0) {
      if (n == "model.embed_tokens.weight" || n == "model.norm.weight" || n == "lm_head.weight") continue;
      throw input_error(fmt::format("weights do not match config {}: tensor {} is not a parameter of a Qwen3 model",
                                    c.name, n));
    }
    const std::string_view rest = std::string_view(n).substr(prefix.size());
    const auto dot = rest.find('.');
    const auto index = parse_layer_index(rest.substr(0, dot));
    if (dot == std::string_view::npos || !index)
      throw input_error(fmt::format("weights: tensor {}: '{}' is not a layer index (a decimal number without sign "
                                    "or leading zeros)",
                                    n, rest.substr(0, dot)));
    if (*index >= c.num_hidden_layers)
      throw input_error(fmt::format("weights do not match config {}: tensor {} belongs to layer {}, but the config "
                                    "has {} layers",
                                    c.name, n, *index, c.num_hidden_layers));
    if (n.find("bias") != std::string::npos)
      throw input_error(fmt::format("weights: tensor {} is a bias; Qwen3 projections have none", n));
    const std::string_view suffix = rest.substr(dot + 1);
    if (std::find(layer_suffixes.begin(), layer_suffixes.end(), suffix) == layer_suffixes.end())
      throw input_error(fmt::format("weights do not match config {}: tensor {} is not a parameter of a Qwen3 layer",
                                    c.name, n));
  }
}

}  // namespace qwen
