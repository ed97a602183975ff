// Fuzz harness: a safetensors file's bytes, parsed in memory (header JSON, shapes, offsets, overlap).
// Every input must either parse, with every tensor's bytes inside the input, or throw
// safetensors_error; nothing else (crash, hang, sanitizer report, another exception) is allowed.
#include "common/safetensors.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace replay_examples;
  const auto bytes = std::as_bytes(std::span<const std::uint8_t>(data, size));
  std::vector<tensor_view> tensors;
  std::map<std::string, std::string> metadata;
  try {
    detail::parse_header(bytes, "fuzz.safetensors", tensors, metadata);
  } catch (const safetensors_error&) {
    return 0;
  }
  unsigned sum = 0;
  for (const auto& t : tensors) {
    if (t.data < bytes.data() || t.data + t.nbytes > bytes.data() + bytes.size()) std::abort();
    if (static_cast<std::uint64_t>(t.numel()) * dtype_size(t.type) != t.nbytes) std::abort();
    for (std::size_t i = 0; i < t.nbytes; ++i) sum += static_cast<unsigned>(t.data[i]);
    (void)t.shape_string();
  }
  return static_cast<int>(sum & 0);
}
