// Helpers shared by GPU tests.
#pragma once
#include <replay/replay.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

namespace replay_test {

/// A bit pattern that no kernel under test writes: outputs are filled with it before a run so that a
/// kernel that never ran (or wrote nothing) cannot pass by leaving zeros behind.
inline constexpr std::uint32_t poison_bits = 0xDEADBEEFu;

/// Fill `bytes` bytes at device address `p` with the poison byte 0xEF (not zero).
inline void poison(void* p, std::size_t bytes, replay::stream_ref s) {
  REPLAY_CHECK(cudaMemsetAsync(p, 0xEF, bytes, s.get()));
}

template <class T>
std::vector<T> to_host(const T* device, std::size_t n, replay::stream_ref s) {
  std::vector<T> out(n);
  REPLAY_CHECK(cudaMemcpyAsync(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  return out;
}

}  // namespace replay_test
