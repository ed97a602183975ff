// research/qwen/probes/exchange_words.cuh: the 64-bit exchange words of the exchange probes
// (reduceprobe.cu, clusterprobe.cu, bytesprobe.cu): relaxed GPU-scope loads, stores and atomic adds, the
// counted word's addend, the loader warp and the chains' host side. Not part of the example's kernels.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
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

/// The probes' loader warp: streams `big` (big_n 16-byte words; nothing if 0) until the block's
/// exchange warps clear `run`, standing in for the persistent kernel's weight streams.
__device__ __forceinline__ void stream_while(const volatile int& run, const uint4* big, size_t big_n, float* sink) {
  if (big_n == 0) return;
  const int lane = threadIdx.x & 31;
  size_t i = (size_t(blockIdx.x) * 4096 + lane) % big_n;
  uint4 acc = make_uint4(0, 0, 0, 0);
  while (run) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(big + (i + u * 32) % big_n));
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc.x ^= v[u].x, acc.y += v[u].w;
    i = (i + 256 * size_t(gridDim.x)) % big_n;
  }
  if (acc.x == 0x12345 && acc.y == 7) sink[0] = 1.f;
}

/// A chain's block prologue: sets `run` (shared), then the threads from `exchange_threads` on stream
/// `big` as the loader warp until thread 0 clears `run`; true for them once they are done.
__device__ __forceinline__ bool loader_warp(int& run, int exchange_threads, const uint4* big, size_t big_n, float* sink) {
  if (threadIdx.x == 0) run = 1;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < exchange_threads) return false;
  stream_while(run, big, big_n, sink);
  return true;
}

/// The exchange chains' host side (reduceprobe.cu, bytesprobe.cu): the iteration count from the
/// command line, the device, a 1 GiB buffer for the loader warps to stream, the per-exchange stamps.
struct ChainHost {
  int iters = 0, sms = 0;
  cudaDeviceProp prop{};
  uint4* big = nullptr;
  size_t big_bytes = size_t(1) << 30;
  unsigned long long* stamps = nullptr;  // block 0's end of each exchange
  float* sink = nullptr;                 // keeps the loads alive
  std::vector<unsigned long long> h;

  /// iters from argv[1] (default 400); exits with 2 on a bad count. The first 20 are warm-up.
  ChainHost(int argc, char** argv, int max_iters, const char* name) {
    iters = argc > 1 ? atoi(argv[1]) : 400;
    if (iters <= 20 || iters > max_iters) {
      printf("usage: %s [iterations: 21..%d, default 400]\n", name, max_iters);
      exit(2);
    }
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    CK(cudaMalloc(&stamps, size_t(iters) * 8));
    CK(cudaMalloc(&big, big_bytes));
    CK(cudaMemset(big, 1, big_bytes));
    CK(cudaMalloc(&sink, 64));
    h.resize(iters);
  }
  ~ChainHost() {  // (errors ignored: the process is ending)
    (void)cudaFree(sink);
    (void)cudaFree(big);
    (void)cudaFree(stamps);
  }
  ChainHost(const ChainHost&) = delete;
  ChainHost& operator=(const ChainHost&) = delete;
  /// One cooperative launch of `kernel` (one block per SM: `smem` bytes of dynamic shared memory);
  /// returns the median, p10 and p90 of the time between successive exchanges, in ns.
  struct Spread {
    double median, p10, p90;
  };
  Spread chain(const void* kernel, void** args, int threads, size_t smem) {
    CK(cudaLaunchCooperativeKernel(kernel, dim3(sms), dim3(threads), args, smem, 0));
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h.data(), stamps, size_t(iters) * 8, cudaMemcpyDeviceToHost));
    std::vector<double> d;
    for (int i = 20; i < iters; ++i) d.push_back(double(h[i] - h[i - 1]));
    std::sort(d.begin(), d.end());
    return {d[d.size() / 2], d[d.size() / 10], d[d.size() * 9 / 10]};
  }
};

}  // namespace qwen::probes
