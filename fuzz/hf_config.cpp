// Fuzz harness: the input as a Hugging Face config.json for the qwen example
// (qwen::config_from_json_text). Must give a validated Config or throw qwen::input_error; the sizes
// derived from an accepted config must not overflow.
#include "qwen/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const qwen::Config c =
        qwen::config_from_json_text(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
    if (c.q_dim() <= 0 || c.kv_dim() <= 0 || c.qkv_dim() <= 0 || c.group_size() < 1) std::abort();
    if (c.layer_params() <= 0 || c.total_params() <= 0 || c.decode_weight_bytes() <= 0) std::abort();
    for (const auto& m : c.layer_matrices())
      if (m.rows <= 0 || m.cols <= 0) std::abort();
  } catch (const qwen::input_error&) {
  }
  return 0;
}
