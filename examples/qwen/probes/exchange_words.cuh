// examples/qwen/probes/exchange_words.cuh: the 64-bit exchange words of the exchange probes
// (reduceprobe.cu, clusterprobe.cu): relaxed GPU-scope loads, stores and atomic adds, and the
// counted word's addend. Not part of the example's kernels.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

namespace qwen::probes {

__device__ __forceinline__ unsigned long long ld_w(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_w(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_w(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/// The first of part i's elements when n elements are split into `parts` contiguous parts.
__device__ __forceinline__ int split(int i, int n, int parts) { return static_cast<int>((long long)i * n / parts); }
/// A counted word's addend: one contribution (the top 8 bits count them) and v in fixed point
/// (2^-24) plus a bias that keeps every addend positive.
__device__ __forceinline__ unsigned long long counted(float v) {
  const long long f = __float2ll_rn(v * 16777216.f);
  return (1ull << 56) + static_cast<unsigned long long>(f + (1ll << 47));
}

}  // namespace qwen::probes
