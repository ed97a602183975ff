// Host tests for common/safetensors.hpp: round trip, validation messages, sharded directories.
#include "common/safetensors.hpp"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace replay_examples;

namespace {

/// A fresh empty directory under the system temp dir, removed at scope exit.
struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& tag) {
    path = fs::temp_directory_path() / fmt::format("replay_st_{}_{}", tag, ::getpid());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<float> iota_f(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

/// Writes a raw file: 8-byte length + header + data bytes.
void write_raw(const fs::path& p, const std::string& header, std::size_t data_bytes,
               std::int64_t length_override = -1) {
  std::ofstream out(p, std::ios::binary);
  const std::uint64_t n = length_override >= 0 ? static_cast<std::uint64_t>(length_override) : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out << header;
  for (std::size_t i = 0; i < data_bytes; ++i) out.put('\0');
}

std::string error_of(const fs::path& p) {
  try {
    (void)safetensors::open(p);
  } catch (const safetensors_error& e) {
    return e.what();
  }
  return "<no error>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("dtype names and sizes") {
  CHECK(parse_dtype("BF16") == dtype::BF16);
  CHECK(parse_dtype("F32") == dtype::F32);
  CHECK(parse_dtype("I64") == dtype::I64);
  CHECK_FALSE(parse_dtype("float32").has_value());
  CHECK(dtype_size(dtype::BF16) == 2);
  CHECK(dtype_size(dtype::F64) == 8);
  CHECK(to_string(dtype::I32) == "I32");
}

TEST_CASE("write then read a file: values, shapes, metadata, alignment") {
  temp_dir d("roundtrip");
  const auto a = iota_f(6, 1.0f);
  const std::vector<std::uint16_t> b = {0x3F80, 0x4000, 0x4040};  // bf16 1, 2, 3
  const std::vector<std::int64_t> c = {7, -8};
  const std::vector<tensor_to_write> ts = {
      {"layer.weight", dtype::F32, {2, 3}, std::as_bytes(std::span<const float>(a))},
      {"emb", dtype::BF16, {3}, std::as_bytes(std::span<const std::uint16_t>(b))},
      {"idx", dtype::I64, {2}, std::as_bytes(std::span<const std::int64_t>(c))},
  };
  write_safetensors(d.path / "m.safetensors", ts, {{"format", "pt"}});
  const auto st = safetensors::open(d.path / "m.safetensors");
  CHECK(st.size() == 3);
  CHECK(st.file_count() == 1);
  CHECK(st.metadata().at("format") == "pt");
  CHECK(st.names() == std::vector<std::string>{"emb", "idx", "layer.weight"});
  const auto& w = st.expect("layer.weight", dtype::F32, {2, 3});
  CHECK(w.numel() == 6);
  const auto f = w.as<float>();
  REQUIRE(f.size() == 6);
  CHECK(f[0] == 1.0f);
  CHECK(f[5] == 6.0f);
  CHECK(st.at("emb").as<std::uint16_t>()[2] == 0x4040);
  CHECK(st.at("idx").as<std::int64_t>()[1] == -8);
  CHECK(st.find("nope") == nullptr);
  CHECK_THROWS_AS((void)st.at("emb").as<float>(), safetensors_error);
}

TEST_CASE("missing tensor names the tensor, the file and close names") {
  temp_dir d("missing");
  const auto a = iota_f(4, 0.0f);
  const std::vector<tensor_to_write> ts = {
      {"blocks.0.ln1.weight", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
  write_safetensors(d.path / "m.safetensors", ts);
  const auto st = safetensors::open(d.path / "m.safetensors");
  try {
    (void)st.at("blocks.0.ln2.weight");
    FAIL("expected an exception");
  } catch (const safetensors_error& e) {
    const std::string m = e.what();
    CHECK(contains(m, "missing tensor blocks.0.ln2.weight"));
    CHECK(contains(m, "m.safetensors"));
    CHECK(contains(m, "blocks.0.ln1.weight"));
  }
}

TEST_CASE("wrong shape or dtype: expected vs found") {
  temp_dir d("shape");
  const std::vector<std::uint16_t> b(6, 0);
  const std::vector<tensor_to_write> ts = {
      {"lm_head.weight", dtype::BF16, {3, 2}, std::as_bytes(std::span<const std::uint16_t>(b))}};
  write_safetensors(d.path / "m.safetensors", ts);
  const auto st = safetensors::open(d.path / "m.safetensors");
  try {
    (void)st.expect("lm_head.weight", dtype::F32, {65, 32});
    FAIL("expected an exception");
  } catch (const safetensors_error& e) {
    CHECK(std::string(e.what()).starts_with(
        "tensor lm_head.weight: expected shape [65, 32] dtype F32, file has [3, 2] BF16"));
  }
  CHECK_THROWS_AS((void)st.expect("lm_head.weight", dtype::BF16, {2, 3}), safetensors_error);
  CHECK_NOTHROW((void)st.expect("lm_head.weight", dtype::BF16, {3, 2}));
}

TEST_CASE("truncated files") {
  temp_dir d("trunc");
  SUBCASE("shorter than the length field") {
    std::ofstream(d.path / "a.safetensors", std::ios::binary) << "abc";
    const auto m = error_of(d.path / "a.safetensors");
    CHECK(contains(m, "truncated"));
    CHECK(contains(m, "a.safetensors"));
  }
  SUBCASE("header longer than the file") {
    write_raw(d.path / "b.safetensors", "{}", 0, 4096);
    CHECK(contains(error_of(d.path / "b.safetensors"), "truncated: the header needs 4096 bytes"));
  }
  SUBCASE("data section cut short") {
    const auto a = iota_f(64, 0.0f);
    const std::vector<tensor_to_write> ts = {
        {"w", dtype::F32, {8, 8}, std::as_bytes(std::span<const float>(a))}};
    write_safetensors(d.path / "c.safetensors", ts);
    fs::resize_file(d.path / "c.safetensors", fs::file_size(d.path / "c.safetensors") - 10);
    const auto m = error_of(d.path / "c.safetensors");
    CHECK(contains(m, "tensor w: truncated"));
  }
  SUBCASE("empty file") {
    std::ofstream(d.path / "e.safetensors", std::ios::binary);
    CHECK(contains(error_of(d.path / "e.safetensors"), "truncated"));
  }
}

TEST_CASE("bad headers") {
  temp_dir d("bad");
  SUBCASE("not JSON") {
    write_raw(d.path / "x.safetensors", "{\"w\": {\"dtype\": ", 0);
    CHECK(contains(error_of(d.path / "x.safetensors"), "not valid JSON"));
  }
  SUBCASE("JSON but not an object") {
    write_raw(d.path / "x.safetensors", "[1, 2]  ", 0);
    CHECK(contains(error_of(d.path / "x.safetensors"), "not an object"));
  }
  SUBCASE("unknown dtype") {
    write_raw(d.path / "x.safetensors",
              R"({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}})", 4);
    CHECK(contains(error_of(d.path / "x.safetensors"), "unknown dtype \"F33\""));
  }
  SUBCASE("shape does not match byte size") {
    write_raw(d.path / "x.safetensors",
              R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 20);
    const auto m = error_of(d.path / "x.safetensors");
    CHECK(contains(m, "tensor w"));
    CHECK(contains(m, "needs 24 bytes"));
  }
  SUBCASE("negative dimension") {
    write_raw(d.path / "x.safetensors",
              R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4);
    CHECK(contains(error_of(d.path / "x.safetensors"), "non-negative"));
  }
  SUBCASE("begin after end") {
    write_raw(d.path / "x.safetensors",
              R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8);
    CHECK(contains(error_of(d.path / "x.safetensors"), "begin after end"));
  }
  SUBCASE("overlapping tensors") {
    write_raw(d.path / "x.safetensors",
              R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
              12);
    CHECK(contains(error_of(d.path / "x.safetensors"), "overlap"));
  }
  SUBCASE("missing file") {
    CHECK(contains(error_of(d.path / "nope.safetensors"), "no such file"));
  }
}

TEST_CASE("directories: single model.safetensors and a sharded index") {
  temp_dir d("dir");
  const auto a = iota_f(4, 1.0f);
  const auto b = iota_f(2, 10.0f);
  SUBCASE("single file") {
    const std::vector<tensor_to_write> ts = {{"a", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
    write_safetensors(d.path / "model.safetensors", ts);
    const auto st = safetensors::open(d.path);
    CHECK(st.at("a").as<float>()[3] == 4.0f);
  }
  SUBCASE("sharded") {
    const std::vector<tensor_to_write> s1 = {{"a", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
    const std::vector<tensor_to_write> s2 = {{"b", dtype::F32, {2}, std::as_bytes(std::span<const float>(b))}};
    write_safetensors(d.path / "model-00001-of-00002.safetensors", s1);
    write_safetensors(d.path / "model-00002-of-00002.safetensors", s2);
    std::ofstream(d.path / "model.safetensors.index.json")
        << R"({"metadata": {"total_size": 24}, "weight_map": {"a": "model-00001-of-00002.safetensors",
              "b": "model-00002-of-00002.safetensors"}})";
    const auto st = safetensors::open(d.path);
    CHECK(st.file_count() == 2);
    CHECK(st.size() == 2);
    CHECK(st.at("b").as<float>()[1] == 11.0f);
    CHECK(st.metadata().at("total_size") == "24");
  }
  SUBCASE("index names a tensor its shard lacks") {
    const std::vector<tensor_to_write> s1 = {{"a", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
    write_safetensors(d.path / "s1.safetensors", s1);
    std::ofstream(d.path / "model.safetensors.index.json")
        << R"({"weight_map": {"a": "s1.safetensors", "c": "s1.safetensors"}})";
    CHECK(contains(error_of(d.path), "missing tensor c"));
  }
  SUBCASE("index names a shard that does not exist") {
    std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "gone.safetensors"}})";
    CHECK(contains(error_of(d.path), "does not exist"));
  }
  SUBCASE("a tensor in two shards") {
    const std::vector<tensor_to_write> s1 = {{"a", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
    write_safetensors(d.path / "s1.safetensors", s1);
    write_safetensors(d.path / "s2.safetensors", s1);
    std::ofstream(d.path / "model.safetensors.index.json")
        << R"({"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors"}})";
    CHECK(contains(error_of(d.path), "holds tensor a, which the weight_map"));
  }
  SUBCASE("index is not JSON") {
    std::ofstream(d.path / "model.safetensors.index.json") << "{weight_map";
    CHECK(contains(error_of(d.path), "not valid JSON"));
  }
  SUBCASE("empty directory") {
    CHECK(contains(error_of(d.path), "neither"));
  }
}

TEST_CASE("hostile headers: nesting, duplicate keys, number overflow, wrapping shapes") {
  temp_dir d("hostile");
  const auto x = d.path / "x.safetensors";
  SUBCASE("metadata nested 100,000 arrays deep is refused without recursion") {
    write_raw(x, R"({"__metadata__": {"k": )" + std::string(100000, '[') + std::string(100000, ']') + "}}", 0);
    CHECK(contains(error_of(x), "nested more than 64 levels"));
  }
  SUBCASE("64 levels are fine") {
    write_raw(x, R"({"__metadata__": {"k": )" + std::string(62, '[') + std::string(62, ']') + "}}", 0);
    CHECK(safetensors::open(x).metadata().at("k").size() == 124);
  }
  SUBCASE("duplicate tensor name") {
    write_raw(x, R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                    "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})", 2);
    CHECK(contains(error_of(x), "key \"w\" appears twice"));
  }
  SUBCASE("number overflow names the file") {
    write_raw(x, R"({"__metadata__": {"k": 1e309}})", 0);
    const auto m = error_of(x);
    CHECK(contains(m, x.string()));
    CHECK(contains(m, "1e309 is out of range"));
  }
  SUBCASE("element count that wraps to zero") {
    write_raw(x, R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0);
    CHECK(contains(error_of(x), "overflows"));
  }
  SUBCASE("byte size that wraps") {
    write_raw(x, R"({"w": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 0]}})", 0);
    CHECK(contains(error_of(x), "overflows"));
  }
  SUBCASE("unknown field in an entry") {
    write_raw(x, R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "scale": 2}})", 1);
    CHECK(contains(error_of(x), "unknown field \"scale\""));
  }
}

TEST_CASE("hostile paths: FIFOs, devices, directories, symbolic links") {
  temp_dir d("paths");
  const auto a = iota_f(4, 1.0f);
  const std::vector<tensor_to_write> ts = {{"a", dtype::F32, {4}, std::as_bytes(std::span<const float>(a))}};
  SUBCASE("a FIFO is refused without blocking") {
    REQUIRE(::mkfifo((d.path / "pipe").c_str(), 0600) == 0);
    CHECK(contains(error_of(d.path / "pipe"), "is a FIFO (named pipe), expected a regular file"));
  }
  SUBCASE("a character device") {
    CHECK(contains(error_of("/dev/null"), "is a character device"));
  }
  SUBCASE("model.safetensors that is a directory") {
    fs::create_directories(d.path / "model.safetensors");
    CHECK(contains(error_of(d.path), "is a directory"));
  }
  SUBCASE("a symbolic link loop") {
    fs::create_symlink(d.path / "b", d.path / "a");
    fs::create_symlink(d.path / "a", d.path / "b");
    CHECK(contains(error_of(d.path / "a"), "symbolic link loop"));
  }
  SUBCASE("a shard that links out of the model directory") {
    fs::create_directories(d.path / "m");
    write_safetensors(d.path / "outside.safetensors", ts);
    fs::create_symlink(d.path / "outside.safetensors", d.path / "m" / "s1.safetensors");
    std::ofstream(d.path / "m" / "model.safetensors.index.json") << R"({"weight_map": {"a": "s1.safetensors"}})";
    CHECK(contains(error_of(d.path / "m"), "outside the directory"));
  }
  SUBCASE("a shard that links inside the model directory is fine") {
    write_safetensors(d.path / "real.safetensors", ts);
    fs::create_symlink("real.safetensors", d.path / "s1.safetensors");
    std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "s1.safetensors"}})";
    CHECK(safetensors::open(d.path).size() == 1);
  }
  SUBCASE("a shard name with a path") {
    std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "../x/s1.safetensors"}})";
    CHECK(contains(error_of(d.path), "not a plain file name"));
  }
  SUBCASE("a shard tensor the weight_map does not list") {
    const auto b = iota_f(2, 0.0f);
    std::vector<tensor_to_write> two = ts;
    two.push_back({"b", dtype::F32, {2}, std::as_bytes(std::span<const float>(b))});
    write_safetensors(d.path / "s1.safetensors", two);
    std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "s1.safetensors"}})";
    CHECK(contains(error_of(d.path), "holds tensor b, which the weight_map"));
  }
}

TEST_CASE("parse_json: strict JSON with limits") {
  CHECK(parse_json(R"({"a": [1, {"b": 2}]})", "t")["a"][1]["b"] == 2);
  const auto err = [](std::string_view text) {
    try {
      (void)parse_json(text, "src.json");
    } catch (const file_error& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  CHECK(contains(err(R"({"a": 1, "a": 2})"), "src.json: not valid JSON: key \"a\" appears twice"));
  CHECK(contains(err(R"({"a": {"b": 1}, "c": {"b": 2}})"), "<no error>"));  // same key, different objects
  CHECK(contains(err(std::string(65, '[') + std::string(65, ']')), "nested more than 64 levels"));
  CHECK(contains(err("[-1e309]"), "out of range"));
  CHECK(contains(err("{} x"), "src.json: not valid JSON"));
}
