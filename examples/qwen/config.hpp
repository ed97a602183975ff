// examples/qwen/config.hpp: the Qwen3 model shape, from a Hugging Face config.json or a preset.
//
// Host-only (no CUDA): parsed and validated before any GPU work, so a bad config fails with a clear
// message. Field names follow Hugging Face's Qwen3Config.
#pragma once

#include <common/input_file.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace qwen {

/// A user-facing error in the inputs (config, weights, prompt, sizes): reported with its message and
/// a non-zero exit, always before GPU work.
struct input_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The shape of a Qwen3ForCausalLM model (Hugging Face Qwen3Config names).
struct Config {
  std::string name = "custom";           ///< preset name or the config path, for reports
  int vocab_size = 0;                    ///< token ids are in [0, vocab_size)
  int hidden_size = 0;                   ///< residual stream width (model dimension)
  int intermediate_size = 0;             ///< SwiGLU MLP inner width
  int num_hidden_layers = 0;             ///< decoder layers
  int num_attention_heads = 0;           ///< query heads
  int num_key_value_heads = 0;           ///< key/value heads (GQA: query heads share them)
  int head_dim = 0;                      ///< per-head width (Qwen3: 128, not hidden/heads)
  int max_position_embeddings = 0;       ///< longest context the RoPE table covers
  double rms_norm_eps = 1e-6;            ///< epsilon of every RMSNorm
  double rope_theta = 1000000.0;         ///< RoPE base frequency
  bool tie_word_embeddings = true;       ///< lm_head shares the embedding matrix

  [[nodiscard]] int q_dim() const { return num_attention_heads * head_dim; }
  [[nodiscard]] int kv_dim() const { return num_key_value_heads * head_dim; }
  [[nodiscard]] int qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  [[nodiscard]] int group_size() const { return num_attention_heads / num_key_value_heads; }

  /// One weight matrix of a decoder layer: `rows` outputs (gate/up: both halves) of `cols` inputs.
  struct LayerMatrix {
    const char* name;
    int rows, cols;
    [[nodiscard]] std::int64_t params() const { return std::int64_t(rows) * cols; }
  };
  /// A layer's matrices in the order a decode step reads them: QKV (fused), O, gate/up (fused), down.
  [[nodiscard]] std::array<LayerMatrix, 4> layer_matrices() const {
    return {{{"QKV", qkv_dim(), hidden_size},
             {"O", hidden_size, q_dim()},
             {"gate/up", 2 * intermediate_size, hidden_size},
             {"down", hidden_size, intermediate_size}}};
  }
  /// Parameters of one decoder layer (all matrices and norm vectors).
  [[nodiscard]] std::int64_t layer_params() const {
    std::int64_t n = 2 * std::int64_t(hidden_size) + 2 * head_dim;
    for (const auto& m : layer_matrices()) n += m.params();
    return n;
  }
  /// Bytes of bf16 weights a batch-1 decode step must read: every layer matrix, the final norm, the
  /// lm_head, and one embedding row. With `tp` ranks, what one rank reads: its share of every layer
  /// matrix and of the lm_head (the norms and the embedding row are replicated).
  [[nodiscard]] std::int64_t decode_weight_bytes(int tp = 1) const {
    const std::int64_t v = vocab_size, h = hidden_size;
    std::int64_t mats = 0;
    for (const auto& m : layer_matrices()) mats += m.params();
    const std::int64_t norms = layer_params() - mats;
    return 2 * (num_hidden_layers * (mats / tp + norms) + h + v / tp * h + h);
  }
  /// All parameters stored (embedding, layers, norm, untied lm_head if any).
  [[nodiscard]] std::int64_t total_params() const {
    const std::int64_t v = vocab_size, h = hidden_size;
    return v * h + num_hidden_layers * layer_params() + h + (tie_word_embeddings ? 0 : v * h);
  }

  /// Largest values validate() accepts (far above any released model; they keep every product of
  /// two sizes inside 64 bits and every width product inside an int).
  static constexpr int max_vocab_size = 1 << 24;
  static constexpr int max_width = 1 << 18;  ///< hidden, intermediate, head_dim, heads x head_dim
  static constexpr int max_layers = 1024;
  static constexpr int max_heads = 1024;
  static constexpr int max_positions = 1 << 24;

