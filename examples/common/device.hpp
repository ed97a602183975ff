// common/device.hpp: facts about the current CUDA device that the example programs print or size
// their grids by.
//
//   const int sms = replay_examples::sm_count();
//   fmt::print("device: {}\n", replay_examples::device_name());
//
// Guarantees: each call queries the current device; a failing CUDA call throws replay::cuda_error
// (e.g. on a machine without a GPU).
#pragma once

#include <replay/error.hpp>

#include <cuda_runtime.h>

#include <string>

namespace replay_examples {

/// Streaming multiprocessors of the current device.
inline int sm_count() {
  int dev = 0, sms = 0;
  REPLAY_CHECK(cudaGetDevice(&dev));
  REPLAY_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

/// Name of the current device, e.g. "NVIDIA H200".
inline std::string device_name() {
  int dev = 0;
  cudaDeviceProp p{};
  REPLAY_CHECK(cudaGetDevice(&dev));
  REPLAY_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

}  // namespace replay_examples
