// common/rng.hpp: a counter-based random number generator usable on host and device.
//
// Sampling inside a captured decode step cannot keep RNG state on the host: the graph is replayed,
// not re-launched with new arguments. A counter-based generator needs no state at all: the random
// number for (seed, counter) is a pure function of both, so the sampler reads the seed and the
// position from step metadata and gets the same number whether the step ran eagerly or from a
// graph, on any device, in any order.
//
//   float u = replay_examples::uniform01(seed, position);   // in [0, 1)
//
// The mixer is SplitMix64's finaliser (Steele, Lea, Flood 2014), applied to seed and counter.
// Guarantees: deterministic, bit-identical on host and device; uniform01 never returns 1.0f.
#pragma once

#include "host_device.hpp"

#include <cstdint>

namespace replay_examples {

/// SplitMix64's output function: a bijective 64-bit mixer.
REPLAY_EXAMPLES_HD std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// 64 random bits for (seed, counter).
REPLAY_EXAMPLES_HD std::uint64_t random_bits(std::uint64_t seed, std::uint64_t counter) {
  return splitmix64(splitmix64(seed) ^ (counter * 0xD1B54A32D192ED03ull));
}

/// A float in [0, 1) with 24 random bits for (seed, counter).
REPLAY_EXAMPLES_HD float uniform01(std::uint64_t seed, std::uint64_t counter) {
  return static_cast<float>(random_bits(seed, counter) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace replay_examples
