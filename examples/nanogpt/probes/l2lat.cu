// nanogpt_l2lat (built with -DNANOGPT_STAMPS=ON; README item 18): what reading the residual row
// costs a decode kernel after its wait, and whether another way of reading it would cost less.
//  1. The L2-hit latency of a 128-byte line written by a previous kernel, from every SM, for 512
//     lines: does it depend on the (SM, line) pair (the L2's two partitions), i.e. would a copy of
//     the row per partition, each kernel reading the nearer one, pay?
//  2. The 32-float row into every thread of a 128-thread block, four ways (the decode kernels' 8
//     broadcast 16-byte loads per thread; 8 lanes per warp through shared memory; 8 threads through
//     shared memory and a block barrier; one 16-byte load per lane and 32 shuffles), interleaved
//     launches, second pass of each (warm instruction cache and TLB), the slowest warp's cycles.
#include <replay/error.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

constexpr int kLines = 512;  // 64 KiB
constexpr int kChain = 8;

/// p[0, n) = v, by one block: the lines the probe then reads were written by a kernel on one SM.
template <class T>
__global__ void fill(T* p, int n, T v) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}

__device__ __forceinline__ unsigned smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}

// One block per SM (forced by shared memory). Thread 0 times, for every line, one cold load (first
// touch by this SM) and then a chain of kChain dependent loads of the same line (ld.global.cg).
__global__ void measure(const int* buf, unsigned* first, unsigned* warm, unsigned* sm_of_block) {
  extern __shared__ int smem[];
  if (threadIdx.x != 0) return;
  smem[0] = 0;
  const unsigned s = smid();
  sm_of_block[blockIdx.x] = s;
  for (int j = 0; j < kLines; ++j) {
    const int* line = buf + j * 32;
    long long t0 = clock64();
    int o = __ldcg(line);
    if (o == 12345) asm volatile("trap;");
    long long t1 = clock64();
    int p = 0;
    for (int k = 0; k < kChain; ++k) p = __ldcg(line + p);
    if (p == 12345) asm volatile("trap;");
    long long t2 = clock64();
    first[blockIdx.x * kLines + j] = static_cast<unsigned>(t1 - t0);
    warm[blockIdx.x * kLines + j] = static_cast<unsigned>((t2 - t1) / kChain);
  }
}

// The decode kernels' row read, warm, four ways, modes interleaved: every thread ends with the
// 32-float row in registers. Records the slowest warp's time (lane 0 of each warp).
__global__ void rowread(const float* rows, int mode, unsigned* out) {
  extern __shared__ int smem[];
  __shared__ float4 wsh[4][8];
  __shared__ float4 bsh[8];
  const int t = threadIdx.x, lane = t & 31, w = t >> 5;
  float s = 0;
  unsigned worst = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const float* row = rows + ((blockIdx.x + pass * 7) % 32) * 32;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    float4 v[8];
    __syncthreads();
    long long t0 = clock64();
    if (mode == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldcg(r4 + i);
    } else if (mode == 1) {
      if (lane < 8) wsh[w][lane] = __ldcg(r4 + lane);
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = wsh[w][i];
    } else if (mode == 2) {
      if (t < 8) bsh[t] = __ldcg(r4 + t);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = bsh[i];
    } else if (mode == 3) {
      const float4 m = __ldcg(r4 + (lane & 7));
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = make_float4(__shfl_sync(0xffffffffu, m.x, i), __shfl_sync(0xffffffffu, m.y, i),
                           __shfl_sync(0xffffffffu, m.z, i), __shfl_sync(0xffffffffu, m.w, i));
    }
    float a = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) a += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    s += a;
    if (s == 12345.f) asm volatile("trap;");
    long long t1 = clock64();
    if (pass == 1 && lane == 0) wsh[w][0].x = __int_as_float(static_cast<int>(t1 - t0));
    __syncthreads();
    if (pass == 1 && t == 0) {
      for (int i = 0; i < 4; ++i) worst = max(worst, static_cast<unsigned>(__float_as_int(wsh[i][0].x)));
      out[blockIdx.x] = worst;
    }
  }
  if (s == 54321.f) smem[0] = 1;
}

