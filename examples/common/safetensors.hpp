// common/safetensors.hpp: a validating, memory-mapped safetensors reader (and a small writer).
//
// Shared by the example decoders (examples/nanogpt, examples/qwen). Header-only; needs nlohmann-json
// and fmt. The file format (https://huggingface.co/docs/safetensors) is:
//   8 bytes   little-endian u64 N: length of the JSON header
//   N bytes   JSON: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//                    "__metadata__": {"key": "value", ...}}      (metadata optional, string values)
//   rest      the data section; offsets are relative to its start
//
// API (stable: other examples depend on it)
//   namespace replay_examples
//   enum class dtype { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL }
//   std::string_view to_string(dtype);  std::optional<dtype> parse_dtype(std::string_view);
//   std::size_t dtype_size(dtype);                                   // bytes per element
//   class safetensors_error : std::runtime_error                      // every problem of a file
//   struct tensor_view { name, type, shape, data, nbytes, file;      // view into the mapping
//                        numel(), shape_string(), as<T>() -> std::span<const T> (checks dtype) }
//   class safetensors {                                               // move-only
//     static safetensors open(path);   // a .safetensors file, or a directory holding either
//                                      // model.safetensors.index.json (+ shards) or model.safetensors
//     const tensor_view* find(name) const noexcept;                   // nullptr when absent
//     const tensor_view& at(name) const;                              // throws "missing tensor ..."
//     const tensor_view& expect(name, dtype, {shape...}) const;       // at() + check_tensor()
//     std::vector<std::string> names() const;                         // sorted
//     std::size_t size() const; std::size_t file_count() const;
//     const std::map<std::string, std::string>& metadata() const;    // merged __metadata__
//     const std::filesystem::path& path() const;
//   }
//   void check_tensor(const tensor_view&, dtype, std::span<const std::int64_t> shape);
//       throws "tensor X: expected shape [a, b] dtype F32, file has [c, d] BF16"
//   struct tensor_to_write { name, type, shape, std::span<const std::byte> bytes };
//   void write_safetensors(path, std::span<const tensor_to_write>, metadata = {});
//
// What open() validates, each with a message naming the file (and tensor):
//   - every file is a regular file, checked before it is opened (a FIFO, device or directory is
//     refused without blocking; common/input_file.hpp), and files of a model directory (the index,
//     model.safetensors, every shard) resolve inside that directory, symbolic links followed;
//   - the file is at least 8 bytes and the header length fits in the file (else "truncated");
//   - the header is strict JSON (common/input_file.hpp's parse_json: at most 64 levels deep, no
//     duplicate keys, no number overflow), an object, each entry an object with exactly a known
//     dtype string, a shape of non-negative integers and data_offsets [begin, end], begin <= end;
//   - end - begin == product(shape) * dtype_size, computed with overflow checks;
//   - every tensor's bytes lie inside the file (else "truncated"), and no two tensors overlap;
//   - for a sharded directory: the index is strict JSON with a "weight_map", every shard it names
//     is a plain file name that exists and holds exactly the tensors the index puts there, and no
//     tensor appears in two shards.
//
// Guarantees: the mapping is read-only and lives as long as the `safetensors` object (tensor_view
// pointers into it are valid until then); a moved-from object is empty. Tensor data of a file
// written by the Python `safetensors` package is 8-byte aligned in memory (its header is padded);
// as<T>() checks alignment and throws if a file is not.
//
// Example:
//   auto st = replay_examples::safetensors::open("weights/model.safetensors");
//   const auto& w = st.expect("lm_head.weight", replay_examples::dtype::F32, {65, 32});
//   std::span<const float> values = w.as<float>();
#pragma once

#include "input_file.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace replay_examples {

