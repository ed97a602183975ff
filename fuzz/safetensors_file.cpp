// Fuzz harness: the input written as a .safetensors file and opened with safetensors::open (file
// checks, mapping, header, lookups). Must open or throw safetensors_error.
#include "common/safetensors.hpp"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace replay_examples;
  static const std::string path =
      (std::filesystem::temp_directory_path() / ("replay_fuzz_file_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size != 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  } else {
    std::abort();
  }
  try {
    const auto st = safetensors::open(path);
    for (const auto& name : st.names()) {
      const tensor_view& t = st.at(name);
      (void)st.expect(name, t.type, t.shape);
      (void)t.bytes();
    }
    try {
      (void)st.at("no such tensor");
      std::abort();  // at() of a missing name must throw
    } catch (const safetensors_error&) {
    }
    (void)st.metadata();
  } catch (const safetensors_error&) {
  }
  return 0;
}
