// research/qwen/probes/fenceprobe.cu: what a gpu-scope fence (and so every release) costs while the
// block has bulk copies (cp.async.bulk) in flight, and a grid-wide counter barrier with and without.
// Each block issues S KiB of bulk copies into shared memory, then thread 0 times a fence.acq_rel.gpu
// or one grid barrier (red.release + ld.acquire spin, or fence + relaxed + fence), and when the
// copied bytes arrived. H200 (docs/perf-notes.md): the fence ends when the block's
// copies have landed: 0.32 us with nothing in flight, 1.3 / 2.8 / 4.4 us with 64 / 128 / 192 KiB per
// SM in flight on all 132 SMs. This is why the persistent kernel (mega.cu) hands activations over
// in tagged words instead of flags published with release semantics.
//   qwen_fence_probe            (no arguments; prints one line per case)
#include "../device_helpers.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

using namespace qwen::dev;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ unsigned ld_acq(const unsigned* p) { unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void red_rlx(unsigned* p, unsigned v) { asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }

// mode 0: fence.acq_rel.gpu timing; mode 1: grid barrier (red.release + ld.acquire spin); mode 2: grid barrier
// with relaxed red after fence + relaxed spin + fence; S bytes of bulk copies issued just before.
__global__ void probe(const char* src, size_t src_bytes, unsigned bytes, int iters, int mode, unsigned* ctr,
                      float* out_fence, float* out_arrive, float* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned long long bar;
  const int tid = threadIdx.x;
  if (tid == 0) { mbar_init(&bar, 1); mbar_fence_init(); }
  __syncthreads();
  for (int it = 0; it < iters; ++it) {
    if (tid == 32) {
      if (bytes) {
        mbar_arrive_tx(&bar, bytes);
        size_t off = ((size_t)(it * gridDim.x + blockIdx.x) * bytes) % (src_bytes - bytes);
        off &= ~size_t(127);
        for (unsigned b = 0; b < bytes; b += 16384) bulk_load(smem + b, src + off + b, min(16384u, bytes - b), &bar);
      } else {
        mbar_arrive(&bar);
      }
    }
    __syncthreads();
    if (tid == 0) {
      sink[blockIdx.x * 32 + (it & 31)] = (float)it;  // a write for the fence to order
      unsigned long long t0 = global_ns();
      if (mode == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
      } else if (mode == 1) {
        red_release_add(ctr, 1);
        const unsigned need = (unsigned)gridDim.x * (it + 1);
        while (ld_acq(ctr) < need) {}
      } else {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        red_rlx(ctr, 1);
        const unsigned need = (unsigned)gridDim.x * (it + 1);
        while (ld_relaxed(ctr) < need) {}
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
      }
      unsigned long long t1 = global_ns();
      while (!mbar_try_wait(&bar, it & 1)) {}
      unsigned long long t2 = global_ns();
      out_fence[(size_t)it * gridDim.x + blockIdx.x] = (t1 - t0) * 1e-3f;
      out_arrive[(size_t)it * gridDim.x + blockIdx.x] = (t2 - t0) * 1e-3f;
    }
    __syncthreads();
  }
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static float pct(std::vector<float> v, double p) { std::sort(v.begin(), v.end()); return v[(size_t)(p * (v.size() - 1))]; }

int main() {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, sms);
  size_t src_bytes = size_t(2) << 30;
  char* src; CK(cudaMalloc(&src, src_bytes)); CK(cudaMemset(src, 1, src_bytes));
  unsigned* ctr; CK(cudaMalloc(&ctr, 64));
  const int iters = 200;
  float *f, *a, *sink;
  CK(cudaMalloc(&f, sizeof(float) * iters * sms)); CK(cudaMalloc(&a, sizeof(float) * iters * sms));
  CK(cudaMalloc(&sink, sizeof(float) * sms * 32));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const char* names[] = {"fence.acq_rel.gpu", "barrier red.release+ld.acquire", "barrier fence+relaxed+fence"};
  for (int mode = 0; mode < 3; ++mode)
    for (unsigned kb : {0u, 16u, 64u, 128u, 192u}) {
      for (int grid : {sms, 8}) {
        if (mode != 0 && grid != sms) continue;
        CK(cudaMemset(ctr, 0, 64));
        probe<<<grid, 64, 200 * 1024>>>(src, src_bytes, kb * 1024, iters, mode, ctr, f, a, sink);
        CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
        std::vector<float> hf(iters * grid), ha(iters * grid);
        CK(cudaMemcpy(hf.data(), f, hf.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ha.data(), a, ha.size() * 4, cudaMemcpyDeviceToHost));
        hf.erase(hf.begin(), hf.begin() + 10 * grid); ha.erase(ha.begin(), ha.begin() + 10 * grid);
        printf("%-32s grid %3d in-flight %3u KiB/SM: op median %.3f us p90 %.3f | data arrives %.3f us\n", names[mode], grid,
               kb, median(hf), pct(hf, 0.9), median(ha));
      }
    }
  return 0;
}