/// Element types of the safetensors format.
enum class dtype { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

namespace detail {
struct dtype_info {
  dtype type;
  std::string_view name;
  std::size_t size;
};
inline constexpr dtype_info dtype_table[] = {
    {dtype::F64, "F64", 8},         {dtype::F32, "F32", 4},         {dtype::F16, "F16", 2},
    {dtype::BF16, "BF16", 2},       {dtype::F8_E4M3, "F8_E4M3", 1}, {dtype::F8_E5M2, "F8_E5M2", 1},
    {dtype::I64, "I64", 8},         {dtype::I32, "I32", 4},         {dtype::I16, "I16", 2},
    {dtype::I8, "I8", 1},           {dtype::U64, "U64", 8},         {dtype::U32, "U32", 4},
    {dtype::U16, "U16", 2},         {dtype::U8, "U8", 1},           {dtype::BOOL, "BOOL", 1},
};
}  // namespace detail

/// The format's name of a dtype ("F32", "BF16", ...).
constexpr std::string_view to_string(dtype t) noexcept {
  for (const auto& i : detail::dtype_table)
    if (i.type == t) return i.name;
  return "?";
}
/// Bytes per element.
constexpr std::size_t dtype_size(dtype t) noexcept {
  for (const auto& i : detail::dtype_table)
    if (i.type == t) return i.size;
  return 0;
}
/// The dtype with this format name, or nullopt.
constexpr std::optional<dtype> parse_dtype(std::string_view name) noexcept {
  for (const auto& i : detail::dtype_table)
    if (i.name == name) return i.type;
  return std::nullopt;
}

/// The C++ type that stands for a dtype in tensor_view::as<T>() (F16/BF16 as raw std::uint16_t).
template <class T>
constexpr bool dtype_matches(dtype t) noexcept {
  if constexpr (std::is_same_v<T, float>) return t == dtype::F32;
  else if constexpr (std::is_same_v<T, double>) return t == dtype::F64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return t == dtype::I64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return t == dtype::I32;
  else if constexpr (std::is_same_v<T, std::int16_t>) return t == dtype::I16;
  else if constexpr (std::is_same_v<T, std::int8_t>) return t == dtype::I8;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return t == dtype::U64;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return t == dtype::U32;
  else if constexpr (std::is_same_v<T, std::uint16_t>)
    return t == dtype::U16 || t == dtype::F16 || t == dtype::BF16;
  else if constexpr (std::is_same_v<T, std::uint8_t>)
    return t == dtype::U8 || t == dtype::BOOL || t == dtype::F8_E4M3 || t == dtype::F8_E5M2;
  else if constexpr (std::is_same_v<T, std::byte>) return true;
  else return false;
}

/// Every problem with a safetensors file or directory: the message names the file and the tensor.
class safetensors_error : public file_error {
 public:
  using file_error::file_error;
  explicit safetensors_error(const file_error& e) : file_error(e.what()) {}
};

/// "[65, 32]"
inline std::string shape_to_string(std::span<const std::int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

/// One tensor: a view into the memory-mapped file. Valid while its `safetensors` object lives.
struct tensor_view {
  std::string name;                ///< tensor name as stored in the header
  dtype type = dtype::F32;         ///< element type
  std::vector<std::int64_t> shape; ///< dimensions, outermost first (row-major)
  const std::byte* data = nullptr; ///< first byte of the tensor's data in the mapping
  std::size_t nbytes = 0;          ///< size of the data in bytes (== numel() * dtype_size(type))
  std::string file;                ///< the file it lives in (for messages)

  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  [[nodiscard]] std::string shape_string() const { return shape_to_string(shape); }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data, nbytes}; }

  /// The data as elements of T; throws safetensors_error on a dtype mismatch or misalignment.
  template <class T>
  [[nodiscard]] std::span<const T> as() const {
    if (!dtype_matches<T>(type))
      throw safetensors_error(fmt::format("{}: tensor {} has dtype {}, read as a {}-byte type", file,
                                          name, to_string(type), sizeof(T)));
    if (reinterpret_cast<std::uintptr_t>(data) % alignof(T) != 0)
      throw safetensors_error(fmt::format("{}: tensor {} is not {}-byte aligned in the file", file,
                                          name, alignof(T)));
    return {reinterpret_cast<const T*>(data), nbytes / sizeof(T)};
  }
};

