// replay/version.hpp: the library version (kept equal to the CMake project version; a host test
// checks it).
#pragma once

#define REPLAY_VERSION_MAJOR 0
#define REPLAY_VERSION_MINOR 1
#define REPLAY_VERSION_PATCH 0
/// MAJOR * 10000 + MINOR * 100 + PATCH, for preprocessor comparisons.
#define REPLAY_VERSION (REPLAY_VERSION_MAJOR * 10000 + REPLAY_VERSION_MINOR * 100 + REPLAY_VERSION_PATCH)

namespace replay {
struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{REPLAY_VERSION_MAJOR, REPLAY_VERSION_MINOR, REPLAY_VERSION_PATCH};
inline constexpr const char* version_string = "0.1.0";
}  // namespace replay