int main() try {
  int sms = 0;
  REPLAY_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  REPLAY_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d KiB\n", prop.name, sms, prop.l2CacheSize / 1024);
  int* buf;
  unsigned *first, *warm, *sm_of;
  REPLAY_CHECK(cudaMalloc(&buf, kLines * 128));
  REPLAY_CHECK(cudaMalloc(&first, sizeof(unsigned) * sms * kLines));
  REPLAY_CHECK(cudaMalloc(&warm, sizeof(unsigned) * sms * kLines));
  REPLAY_CHECK(cudaMalloc(&sm_of, sizeof(unsigned) * sms));
  const int smem = 120 * 1024;
  REPLAY_CHECK(cudaFuncSetAttribute(measure, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<unsigned> hf(sms * kLines), hw(sms * kLines), hs(sms);
  std::vector<double> acc_warm(sms * kLines, 0), acc_first(sms * kLines, 0);
  const int reps = 5;
  for (int r = 0; r < reps; ++r) {
    fill<<<1, 256>>>(buf, kLines * 32, 0);
    REPLAY_CHECK_LAUNCH("probe");
    measure<<<sms, 32, smem>>>(buf, first, warm, sm_of);
    REPLAY_CHECK_LAUNCH("probe");
    REPLAY_CHECK(cudaDeviceSynchronize());
    REPLAY_CHECK(cudaMemcpy(hf.data(), first, sizeof(unsigned) * sms * kLines, cudaMemcpyDeviceToHost));
    REPLAY_CHECK(cudaMemcpy(hw.data(), warm, sizeof(unsigned) * sms * kLines, cudaMemcpyDeviceToHost));
    REPLAY_CHECK(cudaMemcpy(hs.data(), sm_of, sizeof(unsigned) * sms, cudaMemcpyDeviceToHost));
    // index by SM id
    for (int b = 0; b < sms; ++b)
      for (int j = 0; j < kLines; ++j) {
        acc_warm[hs[b] * kLines + j] += hw[b * kLines + j];
        acc_first[hs[b] * kLines + j] += hf[b * kLines + j];
      }
  }
  std::vector<double> w(sms * kLines), f(sms * kLines);
  for (int i = 0; i < sms * kLines; ++i) w[i] = acc_warm[i] / reps, f[i] = acc_first[i] / reps;
  // Histogram of warm latencies.
  int hist[64] = {};
  for (double v : w) hist[std::min(63, static_cast<int>(v / 20))]++;
  std::printf("warm latency histogram (20-cycle bins, count over SM x line):\n");
  for (int i = 0; i < 64; ++i)
    if (hist[i]) std::printf("  %4d-%4d: %d\n", i * 20, i * 20 + 19, hist[i]);
  int histf[64] = {};
  for (double v : f) histf[std::min(63, static_cast<int>(v / 50))]++;
  std::printf("first-touch latency histogram (50-cycle bins):\n");
  for (int i = 0; i < 64; ++i)
    if (histf[i]) std::printf("  %4d-%4d: %d\n", i * 50, i * 50 + 49, histf[i]);
  // Mean over SMs for line 0 alone, and for the best of line 0 and line j (per SM), best j.
  auto mean_single = [&](int j) {
    double s = 0;
    for (int m = 0; m < sms; ++m) s += w[m * kLines + j];
    return s / sms;
  };
  double best_pair = 1e30;
  int bj = -1;
  for (int j = 1; j < kLines; ++j) {
    double s = 0;
    for (int m = 0; m < sms; ++m) s += std::min(w[m * kLines], w[m * kLines + j]);
    if (s / sms < best_pair) best_pair = s / sms, bj = j;
  }
  double all_single = 0, all_min = 0;
  for (int m = 0; m < sms; ++m) {
    double mn = 1e30;
    for (int j = 0; j < kLines; ++j) all_single += w[m * kLines + j], mn = std::min(mn, w[m * kLines + j]);
    all_min += mn;
  }
  std::printf("mean warm latency: any line %.1f; line 0 %.1f; best of line 0 and line %d per SM %.1f; "
              "per-SM best line %.1f cycles\n",
              all_single / (sms * kLines), mean_single(0), bj, best_pair, all_min / sms);

  {
    float* rows;
    unsigned* out;
    REPLAY_CHECK(cudaMalloc(&rows, 64 * 128));
    REPLAY_CHECK(cudaMalloc(&out, sizeof(unsigned) * sms));
    REPLAY_CHECK(cudaFuncSetAttribute(rowread, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<unsigned> h(sms);
    const char* names[] = {"all threads 8 x LDG.128", "warp: 8 lanes LDG -> smem, syncwarp", "block: 8 threads LDG -> smem, barrier",
                           "LDG.128 (lane&7) + 32 shuffles"};
    std::vector<unsigned> res[4];
    for (int r = 0; r < 60; ++r)
      for (int mode = 0; mode < 4; ++mode) {
        fill<<<1, 256>>>(rows, 64 * 32, 1.0f);
        REPLAY_CHECK_LAUNCH("probe");
        rowread<<<sms, 128, smem>>>(rows, mode, out);
        REPLAY_CHECK_LAUNCH("probe");
        REPLAY_CHECK(cudaDeviceSynchronize());
        REPLAY_CHECK(cudaMemcpy(h.data(), out, sizeof(unsigned) * sms, cudaMemcpyDeviceToHost));
        if (r >= 4) res[mode].insert(res[mode].end(), h.begin(), h.end());
      }
    REPLAY_CHECK(cudaFree(rows));
    REPLAY_CHECK(cudaFree(out));
    for (int mode = 0; mode < 4; ++mode) {
      auto& p = res[mode];
      std::sort(p.begin(), p.end());
      std::printf("slowest warp, %-40s median %u (p10 %u p90 %u) cycles\n", names[mode], p[p.size() / 2],
                  p[p.size() / 10], p[p.size() * 9 / 10]);
    }
  }
  REPLAY_CHECK(cudaFree(buf));
  REPLAY_CHECK(cudaFree(first));
  REPLAY_CHECK(cudaFree(warm));
  REPLAY_CHECK(cudaFree(sm_of));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "nanogpt_l2lat: %s\n", e.what());
  return 1;
}