  /// Throws input_error naming the first inconsistent field. The kernels need: head_dim 64 or 128,
  /// query heads a multiple of kv heads, hidden/intermediate/q widths multiples of 8 (16-byte loads).
  void validate() const {
    auto fail = [&](const std::string& m) { throw input_error("config " + name + ": " + m); };
    // Upper bounds first, so that the products below (q_dim(), kv_dim(), ...) cannot overflow an int.
    auto at_most = [&](const char* field, int v, int limit) {
      if (v > limit) fail(std::string(field) + " " + std::to_string(v) + " exceeds " + std::to_string(limit));
    };
    at_most("vocab_size", vocab_size, max_vocab_size);
    at_most("hidden_size", hidden_size, max_width);
    at_most("intermediate_size", intermediate_size, max_width);
    at_most("num_hidden_layers", num_hidden_layers, max_layers);
    at_most("num_attention_heads", num_attention_heads, max_heads);
    at_most("num_key_value_heads", num_key_value_heads, max_heads);
    at_most("head_dim", head_dim, max_width);
    at_most("max_position_embeddings", max_position_embeddings, max_positions);
    if (std::int64_t(num_attention_heads) * head_dim > max_width)
      fail("num_attention_heads x head_dim = " + std::to_string(std::int64_t(num_attention_heads) * head_dim) +
           " exceeds " + std::to_string(max_width));
    if (!std::isfinite(rms_norm_eps) || !std::isfinite(rope_theta)) fail("rms_norm_eps and rope_theta must be finite");
    if (vocab_size <= 0) fail("vocab_size must be positive");
    if (hidden_size <= 0 || hidden_size % 8 != 0) fail("hidden_size must be a positive multiple of 8");
    if (intermediate_size <= 0 || intermediate_size % 8 != 0)
      fail("intermediate_size must be a positive multiple of 8");
    if (num_hidden_layers <= 0) fail("num_hidden_layers must be positive");
    if (num_attention_heads <= 0 || num_key_value_heads <= 0) fail("head counts must be positive");
    if (num_attention_heads % num_key_value_heads != 0)
      fail("num_attention_heads must be a multiple of num_key_value_heads");
    if (group_size() > 8)
      fail("query heads per kv head must be at most 8 (got " + std::to_string(group_size()) + ")");
    if (head_dim != 64 && head_dim != 128) fail("head_dim must be 64 or 128 (got " + std::to_string(head_dim) + ")");
    if (max_position_embeddings <= 0) fail("max_position_embeddings must be positive");
    if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
    if (!(rope_theta > 0)) fail("rope_theta must be positive");
  }
};

/// The names preset() knows.
inline std::vector<std::string> preset_names() {
  return {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "tiny", "tiny-hd128"};
}

/// Presets with the shapes of the released Qwen3 models, plus two tiny test shapes (tiny-hd128: head_dim
/// 128 and 4 query heads per kv head, as Qwen3-4B and 8B).
inline Config preset(const std::string& name) {
  Config c;
  c.name = name;
  c.vocab_size = 151936;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = true;
  if (name == "qwen3-0.6b") {
    c.hidden_size = 1024, c.intermediate_size = 3072, c.num_hidden_layers = 28, c.num_attention_heads = 16;
  } else if (name == "qwen3-1.7b") {
    c.hidden_size = 2048, c.intermediate_size = 6144, c.num_hidden_layers = 28, c.num_attention_heads = 16;
  } else if (name == "qwen3-4b") {
    c.hidden_size = 2560, c.intermediate_size = 9728, c.num_hidden_layers = 36, c.num_attention_heads = 32;
  } else if (name == "qwen3-8b") {
    c.hidden_size = 4096, c.intermediate_size = 12288, c.num_hidden_layers = 36, c.num_attention_heads = 32;
    c.tie_word_embeddings = false;
  } else if (name == "qwen3-14b") {  // 40 query heads over 8 kv heads: 5 per group
    c.hidden_size = 5120, c.intermediate_size = 17408, c.num_hidden_layers = 40, c.num_attention_heads = 40;
    c.tie_word_embeddings = false;
  } else if (name == "qwen3-32b") {  // 64 query heads over 8 kv heads: 8 per group
    c.hidden_size = 5120, c.intermediate_size = 25600, c.num_hidden_layers = 64, c.num_attention_heads = 64;
    c.tie_word_embeddings = false;
  } else if (name == "tiny") {
    c.vocab_size = 1024, c.hidden_size = 256, c.intermediate_size = 512, c.num_hidden_layers = 4;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 64;
    c.max_position_embeddings = 2048, c.rope_theta = 10000.0;
  } else if (name == "tiny-hd128") {
    c.vocab_size = 1024, c.hidden_size = 512, c.intermediate_size = 1024, c.num_hidden_layers = 2;
    c.num_attention_heads = 8, c.num_key_value_heads = 2, c.max_position_embeddings = 2048;
  } else {
    throw input_error(fmt::format("unknown preset '{}' (known: {})", name, fmt::join(preset_names(), ", ")));
  }
  c.validate();
  return c;
}

