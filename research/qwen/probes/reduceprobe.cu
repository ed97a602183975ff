// research/qwen/probes/reduceprobe.cu: what a grid-wide exchange of a 1024-element vector costs when
// the vector is a sum of partial vectors added with atomics, against the persistent kernel's exchange
// of tagged words (mega.cu; docs/perf-notes.md). Could a layer's down projection be split by its
// input (each block adds its own partial of every output) so that gate/up -> down needs no
// exchange, and attention + O projection likewise?
//
// One block per SM, 8 warps exchange, a ninth warp optionally streams a large buffer from memory (the
// weight streams' load). Each iteration every block contributes, then polls all 1024 elements until
// they are complete, and goes on to the next iteration; block 0 stamps the end of each iteration.
// Modes:
//   0 tagged:   block b writes its own ~1024/grid elements as {value, tag} words (st.relaxed.gpu.u64);
//               every block polls the 1024 words until their tags say "this iteration".
//   1 counted:  every block adds to all 1024 elements with red.relaxed.gpu.add.u64 of a word
//               {count (8 bits) | fixed-point value + bias (56 bits)}; a word is complete when its
//               count equals the number of contributing blocks (no fence, no flag).
//   2 counted, one element per 32 bytes (more L2 slices, more sectors to poll).
//   3 counted, 16-ish contributors per element: block b adds only to the 128 elements of slice b % 8
//               (what attention + O partials per query head would do).
//   4 counted, all 1024 elements, each warp polling 128 contiguous elements (mode 1's layout, another
//               thread mapping).
//   5 tagged, each block's words in a 128-byte line of their own (one writer per line; 132 lines to
//               poll, 8 words of each).
// H200 (three runs), µs per exchange idle / with the memory stream: tagged
// 1.34-1.41 / 1.41-1.50; counted by all 132 blocks 3.36-3.46 / 3.39-3.49 (32 bytes apart: 5.4 / 5.6);
// counted by ~16 blocks 1.60-1.66 / 1.66-1.73; a line per block 1.86-1.89 / 2.18.
//   qwen_reduce_probe [iterations]
#include "../device_helpers.cuh"
#include "exchange_words.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

using namespace qwen::dev;
using namespace qwen::probes;

constexpr int kN = 1024;
constexpr int kThreads = 256;

__global__ void probe(int mode, int iters, unsigned long long* buf, const uint4* big, size_t big_n,
                      unsigned long long* stamps, float* sink) {
  __shared__ int run;  // (the launch's dynamic shared memory only keeps the blocks one per SM)
  const int tid = threadIdx.x, G = gridDim.x;
  if (loader_warp(run, kThreads, big, big_n, sink)) return;  // a memory stream until the exchange is done
  const int stride = mode == 2 ? 4 : 1;
  // The element a thread adds to (counted modes but 3) and polls, k < 4: thread t takes t + 256 k, or
  // (mode 4) each warp 128 contiguous elements.
  auto elem = [&](int k) { return mode == 4 ? (tid >> 5) * 128 + (tid & 31) + 32 * k : tid + kThreads * k; };
  // Where element e lives: mode 5 puts block b's elements in line b (e's block from the split).
  auto at = [&](int e) -> size_t {
    if (mode != 5) return size_t(e) * stride;
    int b = static_cast<int>((static_cast<long long>(e) * G + G - 1) / kN);  // first b with split(b + 1) > e
    while (split(b + 1, kN, G) <= e) ++b;
    while (b > 0 && split(b, kN, G) > e) --b;
    return size_t(b) * 16 + (e - split(b, kN, G));
  };
  for (int it = 0; it < iters; ++it) {
    unsigned long long* v = buf + size_t(it) * kN * 4;  // (room for every mode's layout)
    // contribute
    if (mode == 0 || mode == 5) {
      const unsigned tag = static_cast<unsigned>(it + 1);
      const int e0 = split(blockIdx.x, kN, G), e1 = split(blockIdx.x + 1, kN, G);
      for (int e = e0 + tid; e < e1; e += kThreads)
        st_w(v + (mode == 5 ? blockIdx.x * 16 + (e - e0) : e), (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(float(e)));
    } else if (mode == 3) {
      const int s = blockIdx.x % 8;
      if (tid < 128) red_w(v + s * 128 + tid, counted(0.25f * tid));
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int e = elem(k);
        red_w(v + size_t(e) * stride, counted(0.001f * e - 0.3f));
      }
    }
    // poll all kN elements: 4 per thread, re-request the ones not ready
    unsigned long long w[4];
    int need[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = elem(k);
      need[k] = mode == 3 ? (G / 8 + ((e / 128) < G % 8 ? 1 : 0)) : G;
      w[k] = ld_w(v + at(e));
    }
    const unsigned tag = static_cast<unsigned>(it + 1);
    for (;;) {
      bool all = true;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int e = elem(k);
        const bool ok = mode == 0 || mode == 5 ? static_cast<unsigned>(w[k] >> 32) == tag : static_cast<int>(w[k] >> 56) == need[k];
        if (!ok) all = false, w[k] = ld_w(v + at(e));
      }
      if (all) break;
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) s += static_cast<float>(w[k] & 0xffff);
    if (s == -1.f) sink[1] = s;
    asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
    if (blockIdx.x == 0 && tid == 0) stamps[it] = global_ns();
  }
  if (tid == 0) run = 0;
}

int main(int argc, char** argv) {
  ChainHost host(argc, argv, 100000, "qwen_reduce_probe");
  const int iters = host.iters, sms = host.sms;
  if (sms > 255 || 16 * sms > kN * 4) { printf("more SMs than the probe's layouts hold\n"); return 1; }
  const size_t buf_words = size_t(iters) * kN * 4;
  unsigned long long* buf = nullptr;
  CK(cudaMalloc(&buf, buf_words * 8));
  const size_t smem = 150 * 1024;  // one block per SM
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  printf("device %s, %d SMs, %d iterations per run, median / p10 / p90 ns per exchange\n", host.prop.name, sms, iters);
  const char* names[] = {"tagged own slice", "counted all 1024 (contiguous)", "counted all 1024 (32 B apart)",
                         "counted 128 per block (~16 per element)", "counted all 1024 (warp-blocked)",
                         "tagged own slice, a line per block"};
  for (int load = 0; load < 2; ++load) {
    for (int rep = 0; rep < 2; ++rep) {
      for (int mode = 0; mode < 6; ++mode) {
        CK(cudaMemset(buf, 0, buf_words * 8));
        int m = mode, it = iters;
        const uint4* bp = host.big;
        size_t bn = load ? host.big_bytes / 16 : 0;
        void* args[] = {&m, &it, &buf, &bp, &bn, &host.stamps, &host.sink};
        const ChainHost::Spread r = host.chain(reinterpret_cast<const void*>(probe), args, kThreads + 32, smem);
        if (rep == 1)
          printf("%-10s %-42s %7.0f / %7.0f / %7.0f\n", load ? "streaming" : "idle", names[mode], r.median, r.p10, r.p90);
      }
    }
  }
  CK(cudaFree(buf));
  return 0;
}