/// Throws "tensor X: expected shape [..] dtype F32, file has [..] BF16" unless `t` matches.
inline void check_tensor(const tensor_view& t, dtype expected_type,
                         std::span<const std::int64_t> expected_shape) {
  const bool shape_ok = std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(),
                                   expected_shape.end());
  if (shape_ok && t.type == expected_type) return;
  throw safetensors_error(fmt::format("tensor {}: expected shape {} dtype {}, file has {} {} ({})",
                                      t.name, shape_to_string(expected_shape),
                                      to_string(expected_type), t.shape_string(),
                                      to_string(t.type), t.file));
}

namespace detail {

/// A read-only memory mapping of a whole file. Move-only.
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::filesystem::path& path) : path_(path.string()) {
    int fd = -1;
    try {
      fd = open_regular_file(path);
    } catch (const file_error& e) {
      throw safetensors_error(e);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw safetensors_error(fmt::format("{}: cannot stat: {}", path_, std::strerror(e)));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ != 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw safetensors_error(fmt::format("{}: mmap failed: {}", path_, std::strerror(e)));
      }
      data_ = static_cast<const std::byte*>(p);
    }
    ::close(fd);
  }
  mapped_file(mapped_file&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  mapped_file& operator=(mapped_file&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file() { unmap(); }

  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  void unmap() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }
  std::string path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Largest header we accept (the Python package refuses more than 100 MB too).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

/// a * b, or nullopt when it overflows 64 bits.
inline std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// Parses and validates the header of a safetensors file held in `bytes` (the whole file); appends
/// its tensors (pointing into `bytes`) to `out`. `file` names it in messages.
inline void parse_header(std::span<const std::byte> bytes, const std::string& file, std::vector<tensor_view>& out,
                         std::map<std::string, std::string>& metadata) {
  if (bytes.size() < 8)
    throw safetensors_error(fmt::format(
        "{}: truncated: the file is {} bytes, a safetensors file starts with an 8-byte header length",
        file, bytes.size()));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[static_cast<std::size_t>(i)]);
  if (n > max_header_bytes)
    throw safetensors_error(fmt::format("{}: header length {} is implausible (limit {}); not a "
                                        "safetensors file?",
                                        file, n, max_header_bytes));
  if (n > bytes.size() - 8)
    throw safetensors_error(fmt::format("{}: truncated: the header needs {} bytes but the file has "
                                        "only {} after the length field",
                                        file, n, bytes.size() - 8));
  const char* hdr = reinterpret_cast<const char*>(bytes.data() + 8);
  nlohmann::json j;
  try {
    j = parse_json(std::string_view(hdr, static_cast<std::size_t>(n)), file + ": the header");
  } catch (const file_error& e) {
    throw safetensors_error(e);
  }
  if (!j.is_object())
    throw safetensors_error(fmt::format("{}: the header is JSON but not an object", file));

  const std::byte* data_section = bytes.data() + 8 + n;
  const std::uint64_t data_size = bytes.size() - 8 - n;
  const std::size_t first = out.size();
  for (const auto& item : j.items()) {
    const std::string& name = item.key();  // (not a structured binding: the lambda below captures it)
    const nlohmann::json& entry = item.value();
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw safetensors_error(fmt::format("{}: __metadata__ is not an object", file));
      for (const auto& [k, v] : entry.items())
        metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
      continue;
    }
    const auto bad = [&](std::string_view why) {
      return safetensors_error(fmt::format("{}: tensor {}: {}", file, name, why));
    };
    if (name.empty()) throw bad("the tensor name is empty");
    if (!entry.is_object()) throw bad("entry is not an object");
    const auto dt = entry.find("dtype");
    const auto sh = entry.find("shape");
    const auto off = entry.find("data_offsets");
    if (dt == entry.end() || !dt->is_string()) throw bad("missing or non-string \"dtype\"");
    if (sh == entry.end() || !sh->is_array()) throw bad("missing or non-array \"shape\"");
    if (off == entry.end() || !off->is_array() || off->size() != 2)
      throw bad("\"data_offsets\" must be an array [begin, end]");
    for (const auto& [key, value] : entry.items())
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        throw bad(fmt::format("unknown field \"{}\" (a tensor has dtype, shape and data_offsets)", key));
    const auto type = parse_dtype(dt->get<std::string>());
    if (!type)
      throw bad(fmt::format("unknown dtype \"{}\" (known: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 "
                            "I16 I8 U64 U32 U16 U8 BOOL)",
                            dt->get<std::string>()));
    tensor_view t;
    t.name = name;
    t.type = *type;
    t.file = file;
    // The element count and the byte size are computed with overflow checks: a shape such as
    // [4294967296, 4294967296] must not wrap to a small number that matches the offsets.
    std::optional<std::uint64_t> numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_integer() || (d.is_number_unsigned() ? d.get<std::uint64_t>() > INT64_MAX
                                                             : d.get<std::int64_t>() < 0))
        throw bad(fmt::format("shape {} has a dimension that is not a non-negative integer", sh->dump()));
      t.shape.push_back(d.get<std::int64_t>());
      if (numel) numel = checked_mul(*numel, static_cast<std::uint64_t>(t.shape.back()));
    }
    const std::optional<std::uint64_t> expected = numel ? checked_mul(*numel, dtype_size(*type)) : std::nullopt;
    if (!expected || *expected > static_cast<std::uint64_t>(INT64_MAX))
      throw bad(fmt::format("shape {} of {} has more bytes than 2^63 (the element count or byte size overflows)",
                            t.shape_string(), to_string(*type)));
    for (const auto& o : *off)
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<std::int64_t>() >= 0))
        throw bad(fmt::format("data_offsets {} are not non-negative integers", off->dump()));
    const auto begin = (*off)[0].get<std::uint64_t>();
    const auto end = (*off)[1].get<std::uint64_t>();
    if (begin > end) throw bad(fmt::format("data_offsets [{}, {}]: begin after end", begin, end));
    if (end - begin != *expected)
      throw bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {}",
                            t.shape_string(), to_string(*type), *expected, begin, end, end - begin));
    if (end > data_size)
      throw bad(fmt::format("truncated: needs bytes [{}, {}) of the data section but the file has "
                            "only {}",
                            begin, end, data_size));
    t.data = data_section + begin;
    t.nbytes = static_cast<std::size_t>(end - begin);
    out.push_back(std::move(t));
  }
  // No two tensors of this file may share bytes (empty tensors share none).
  std::vector<const tensor_view*> sorted;
  for (std::size_t i = first; i < out.size(); ++i)
    if (out[i].nbytes != 0) sorted.push_back(&out[i]);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (std::size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i - 1]->data + sorted[i - 1]->nbytes > sorted[i]->data)
      throw safetensors_error(fmt::format("{}: tensors {} and {} overlap in the data section", file,
                                          sorted[i - 1]->name, sorted[i]->name));
}

