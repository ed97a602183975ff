// common/input_file.hpp: reading files a user hands to an example (weights, config.json, an index)
// without trusting them.
//
// Shared by the example decoders and by common/safetensors.hpp. Header-only; needs nlohmann-json and
// fmt. Every function throws replay_examples::file_error with a message that names the file and the
// problem; none of them blocks, recurses on the input, or reads more than its limit.
//
// API
//   class file_error : std::runtime_error                 // every problem below
//   int open_regular_file(path)                             // O_RDONLY fd of a regular file
//   std::string read_small_file(path, max_bytes)            // the whole file (a config, an index)
//   std::filesystem::path file_in_directory(dir, name)      // dir/name, resolved, still inside dir
//   nlohmann::json parse_json(text, source, max_depth = 64) // strict JSON (see below)
//
// What they guarantee
//   - open_regular_file() checks with stat() that the path is a regular file before it opens it, and
//     opens with O_NONBLOCK, so a FIFO, a device, a socket or a directory is refused at once instead
//     of blocking in open() or failing later with a stream error. A symbolic link loop, a missing
//     file and a permission problem each get their own message.
//   - file_in_directory() accepts only a plain file name (no '/', not "." or "..", not empty) and
//     refuses a name whose resolved path (symbolic links followed) leaves the resolved directory.
//   - parse_json() first scans the text with nlohmann's SAX parser (iterative: no recursion), and
//     refuses nesting deeper than max_depth, a key that appears twice in one object, a number that
//     overflows a double (1e309), a NUL byte and any syntax error, naming the source and the byte
//     offset. Only
//     then is the document built, so later recursive code (dump(), conversions) sees at most
//     max_depth levels.
//
// Example:
//   const auto text = replay_examples::read_small_file(dir / "config.json", 1 << 20);
//   const nlohmann::json j = replay_examples::parse_json(text, (dir / "config.json").string());
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace replay_examples {

/// A problem with an input file (missing, not a regular file, too large, bad JSON, ...). The message
/// names the file.
class file_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// "no such file", "a symbolic link loop", ... for an errno of stat() or open().
inline std::string describe_errno(int e) {
  switch (e) {
    case ENOENT: return "no such file or directory";
    case ELOOP: return "too many levels of symbolic links (a symbolic link loop?)";
    case EACCES: return "permission denied";
    case ENOTDIR: return "a component of the path is not a directory";
    case ENAMETOOLONG: return "the path is too long";
    default: return std::strerror(e);
  }
}

/// "a directory", "a FIFO (named pipe)", ... for a stat() mode that is not a regular file.
inline std::string_view describe_file_type(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

}  // namespace detail

/// Opens `path` read-only after checking that it is a regular file; throws file_error otherwise.
/// The caller owns the returned descriptor (close it).
[[nodiscard]] inline int open_regular_file(const std::filesystem::path& path) {
  const std::string p = path.string();
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0)
    throw file_error(fmt::format("{}: cannot open: {}", p, detail::describe_errno(errno)));
  if (!S_ISREG(st.st_mode))
    throw file_error(fmt::format("{}: is {}, expected a regular file", p, detail::describe_file_type(st.st_mode)));
  // O_NONBLOCK: if the path was swapped for a FIFO after stat(), open() still returns at once.
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) throw file_error(fmt::format("{}: cannot open: {}", p, detail::describe_errno(errno)));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw file_error(fmt::format("{}: changed while being opened; expected a regular file", p));
  }
  return fd;
}

/// The whole of a regular file of at most `max_bytes` bytes; throws file_error otherwise.
[[nodiscard]] inline std::string read_small_file(const std::filesystem::path& path, std::size_t max_bytes) {
  const int fd = open_regular_file(path);
  struct stat st {};
  (void)::fstat(fd, &st);
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw file_error(fmt::format("{}: {} bytes is larger than the {} bytes this file may have", path.string(),
                                 st.st_size, max_bytes));
  }
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int e = errno;
      ::close(fd);
      throw file_error(r == 0 ? fmt::format("{}: the file shrank while being read", path.string())
                              : fmt::format("{}: read failed: {}", path.string(), std::strerror(e)));
    }
    got += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return text;
}

/// `dir / name` for a plain file name, with symbolic links resolved; throws file_error if `name` is
/// not a plain file name or the resolved file is not inside the resolved `dir`. The file must exist.
[[nodiscard]] inline std::filesystem::path file_in_directory(const std::filesystem::path& dir, std::string_view name) {
  namespace fs = std::filesystem;
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos)
    throw file_error(fmt::format("{}: '{}' is not a plain file name", dir.string(), name));
  const fs::path joined = dir / fs::path(std::string(name));
  std::error_code ec;
  const fs::path real_dir = fs::canonical(dir, ec);
  if (ec) throw file_error(fmt::format("{}: cannot resolve: {}", dir.string(), detail::describe_errno(ec.value())));
  const fs::path real = fs::canonical(joined, ec);
  if (ec) throw file_error(fmt::format("{}: cannot open: {}", joined.string(), detail::describe_errno(ec.value())));
  if (real.parent_path() != real_dir)
    throw file_error(fmt::format("{}: resolves to {}, outside the directory {}; copy the file into the directory "
                                 "instead of linking to it",
                                 joined.string(), real.string(), real_dir.string()));
  return joined;
}

namespace detail {

/// SAX pass of parse_json(): depth, duplicate keys, number overflow, syntax.
class json_checker final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit json_checker(std::size_t max_depth) : max_depth_(max_depth) {}
  std::string error;  ///< empty while the text is fine

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t v, const string_t& s) override {
    if (std::isfinite(v)) return true;
    return fail(fmt::format("number {} is out of range", s));
  }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return enter();
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) return fail(fmt::format("key \"{}\" appears twice in one object", k));
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    keys_.emplace_back();  // keeps keys_ in step with depth_ (never used for an array)
    return enter();
  }
  bool end_array() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string& token, const nlohmann::detail::exception& e) override {
    if (e.id == 406) return fail(fmt::format("at byte {}: number {} is out of range", position, token));
    std::string what = e.what();
    if (const auto p = what.find("] "); what.starts_with("[json.exception") && p != std::string::npos)
      what = what.substr(p + 2);
    error = fmt::format("at byte {}: {}", position, what);
    return false;
  }

 private:
  bool enter() {
    if (++depth_ > max_depth_) return fail(fmt::format("nested more than {} levels deep", max_depth_));
    return true;
  }
  bool fail(std::string why) {
    if (error.empty()) error = std::move(why);
    return false;
  }
  std::size_t max_depth_;
  std::size_t depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

}  // namespace detail

/// Parses strict JSON from `text`; throws file_error "SOURCE: not valid JSON: ..." on a syntax error,
/// nesting deeper than `max_depth`, a duplicate key in an object, or a number out of double range.
[[nodiscard]] inline nlohmann::json parse_json(std::string_view text, const std::string& source,
                                               std::size_t max_depth = 64) {
  // nlohmann's lexer ends the input at a NUL byte; JSON has none outside escapes, so refuse it here.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    throw file_error(fmt::format("{}: not valid JSON: at byte {}: a NUL byte", source, nul));
  detail::json_checker check(max_depth);
  const bool ok = nlohmann::json::sax_parse(text.begin(), text.end(), &check);
  if (!ok || !check.error.empty())
    throw file_error(fmt::format("{}: not valid JSON: {}", source, check.error.empty() ? "parse error" : check.error));
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {  // not expected after the scan; named all the same
    throw file_error(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
}

}  // namespace replay_examples