/// Parses a Hugging Face config.json text. `source` names it in messages.
inline Config config_from_json_text(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = replay_examples::parse_json(text, source);  // depth-limited, no duplicate keys, no overflow
  } catch (const replay_examples::file_error& e) {
    throw input_error(e.what());
  }
  if (!j.is_object()) throw input_error(source + ": expected a JSON object");
  Config c;
  c.name = source;
  auto get_int = [&](const char* key, int& out, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) throw input_error(source + ": missing field '" + key + "'");
      return;
    }
    if (!j[key].is_number_integer()) throw input_error(source + ": field '" + key + "' must be an integer");
    if (j[key].is_number_unsigned() && j[key].get<std::uint64_t>() > std::uint64_t(INT64_MAX))
      throw input_error(source + ": field '" + key + "' out of range (" + j[key].dump() + ")");
    const auto v = j[key].get<std::int64_t>();
    if (v <= 0 || v > (1LL << 31) - 1)
      throw input_error(source + ": field '" + key + "' out of range (" + std::to_string(v) + ")");
    out = static_cast<int>(v);
  };
  auto get_num = [&](const char* key, double& out) {
    if (!j.contains(key) || j[key].is_null()) return;
    if (!j[key].is_number()) throw input_error(source + ": field '" + key + "' must be a number");
    out = j[key].get<double>();
    if (!std::isfinite(out) || !(out > 0)) throw input_error(source + ": field '" + key + "' must be a positive number");
  };
  if (j.contains("model_type") && (!j["model_type"].is_string() || j["model_type"] != "qwen3"))
    throw input_error(source + ": model_type is " +
                      (j["model_type"].is_string() ? "'" + j["model_type"].get<std::string>() + "'"
                                                   : j["model_type"].dump()) +
                      ", expected 'qwen3'");
  get_int("vocab_size", c.vocab_size, true);
  get_int("hidden_size", c.hidden_size, true);
  get_int("intermediate_size", c.intermediate_size, true);
  get_int("num_hidden_layers", c.num_hidden_layers, true);
  get_int("num_attention_heads", c.num_attention_heads, true);
  c.num_key_value_heads = c.num_attention_heads;
  get_int("num_key_value_heads", c.num_key_value_heads, false);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  get_int("head_dim", c.head_dim, false);
  c.max_position_embeddings = 40960;
  get_int("max_position_embeddings", c.max_position_embeddings, false);
  get_num("rms_norm_eps", c.rms_norm_eps);
  get_num("rope_theta", c.rope_theta);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())  // transformers >= 5
    if (j["rope_parameters"].contains("rope_theta")) {
      if (!j["rope_parameters"]["rope_theta"].is_number())
        throw input_error(source + ": field 'rope_parameters.rope_theta' must be a number");
      c.rope_theta = j["rope_parameters"]["rope_theta"].get<double>();
    }
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object() && j["rope_scaling"].contains("rope_type") &&
      j["rope_scaling"]["rope_type"] != "default")
    throw input_error(source + ": rope_scaling other than 'default' is not supported");
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean()) throw input_error(source + ": tie_word_embeddings must be a boolean");
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  if (j.contains("attention_bias") && !j["attention_bias"].is_boolean())
    throw input_error(source + ": attention_bias must be a boolean");
  if (j.contains("attention_bias") && j["attention_bias"].get<bool>())
    throw input_error(source + ": attention_bias=true is not supported (Qwen3 has no bias)");
  c.validate();
  return c;
}

/// Largest config.json read (a Hugging Face config is a few KiB).
inline constexpr std::size_t max_config_bytes = 1 << 20;

/// Reads `path` (a config.json file, or a directory holding one, which it must resolve inside).
/// Refuses a FIFO, device or directory without blocking (common/input_file.hpp).
inline Config config_from_file(const std::filesystem::path& path) {
  try {
    std::filesystem::path file = path;
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) file = replay_examples::file_in_directory(path, "config.json");
    return config_from_json_text(replay_examples::read_small_file(file, max_config_bytes), file.string());
  } catch (const replay_examples::file_error& e) {
    throw input_error(fmt::format("config: {}", e.what()));
  }
}

}  // namespace qwen