/// parse_header() of a mapped file.
inline void parse_header(const mapped_file& f, std::vector<tensor_view>& out,
                         std::map<std::string, std::string>& metadata) {
  parse_header(std::span<const std::byte>(f.data(), f.size()), f.path(), out, metadata);
}

/// Largest index file (model.safetensors.index.json) we read.
inline constexpr std::size_t max_index_bytes = 64u << 20;

}  // namespace detail

/// A set of tensors from one safetensors file or a Hugging Face model directory (single file or
/// sharded with model.safetensors.index.json). Move-only; a moved-from object is empty.
class safetensors {
 public:
  safetensors() = default;
  safetensors(safetensors&&) noexcept = default;
  safetensors& operator=(safetensors&&) noexcept = default;
  safetensors(const safetensors&) = delete;
  safetensors& operator=(const safetensors&) = delete;

  /// Opens and validates `path`: a file, or a directory with model.safetensors.index.json (sharded)
  /// or model.safetensors. Throws safetensors_error with a message naming the file on any problem.
  [[nodiscard]] static safetensors open(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0)
      throw safetensors_error(fmt::format("{}: cannot open: {}", path.string(), detail::describe_errno(errno)));
    safetensors st;
    st.path_ = path;
    if (!S_ISDIR(info.st_mode)) {
      st.add_file(path);  // refuses FIFOs, devices and sockets
      st.index();
      return st;
    }
    // Files of a model directory must resolve inside it (file_in_directory).
    const auto in_dir = [&](std::string_view name) -> std::optional<fs::path> {
      struct stat s {};
      if (::lstat((path / std::string(name)).c_str(), &s) != 0) return std::nullopt;
      try {
        return file_in_directory(path, name);
      } catch (const file_error& e) {
        throw safetensors_error(e);
      }
    };
    if (const auto index_path = in_dir("model.safetensors.index.json")) {
      st.open_sharded(path, *index_path);
    } else if (const auto single = in_dir("model.safetensors")) {
      st.add_file(*single);
      st.index();
    } else {
      throw safetensors_error(fmt::format("{}: directory has neither model.safetensors.index.json "
                                          "nor model.safetensors",
                                          path.string()));
    }
    return st;
  }

  /// The tensor called `name`, or nullptr.
  [[nodiscard]] const tensor_view* find(std::string_view name) const noexcept {
    const auto it = by_name_.find(std::string(name));
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
  }
  /// The tensor called `name`; throws "missing tensor NAME in FILE (N tensors; similar: ...)".
  [[nodiscard]] const tensor_view& at(std::string_view name) const {
    if (const tensor_view* t = find(name)) return *t;
    // Suggest names sharing the longest prefix, to make typos and naming-scheme mismatches obvious.
    std::vector<std::pair<std::size_t, std::string_view>> scored;
    for (const auto& t : tensors_) {
      std::size_t k = 0;
      while (k < t.name.size() && k < name.size() && t.name[k] == name[k]) ++k;
      scored.emplace_back(k, t.name);
    }
    std::sort(scored.begin(), scored.end(), [](auto& a, auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    std::vector<std::string_view> similar;
    for (std::size_t i = 0; i < scored.size() && i < 3; ++i) similar.push_back(scored[i].second);
    throw safetensors_error(fmt::format("missing tensor {} in {} ({} tensors{}{})", name,
                                        path_.string(), tensors_.size(),
                                        similar.empty() ? "" : "; closest: ", fmt::join(similar, ", ")));
  }
  /// at(name) and check_tensor(type, shape).
  const tensor_view& expect(std::string_view name, dtype type, std::span<const std::int64_t> shape) const {
    const tensor_view& t = at(name);
    check_tensor(t, type, shape);
    return t;
  }
  const tensor_view& expect(std::string_view name, dtype type,
                            std::initializer_list<std::int64_t> shape) const {
    return expect(name, type, std::span<const std::int64_t>(shape.begin(), shape.size()));
  }

  /// All tensor names, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> v;
    v.reserve(by_name_.size());
    for (const auto& [n, i] : by_name_) v.push_back(n);
    return v;
  }
  [[nodiscard]] const std::vector<tensor_view>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::size_t size() const noexcept { return tensors_.size(); }
  [[nodiscard]] std::size_t file_count() const noexcept { return files_.size(); }
  /// __metadata__ of all files merged (later shards win), plus the index's "metadata" if sharded.
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void add_file(const std::filesystem::path& p) {
    files_.push_back(std::make_unique<detail::mapped_file>(p));
    detail::parse_header(*files_.back(), tensors_, metadata_);
  }
  void index() {
    by_name_.clear();
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto [it, inserted] = by_name_.emplace(tensors_[i].name, i);
      if (!inserted)
        throw safetensors_error(fmt::format("tensor {} appears twice: in {} and in {}", tensors_[i].name,
                                            tensors_[it->second].file, tensors_[i].file));
    }
  }
  void open_sharded(const std::filesystem::path& dir, const std::filesystem::path& index_path) {
    const std::string ip = index_path.string();
    nlohmann::json j;
    try {
      j = parse_json(read_small_file(index_path, detail::max_index_bytes), ip);
    } catch (const file_error& e) {
      throw safetensors_error(e);
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw safetensors_error(fmt::format("{}: no \"weight_map\" object", ip));
    if (j.contains("metadata") && j["metadata"].is_object())
      for (const auto& [k, v] : j["metadata"].items())
        metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
    std::map<std::string, std::set<std::string>> shards;  // shard file -> tensors it should hold
    for (const auto& [name, shard] : j["weight_map"].items()) {
      if (!shard.is_string())
        throw safetensors_error(fmt::format("{}: weight_map entry {} is not a file name", ip, name));
      shards[shard.get<std::string>()].insert(name);
    }
    if (shards.empty()) throw safetensors_error(fmt::format("{}: weight_map is empty", ip));
    // Every shard name is checked (plain name, exists, inside the directory) before any is opened.
    std::vector<std::filesystem::path> paths;
    for (const auto& [file, names] : shards) {
      const std::string holding =
          fmt::format("holding {}{}", *names.begin(),
                      names.size() > 1 ? fmt::format(" and {} more", names.size() - 1) : std::string());
      struct stat link {};
      if (file.find('/') == std::string::npos && !file.empty() && file != "." && file != ".." &&
          ::lstat((dir / file).c_str(), &link) != 0 && errno == ENOENT)
        throw safetensors_error(fmt::format("{}: shard {} ({}) does not exist", ip, (dir / file).string(), holding));
      try {
        paths.push_back(file_in_directory(dir, file));
        ::close(open_regular_file(paths.back()));
      } catch (const file_error& e) {
        throw safetensors_error(fmt::format("{}: shard {} ({}): {}", ip, file, holding, e.what()));
      }
    }
    std::size_t k = 0;
    for (const auto& [file, names] : shards) {
      const std::filesystem::path& p = paths[k++];
      const std::size_t before = tensors_.size();
      add_file(p);
      // Every tensor of the shard must be one the index places there.
      for (std::size_t i = before; i < tensors_.size(); ++i)
        if (!names.contains(tensors_[i].name))
          throw safetensors_error(fmt::format("{}: holds tensor {}, which the weight_map of {} does not list "
                                              "in this shard",
                                              p.string(), tensors_[i].name, ip));
    }
    index();
    for (const auto& [file, names] : shards)
      for (const auto& name : names)
        if (find(name) == nullptr)
          throw safetensors_error(fmt::format("missing tensor {}: {} places it in {} but that shard "
                                              "does not hold it",
                                              name, ip, file));
  }

  std::filesystem::path path_;
  std::vector<std::unique_ptr<detail::mapped_file>> files_;
  std::vector<tensor_view> tensors_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

/// One tensor for write_safetensors(): `bytes` must hold product(shape) * dtype_size(type) bytes.
struct tensor_to_write {
  std::string name;
  dtype type = dtype::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> bytes;
};

/// Writes a safetensors file: header entries in the given order, data sorted by decreasing element
/// size and the header padded to 8 bytes with spaces (like the Python package), so every tensor is
/// aligned to its element size in a mapping. Throws safetensors_error.
inline void write_safetensors(const std::filesystem::path& path, std::span<const tensor_to_write> tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  // Data goes in order of decreasing element size (as the Python package does), so that every
  // tensor is aligned to its element size when the header length is a multiple of 8.
  std::vector<const tensor_to_write*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](auto* a, auto* b) { return dtype_size(a->type) > dtype_size(b->type); });
  std::uint64_t offset = 0;
  for (const tensor_to_write* tp : order) {
    const tensor_to_write& t = *tp;
    std::uint64_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<std::uint64_t>(d);
    if (numel * dtype_size(t.type) != t.bytes.size())
      throw safetensors_error(fmt::format("write {}: tensor {} shape {} {} needs {} bytes, given {}",
                                          path.string(), t.name, shape_to_string(t.shape),
                                          to_string(t.type), numel * dtype_size(t.type), t.bytes.size()));
    h[t.name] = {{"dtype", std::string(to_string(t.type))},
                 {"shape", t.shape},
                 {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string header = h.dump();
  while (header.size() % 8 != 0) header.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw safetensors_error(fmt::format("{}: cannot create", path.string()));
  std::uint64_t n = header.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out.write(len, 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const tensor_to_write* t : order)
    out.write(reinterpret_cast<const char*>(t->bytes.data()), static_cast<std::streamsize>(t->bytes.size()));
  if (!out) throw safetensors_error(fmt::format("{}: write failed", path.string()));
}

/// Bytes of a contiguous container (for tensor_to_write::bytes).
template <class T>
std::span<const std::byte> as_bytes_of(std::span<const T> v) noexcept {
  return std::as_bytes(v);
}

}  // namespace replay_examples
