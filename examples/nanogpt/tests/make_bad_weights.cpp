// Writes the broken weights files the CLI failure tests feed to `nanogpt` (a CTest fixture):
// truncated.safetensors, wrong_shape.safetensors, missing_tensor.safetensors.
#include "nanogpt/weights.hpp"

#include <cstdio>
#include <filesystem>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  namespace fs = std::filesystem;
  using replay_examples::dtype;
  const fs::path dir = argv[1];
  fs::create_directories(dir);
  const nanogpt::Weights w = nanogpt::random_weights(1);

  // A complete file cut in half.
  nanogpt::save_weights(dir / "truncated.safetensors", w);
  fs::resize_file(dir / "truncated.safetensors", fs::file_size(dir / "truncated.safetensors") / 2);

  // lm_head.weight with 50 rows instead of 65; one tensor left out.
  std::vector<replay_examples::tensor_to_write> shape_ts, missing_ts;
  for (const auto& s : nanogpt::tensor_specs()) {
    const auto bytes = std::as_bytes(std::span<const float>(w.data.data() + s.offset, s.numel));
    if (s.name == "lm_head.weight")
      shape_ts.push_back({s.name, dtype::F32, {50, 32}, bytes.first(50 * 32 * sizeof(float))});
    else
      shape_ts.push_back({s.name, dtype::F32, s.shape, bytes});
    if (s.name != "blocks.3.ffwd.net.2.bias") missing_ts.push_back({s.name, dtype::F32, s.shape, bytes});
  }
  replay_examples::write_safetensors(dir / "wrong_shape.safetensors", shape_ts);
  replay_examples::write_safetensors(dir / "missing_tensor.safetensors", missing_ts);
  return 0;
}
