// Host test: the header version matches the CMake project version.
#include <doctest/doctest.h>
#include <replay/version.hpp>

#include <fmt/format.h>

TEST_CASE("version.hpp matches the CMake project version") {
  const auto v = replay::version;
  CHECK(fmt::format("{}.{}.{}", v.major, v.minor, v.patch) == REPLAY_CMAKE_VERSION);
  CHECK(std::string(replay::version_string) == REPLAY_CMAKE_VERSION);
  static_assert(REPLAY_VERSION == REPLAY_VERSION_MAJOR * 10000 + REPLAY_VERSION_MINOR * 100 + REPLAY_VERSION_PATCH);
}
