// common/host_device.hpp: REPLAY_EXAMPLES_HD marks a function the examples' host code and kernels
// share: __host__ __device__ (and inlined) under nvcc, a plain inline function elsewhere.
#pragma once

#if defined(__CUDACC__)
#define REPLAY_EXAMPLES_HD __host__ __device__ __forceinline__
#else
#define REPLAY_EXAMPLES_HD inline
#endif
