// nanogpt/weights.hpp: the model's parameters on the host, loaded from safetensors or made up.
//
// Tensor names and shapes are those of the PyTorch `state_dict` of the seed's model (train.py's
// GPTLanguageModel), so a file saved with `safetensors.torch.save_file(model.state_dict(), path)`
// loads directly:
//
//   token_embedding_table.weight      [65, 32]     position_embedding_table.weight [64, 32]
//   blocks.{l}.ln1.weight / .bias     [32]         blocks.{l}.sa.qkv.weight        [96, 32]
//   blocks.{l}.sa.attn_proj.weight    [32, 32]     blocks.{l}.sa.attn_proj.bias    [32]
//   blocks.{l}.ln2.weight / .bias     [32]         blocks.{l}.ffwd.net.0.weight    [128, 32]
//   blocks.{l}.ffwd.net.0.bias        [128]        blocks.{l}.ffwd.net.2.weight    [32, 128]
//   blocks.{l}.ffwd.net.2.bias        [32]         ln_f.weight / ln_f.bias         [32]
//   lm_head.weight                    [65, 32]     lm_head.bias                    [65]
//
// Every parameter must be present as F32 with exactly that shape. Buffers the PyTorch model also
// saves (blocks.{l}.sa.tril, blocks.{l}.sa.kv_indices) and any other extra tensor are ignored and
// listed in `Weights::ignored`. Everything is checked on the host, before any GPU work.
//
// Guarantees: `Weights::data` holds all parameters packed in `tensor_specs()` order, each tensor
// starting at a multiple of 16 floats (64 bytes), so rows of 32 floats are float4-aligned on the
// device after one copy.
#pragma once

#include "common/rng.hpp"
#include "common/safetensors.hpp"
#include "config.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace nanogpt {

/// One parameter tensor: PyTorch name, shape, and where it lives in Weights::data.
struct TensorSpec {
  std::string name;                 ///< state_dict key
  std::vector<std::int64_t> shape;  ///< PyTorch shape (Linear weights are [out, in])
  std::size_t offset = 0;           ///< first float in Weights::data
  std::size_t numel = 0;            ///< number of floats
};

/// What a freshly made-up tensor is initialised to (the seed's _init_weights).
enum class Init { normal, zeros, ones };

/// The parameter list in packing order, with offsets. Pure function of Config.
inline const std::vector<TensorSpec>& tensor_specs() {
  static const std::vector<TensorSpec> specs = [] {
    using C = Config;
    std::vector<TensorSpec> v;
    std::size_t offset = 0;
    const auto add = [&](std::string name, std::vector<std::int64_t> shape) {
      std::size_t n = 1;
      for (auto d : shape) n *= static_cast<std::size_t>(d);
      v.push_back({std::move(name), std::move(shape), offset, n});
      offset += (n + 15) / 16 * 16;
    };
    add("token_embedding_table.weight", {C::vocab_size, C::n_embd});
    add("position_embedding_table.weight", {C::block_size, C::n_embd});
    for (int l = 0; l < C::n_layer; ++l) {
      const std::string p = fmt::format("blocks.{}.", l);
      add(p + "ln1.weight", {C::n_embd});
      add(p + "ln1.bias", {C::n_embd});
      add(p + "sa.qkv.weight", {3 * C::n_embd, C::n_embd});
      add(p + "sa.attn_proj.weight", {C::n_embd, C::n_embd});
      add(p + "sa.attn_proj.bias", {C::n_embd});
      add(p + "ln2.weight", {C::n_embd});
      add(p + "ln2.bias", {C::n_embd});
      add(p + "ffwd.net.0.weight", {C::ffn_hidden, C::n_embd});
      add(p + "ffwd.net.0.bias", {C::ffn_hidden});
      add(p + "ffwd.net.2.weight", {C::n_embd, C::ffn_hidden});
      add(p + "ffwd.net.2.bias", {C::n_embd});
    }
    add("ln_f.weight", {C::n_embd});
    add("ln_f.bias", {C::n_embd});
    add("lm_head.weight", {C::vocab_size, C::n_embd});
    add("lm_head.bias", {C::vocab_size});
    return v;
  }();
  return specs;
}

/// Floats in Weights::data (parameters plus alignment padding).
inline std::size_t packed_size() {
  const auto& s = tensor_specs().back();
  return s.offset + (s.numel + 15) / 16 * 16;
}

/// Number of parameters (56,769 for the seed's shape).
inline std::size_t parameter_count() {
  std::size_t n = 0;
  for (const auto& s : tensor_specs()) n += s.numel;
  return n;
}

