// Host tests: everything the decoder refuses before any GPU work (vocabulary, lengths, weights).
#include "nanogpt/model.hpp"
#include "nanogpt/vocab.hpp"
#include "nanogpt/weights.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;
using namespace nanogpt;

namespace {
struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& tag) {
    path = fs::temp_directory_path() / fmt::format("nanogpt_{}_{}", tag, ::getpid());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("vocabulary: 65 sorted characters, round trip") {
  CHECK(vocab_chars.size() == 65);
  CHECK(std::is_sorted(vocab_chars.begin(), vocab_chars.end()));
  const std::string text = "ROMEO:\nBut, soft! what light through yonder window breaks?";
  const auto ids = encode(text);
  CHECK(ids.size() == text.size());
  CHECK(decode(ids) == text);
  CHECK(encode("\n")[0] == 0);
  CHECK(encode("z")[0] == 64);
}

TEST_CASE("vocabulary: characters outside it are all listed once, with code points") {
  const auto m = error_of([] { (void)encode("héllo #1 ## é\t"); });
  CHECK(contains(m, "4 characters outside"));
  CHECK(contains(m, "'é' (U+00E9)"));
  CHECK(contains(m, "'#' (U+0023)"));
  CHECK(contains(m, "'1' (U+0031)"));
  CHECK(contains(m, "'\\t' (U+0009)"));
  CHECK(error_of([] { (void)decode({1, 65}); }).find("token id 65") != std::string::npos);
}

TEST_CASE("lengths: messages") {
  CHECK(contains(error_of([] { check_lengths(0, 5); }), "the prompt is empty"));
  CHECK(contains(error_of([] { check_lengths(65, 1); }), "the prompt has 65 tokens but the context holds only 64"));
  CHECK(contains(error_of([] { check_lengths(10, 60); }), "past the context of 64; at most 54 new tokens fit"));
  CHECK(contains(error_of([] { check_lengths(4, 0); }), "--tokens must be at least 1"));
  CHECK_NOTHROW(check_lengths(4, 60));
  CHECK_NOTHROW(check_lengths(63, 1));
}

TEST_CASE("weights: parameter list matches the seed's model") {
  CHECK(parameter_count() == 56769);
  CHECK(tensor_specs().size() == 2 + 11 * 4 + 4);
  for (const auto& s : tensor_specs()) CHECK(s.offset % 16 == 0);
  CHECK(spec("blocks.2.sa.qkv.weight").shape == std::vector<std::int64_t>{96, 32});
  CHECK(spec("blocks.0.ffwd.net.2.weight").shape == std::vector<std::int64_t>{32, 128});
}

TEST_CASE("weights: random init is deterministic and PyTorch-like") {
  const Weights a = random_weights(7), b = random_weights(7), c = random_weights(8);
  CHECK(a.data == b.data);
  CHECK(a.data != c.data);
  CHECK(a.tensor("ln_f.weight")[0] == 1.0f);
  CHECK(a.tensor("blocks.1.ln2.bias")[3] == 0.0f);
  CHECK(a.tensor("lm_head.bias")[64] == 0.0f);
  double sq = 0;
  const auto w = a.tensor("blocks.0.ffwd.net.0.weight");
  for (float v : w) sq += static_cast<double>(v) * v;
  CHECK(std::sqrt(sq / static_cast<double>(w.size())) == doctest::Approx(0.02).epsilon(0.1));
}

TEST_CASE("weights: save then load, extra buffers ignored") {
  temp_dir d("roundtrip");
  const Weights w = random_weights(3);
  save_weights(d.path / "w.safetensors", w);
  const Weights r = load_weights(d.path / "w.safetensors");
  CHECK(r.data == w.data);
  CHECK(r.ignored.empty());

  // A file with the buffers the PyTorch model also saves (tril, kv_indices) loads fine.
  std::vector<replay_examples::tensor_to_write> ts;
  for (const auto& s : tensor_specs())
    ts.push_back({s.name, replay_examples::dtype::F32, s.shape,
                  std::as_bytes(std::span<const float>(w.data.data() + s.offset, s.numel))});
  const std::vector<float> tril(64 * 64, 1.0f);
  std::vector<std::int64_t> idx(64);
  for (int i = 0; i < 64; ++i) idx[static_cast<std::size_t>(i)] = i;
  ts.push_back({"blocks.0.sa.tril", replay_examples::dtype::F32, {64, 64}, std::as_bytes(std::span<const float>(tril))});
  ts.push_back({"blocks.0.sa.kv_indices", replay_examples::dtype::I64, {64},
                std::as_bytes(std::span<const std::int64_t>(idx))});
  replay_examples::write_safetensors(d.path / "sd.safetensors", ts);
  const Weights s = load_weights(d.path / "sd.safetensors");
  CHECK(s.data == w.data);
  CHECK(s.ignored == std::vector<std::string>{"blocks.0.sa.kv_indices", "blocks.0.sa.tril"});
}

TEST_CASE("weights: missing, truncated, wrong shape, wrong dtype, NaN") {
  temp_dir d("bad");
  const Weights w = random_weights(3);
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "nope.safetensors"); }), "no such file"));

  save_weights(d.path / "t.safetensors", w);
  fs::resize_file(d.path / "t.safetensors", fs::file_size(d.path / "t.safetensors") - 100);
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "t.safetensors"); }), "truncated"));

  std::vector<replay_examples::tensor_to_write> ts;
  std::vector<std::uint16_t> bf16(65 * 32, 0);
  for (const auto& s : tensor_specs()) {
    if (s.name == "blocks.1.ln1.bias" || s.name == "ln_f.weight") continue;  // missing
    ts.push_back({s.name, replay_examples::dtype::F32, s.shape,
                  std::as_bytes(std::span<const float>(w.data.data() + s.offset, s.numel))});
  }
  replay_examples::write_safetensors(d.path / "m.safetensors", ts);
  const auto m = error_of([&] { (void)load_weights(d.path / "m.safetensors"); });
  CHECK(contains(m, "missing tensors blocks.1.ln1.bias, ln_f.weight"));
  CHECK(contains(m, "2 of 50 parameters missing"));

  for (auto& t : ts)
    if (t.name == "lm_head.weight") t = {t.name, replay_examples::dtype::BF16, {65, 32}, std::as_bytes(std::span<const std::uint16_t>(bf16))};
  ts.push_back({"blocks.1.ln1.bias", replay_examples::dtype::F32, {32},
                std::as_bytes(std::span<const float>(w.tensor("blocks.1.ln1.bias")))});
  ts.push_back({"ln_f.weight", replay_examples::dtype::F32, {32}, std::as_bytes(std::span<const float>(w.tensor("ln_f.weight")))});
  replay_examples::write_safetensors(d.path / "dt.safetensors", ts);
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "dt.safetensors"); }),
                 "tensor lm_head.weight: expected shape [65, 32] dtype F32, file has [65, 32] BF16"));

  Weights nan = w;
  nan.tensor("ln_f.bias")[0] = std::nanf("");
  save_weights(d.path / "nan.safetensors", nan);
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "nan.safetensors"); }), "NaN"));
}

TEST_CASE("weights: paths that are not regular files are refused at once") {
  temp_dir d("paths");
  REQUIRE(::mkfifo((d.path / "pipe").c_str(), 0600) == 0);  // opening it for reading would block
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "pipe"); }), "is a FIFO (named pipe)"));
  CHECK(contains(error_of([] { (void)load_weights("/dev/zero"); }), "is a character device"));
  fs::create_symlink(d.path / "loop", d.path / "loop");
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "loop"); }), "symbolic link loop"));
  fs::create_directories(d.path / "m" / "model.safetensors");
  CHECK(contains(error_of([&] { (void)load_weights(d.path / "m"); }), "is a directory"));
}
