// research/qwen/probes/ringprobe.cu: the read bandwidth of per-warp bulk-copy rings (the persistent
// kernel's weight streams) against slot size, slots and warps per SM, with a consumer that only
// touches each slot (mode 0) or runs the GEMV's arithmetic on it (mode 1: bf16 x, mode 2: fp32 x),
// and with or without an L2 evict-first hint. One block per SM streams 1 GiB. H200 (docs/perf-notes.md):
// 4.36-4.50 TB/s for every ring of 96-192 KiB per SM without arithmetic, whatever the slot size
// (2-64 KiB); with the arithmetic 3.95 TB/s on 8 warps and 4.34 on 16.
//   qwen_ring_probe             (no arguments; prints one line per case)
#include "../device_helpers.cuh"

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

using namespace qwen::dev;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ int g_hint;
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  if (g_hint) bulk_load(dst, src, bytes, bar, evict_first_policy());
  else bulk_load(dst, src, bytes, bar);
}

template <int MODE>  // 0: read one word; 1: GEMV-like compute on the slot (bf16 w, bf16 x); 2: same with fp32 x
__global__ void ring(const char* src, size_t total, unsigned slot, int slots, int warps, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned long long bars[32][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= warps) return;
  const size_t gw = (size_t)blockIdx.x * warps + warp, GW = (size_t)gridDim.x * warps;
  const size_t per = total / GW / slot * slot;  // bytes of this warp
  const char* base = src + gw * per;
  const size_t units = per / slot;
  unsigned char* r = smem + (size_t)warp * slots * slot;
  unsigned acc = 0;
  float facc = 0.f;
  __shared__ __align__(16) unsigned short xb[1024];
  __shared__ __align__(16) float xf[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) xb[i] = 0x3f80, xf[i] = 1.0f;
  __syncthreads();
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) mbar_init(&bars[warp][s], 1);
    mbar_fence_init();
    for (int s = 0; s < slots && s < (int)units; ++s) { mbar_arrive_tx(&bars[warp][s], slot); bulk(r + (size_t)s * slot, base + (size_t)s * slot, slot, &bars[warp][s]); }
  }
  __syncwarp();
  for (size_t t = 0; t < units; ++t) {
    const int s = t % slots; const unsigned par = (t / slots) & 1;
    while (!mbar_try_wait(&bars[warp][s], par)) {}
    uint4 w[4];
    if (MODE == 0) acc ^= *(const unsigned*)(r + (size_t)s * slot + lane * 4);
    else for (int u = 0; u < 4; ++u) w[u] = *(const uint4*)(r + (size_t)s * slot + u * 512 + lane * 16);
    __syncwarp();
    if (lane == 0 && t + slots < units) { mbar_arrive_tx(&bars[warp][s], slot); bulk(r + (size_t)s * slot, base + (t + slots) * slot, slot, &bars[warp][s]); }
    if (MODE != 0) {
      for (int u = 0; u < 4; ++u) {
        const unsigned ww[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
        float wf[8], xv[8];
        for (int i = 0; i < 4; ++i) { wf[2*i] = __uint_as_float(ww[i] << 16); wf[2*i+1] = __uint_as_float(ww[i] & 0xffff0000u); }
        if (MODE == 1) {
          const uint4 xq = *(const uint4*)(xb + u * 256 + lane * 8);
          const unsigned xx[4] = {xq.x, xq.y, xq.z, xq.w};
          for (int i = 0; i < 4; ++i) { xv[2*i] = __uint_as_float(xx[i] << 16); xv[2*i+1] = __uint_as_float(xx[i] & 0xffff0000u); }
        } else {
          const float4 a = *(const float4*)(xf + u * 256 + lane * 8), b = *(const float4*)(xf + u * 256 + lane * 8 + 4);
          xv[0]=a.x; xv[1]=a.y; xv[2]=a.z; xv[3]=a.w; xv[4]=b.x; xv[5]=b.y; xv[6]=b.z; xv[7]=b.w;
        }
        for (int e = 0; e < 8; ++e) facc = fmaf(wf[e], xv[e], facc);
      }
      for (int o = 16; o; o >>= 1) facc += __shfl_xor_sync(0xffffffffu, facc, o);
    }
  }
  if (acc == 0x12345678u || facc == 1.2345f) *sink = acc;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t total = size_t(1) << 30;
  char* src; CK(cudaMalloc(&src, total)); CK(cudaMemset(src, 1, total));
  unsigned* sink; CK(cudaMalloc(&sink, 4));
  CK(cudaFuncSetAttribute(ring<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(ring<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(ring<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  struct C { unsigned slot; int slots; int warps; int mode; int hint; } cs[] = {
    // copies only: slot size, slots and warps
    {2048, 12, 8, 0, 0}, {2048, 6, 8, 0, 0}, {4096, 6, 8, 0, 0}, {8192, 3, 8, 0, 0}, {8192, 2, 8, 0, 0},
    {16384, 1, 8, 0, 0}, {2048, 24, 4, 0, 0}, {4096, 12, 4, 0, 0}, {8192, 6, 4, 0, 0}, {16384, 3, 4, 0, 0},
    {32768, 6, 1, 0, 0}, {65536, 3, 1, 0, 0}, {2048, 6, 16, 0, 0}, {4096, 3, 16, 0, 0},
    // the L2 hint, and the GEMV's arithmetic on each slot
    {2048, 12, 8, 0, 1}, {2048, 12, 8, 1, 0}, {2048, 12, 8, 2, 0}, {2048, 12, 8, 1, 1}, {2048, 6, 16, 1, 0},
    {2048, 6, 16, 2, 0}};
  for (auto c : cs) {
    CK(cudaMemcpyToSymbol(g_hint, &c.hint, sizeof(int)));
    if ((size_t)c.slot * c.slots * c.warps > 200 * 1024) continue;
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      CK(cudaEventRecord(a));
      if (c.mode == 0) ring<0><<<sms, c.warps * 32, 200 * 1024>>>(src, total, c.slot, c.slots, c.warps, sink);
      if (c.mode == 1) ring<1><<<sms, c.warps * 32, 200 * 1024>>>(src, total, c.slot, c.slots, c.warps, sink);
      if (c.mode == 2) ring<2><<<sms, c.warps * 32, 200 * 1024>>>(src, total, c.slot, c.slots, c.warps, sink);
      CK(cudaGetLastError());
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (ms < best) best = ms;
    }
    printf("slot %6u B x %2d slots x %2d warps (%3u KiB/SM) mode %d hint %d: %.1f GB/s\n", c.slot, c.slots, c.warps,
           c.slot * c.slots * c.warps / 1024, c.mode, c.hint, total / best / 1e6);
  }
  return 0;
}