/// The spec of a parameter by name; throws std::out_of_range for an unknown name.
inline const TensorSpec& spec(std::string_view name) {
  for (const auto& s : tensor_specs())
    if (s.name == name) return s;
  throw std::out_of_range(fmt::format("nanogpt: no parameter named {}", name));
}

/// All parameters on the host.
struct Weights {
  std::vector<float> data;           ///< packed_size() floats in tensor_specs() order
  std::string source;                ///< the file they came from, or "random init (seed N)"
  std::vector<std::string> ignored;  ///< tensors of the file that are not parameters (buffers)

  /// A parameter's values.
  [[nodiscard]] std::span<const float> tensor(std::string_view name) const {
    const auto& s = spec(name);
    return {data.data() + s.offset, s.numel};
  }
  [[nodiscard]] std::span<float> tensor(std::string_view name) {
    const auto& s = spec(name);
    return {data.data() + s.offset, s.numel};
  }
};

/// Loads and checks a safetensors file (or directory) with the PyTorch names; throws
/// replay_examples::safetensors_error naming the first missing or mismatched tensor.
inline Weights load_weights(const std::filesystem::path& path) {
  const auto st = replay_examples::safetensors::open(path);
  Weights w;
  w.data.assign(packed_size(), 0.0f);
  w.source = path.string();
  // Report every missing tensor at once, then shape/dtype problems one at a time.
  std::vector<std::string> missing;
  for (const auto& s : tensor_specs())
    if (st.find(s.name) == nullptr) missing.push_back(s.name);
  if (!missing.empty())
    throw replay_examples::safetensors_error(fmt::format(
        "{}: missing tensor{} {} ({} of {} parameters missing; is this a weights file of the seed's "
        "model? see examples/nanogpt/README.md)",
        path.string(), missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), missing.size(),
        tensor_specs().size()));
  for (const auto& s : tensor_specs()) {
    const auto& t = st.expect(s.name, replay_examples::dtype::F32, s.shape);
    const auto values = t.as<float>();
    std::copy(values.begin(), values.end(), w.data.begin() + static_cast<std::ptrdiff_t>(s.offset));
  }
  for (const auto& name : st.names()) {
    bool known = false;
    for (const auto& s : tensor_specs()) known = known || s.name == name;
    if (!known) w.ignored.push_back(name);
  }
  for (float v : w.data)
    if (!std::isfinite(v))
      throw replay_examples::safetensors_error(
          fmt::format("{}: the weights contain NaN or infinity", path.string()));
  return w;
}

/// Deterministic made-up weights with the seed's initialisation: Linear and Embedding weights
/// N(0, 0.02), biases 0, LayerNorm weight 1 and bias 0. The same seed gives the same weights.
inline Weights random_weights(std::uint64_t seed) {
  Weights w;
  w.data.assign(packed_size(), 0.0f);
  w.source = fmt::format("random init (seed {})", seed);
  std::uint64_t counter = 0;
  const auto normal = [&] {  // Box-Muller on the counter-based generator
    const float u1 = replay_examples::uniform01(seed, counter++);
    const float u2 = replay_examples::uniform01(seed, counter++);
    return std::sqrt(-2.0f * std::log(1.0f - u1)) * std::cos(6.2831853f * u2);
  };
  for (const auto& s : tensor_specs()) {
    const bool is_ln = s.name.find(".ln1.") != std::string::npos ||
                       s.name.find(".ln2.") != std::string::npos || s.name.starts_with("ln_f.");
    const bool is_bias = s.name.ends_with(".bias");
    float* p = w.data.data() + s.offset;
    for (std::size_t i = 0; i < s.numel; ++i) {
      if (is_bias) p[i] = 0.0f;
      else if (is_ln) p[i] = 1.0f;
      else p[i] = 0.02f * normal();
    }
  }
  return w;
}

/// Writes the parameters as a safetensors file with the PyTorch names (for tests and tools).
inline void save_weights(const std::filesystem::path& path, const Weights& w,
                         const std::map<std::string, std::string>& metadata = {}) {
  std::vector<replay_examples::tensor_to_write> ts;
  for (const auto& s : tensor_specs())
    ts.push_back({s.name, replay_examples::dtype::F32, s.shape,
                  std::as_bytes(std::span<const float>(w.data.data() + s.offset, s.numel))});
  replay_examples::write_safetensors(path, ts, metadata);
}

}  // namespace nanogpt
