// Fuzz harness: the input as model.safetensors.index.json of a directory holding two small shards
// (a.safetensors: tensors "x" and "y"; b.safetensors: tensor "z"), opened with safetensors::open.
// Must open or throw safetensors_error.
#include "common/safetensors.hpp"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace {
std::filesystem::path model_dir() {
  namespace fs = std::filesystem;
  using namespace replay_examples;
  const fs::path dir = fs::temp_directory_path() / ("replay_fuzz_index_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  static const float x[2] = {1, 2}, y[1] = {3}, z[3] = {4, 5, 6};
  const auto bytes = [](const float* p, std::size_t n) { return std::as_bytes(std::span<const float>(p, n)); };
  const tensor_to_write a[] = {{"x", dtype::F32, {2}, bytes(x, 2)}, {"y", dtype::F32, {1}, bytes(y, 1)}};
  const tensor_to_write b[] = {{"z", dtype::F32, {3}, bytes(z, 3)}};
  write_safetensors(dir / "a.safetensors", a);
  write_safetensors(dir / "b.safetensors", b);
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace replay_examples;
  static const std::filesystem::path dir = model_dir();
  const std::string index = (dir / "model.safetensors.index.json").string();
  if (std::FILE* f = std::fopen(index.c_str(), "wb")) {
    if (size != 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  } else {
    std::abort();
  }
  try {
    const auto st = safetensors::open(dir);
    if (st.size() != 3) std::abort();  // an accepted index lists exactly the shards' tensors
    for (const auto& name : st.names()) (void)st.at(name).bytes();
  } catch (const safetensors_error&) {
  }
  return 0;
}
