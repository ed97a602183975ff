// Host tests of the NVTX ranges: names carry the key; ranges open and close without a profiler.
#include <doctest/doctest.h>
#include <replay/graph_pool.hpp>
#include <replay/nvtx.hpp>

#include <string>

namespace {
struct opaque_key {
  int id;
};
}  // namespace

TEST_CASE("nvtx_name puts the key in the range name") {
  CHECK(replay::nvtx_name("capture", replay::graph_key{.bucket = 8}).starts_with("capture "));
  CHECK(replay::nvtx_name("capture", replay::graph_key{.bucket = 8}).find('8') != std::string::npos);
  CHECK(replay::nvtx_name("replay", 16) == "replay 16");
  CHECK(replay::nvtx_name("evict", opaque_key{3}) == "evict");  // not printable: the phase alone
}

TEST_CASE("ranges nest and close without a profiler attached") {
  static_assert(!std::is_copy_constructible_v<replay::nvtx_range>);
  {
    replay::nvtx_range outer("capture", replay::graph_key{.bucket = 1});
    const std::string cached = replay::nvtx_name("replay", 1);
    replay::nvtx_range inner(cached);
    replay::nvtx_range plain("upload");
  }
  CHECK(REPLAY_NVTX == 1);  // the toolkit's NVTX3 headers are found by default
}
