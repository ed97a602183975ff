// research/qwen/probes/bytesprobe.cu: does a grid-wide exchange of tagged words get cheaper when it
// moves fewer bytes (docs/perf-notes.md)? The persistent kernel's five exchanges per layer
// (mega.cu) cost about 1.44 us each in reduceprobe.cu's chain; this probe varies the number of
// elements and the word format of that same chain, to see whether the exchange's time follows the
// bytes every block polls (then packing more values into a word pays) or not (then it is latency
// and the format is irrelevant).
//
// One block per SM, 8 warps exchange, a ninth warp optionally streams a large buffer (the weight
// streams' load). Each iteration every block writes its slice of the words, then polls all of them
// until their tags say "this iteration", then a block barrier; block 0 stamps each iteration's end.
// Word formats (values per word, bytes):
//   f32  {f32 value, 32-bit tag}           1 per 8 B  (the kernel's residual and q/k/v words)
//   half {bf16 value, 16-bit tag}          1 per 4 B  (the kernel's activation half words)
//   pk3  {3 bf16 values, 16-bit tag}       3 per 8 B
//   q3   {3 f32 values, 32-bit tag}        3 per 16 B (one 128-bit access; see below)
// The 128-bit format relies on ld/st .b128 being one access; the probe only times it (its values
// are not checked for tearing), so it says whether such a format would be worth establishing.
//   qwen_bytes_probe [iterations]
#include "../device_helpers.cuh"
#include "exchange_words.cuh"

#include <cstdio>
#include <cuda_runtime.h>

using namespace qwen::dev;
using namespace qwen::probes;

namespace {

constexpr int kThreads = 256;
constexpr int kMaxPerThread = 12;  // words polled per thread, at most
constexpr int kMaxWords = kThreads * kMaxPerThread;

enum Format { kF32 = 0, kHalf = 1, kPk3 = 2, kQ3 = 3 };
constexpr int kValuesPerWord[] = {1, 1, 3, 3};
constexpr int kWordBytes[] = {8, 4, 8, 16};
const char* const kFormatNames[] = {"f32 {value, tag32} 8 B", "half {bf16, tag16} 4 B", "pk3 {3 bf16, tag16} 8 B",
                                    "q3 {3 f32, tag32} 16 B"};

struct W128 {
  unsigned long long lo, hi;
};

__device__ __forceinline__ unsigned ld32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ W128 ld128(const W128* p) {
  W128 v;
  asm volatile(
      "{\n .reg .b128 t;\n ld.relaxed.gpu.global.b128 t, [%2];\n mov.b128 {%0, %1}, t;\n}"
      : "=l"(v.lo), "=l"(v.hi)
      : "l"(p)
      : "memory");
  return v;
}
__device__ __forceinline__ void st128(W128* p, W128 v) {
  asm volatile("{\n .reg .b128 t;\n mov.b128 t, {%1, %2};\n st.relaxed.gpu.global.b128 [%0], t;\n}" ::"l"(p),
               "l"(v.lo), "l"(v.hi)
               : "memory");
}

/// One format's word: load, store with tag, and the tag check.
template <int F>
struct Word;
template <>
struct Word<kF32> {
  using T = unsigned long long;
  static __device__ T load(const T* p) { return ld_w(p); }
  static __device__ void store(T* p, unsigned tag, float v) {
    st_w(p, (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v));
  }
  static __device__ bool ready(T w, unsigned tag) { return static_cast<unsigned>(w >> 32) == tag; }
  static __device__ float value(T w) { return __uint_as_float(static_cast<unsigned>(w)); }
};
template <>
struct Word<kHalf> {
  using T = unsigned;
  static __device__ T load(const T* p) { return ld32(p); }
  static __device__ void store(T* p, unsigned tag, float v) {
    st32(p, ((tag & 0xffffu) << 16) | __bfloat16_as_ushort(__float2bfloat16(v)));
  }
  static __device__ bool ready(T w, unsigned tag) { return (w >> 16) == (tag & 0xffffu); }
  static __device__ float value(T w) { return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w))); }
};
template <>
struct Word<kPk3> {
  using T = unsigned long long;
  static __device__ T load(const T* p) { return ld_w(p); }
  static __device__ void store(T* p, unsigned tag, float v) {
    const unsigned long long b = __bfloat16_as_ushort(__float2bfloat16(v));
    st_w(p, (static_cast<unsigned long long>(tag & 0xffffu) << 48) | (b << 32) | (b << 16) | b);
  }
  static __device__ bool ready(T w, unsigned tag) { return static_cast<unsigned>(w >> 48) == (tag & 0xffffu); }
  static __device__ float value(T w) { return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w))); }
};
template <>
struct Word<kQ3> {
  using T = W128;
  static __device__ T load(const T* p) { return ld128(p); }
  static __device__ void store(T* p, unsigned tag, float v) {
    const unsigned long long f = __float_as_uint(v);
    st128(p, W128{(f << 32) | f, (static_cast<unsigned long long>(tag) << 32) | f});
  }
  static __device__ bool ready(T w, unsigned tag) { return static_cast<unsigned>(w.hi >> 32) == tag; }
  static __device__ float value(T w) { return __uint_as_float(static_cast<unsigned>(w.lo)); }
};

template <int F>
__global__ void probe(int words, int iters, void* buf_, const uint4* big, size_t big_n, unsigned long long* stamps,
                      float* sink) {
  using Wd = Word<F>;
  using T = typename Wd::T;
  __shared__ int run;  // (the launch's dynamic shared memory only keeps the blocks one per SM)
  const int tid = threadIdx.x, G = gridDim.x;
  if (loader_warp(run, kThreads, big, big_n, sink)) return;  // a memory stream until the exchange is done
  T* buf = static_cast<T*>(buf_);
  const int per = (words + kThreads - 1) / kThreads;
  for (int it = 0; it < iters; ++it) {
    T* v = buf + size_t(it) * kMaxWords;
    const unsigned tag = static_cast<unsigned>(it + 1);
    const int w0 = split(blockIdx.x, words, G), w1 = split(blockIdx.x + 1, words, G);
    for (int w = w0 + tid; w < w1; w += kThreads) Wd::store(v + w, tag, float(w));
    T w[kMaxPerThread];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k)
      if (k < per && tid + kThreads * k < words) w[k] = Wd::load(v + tid + kThreads * k);
    for (;;) {
      bool all = true;
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        if (k >= per || tid + kThreads * k >= words) continue;
        if (!Wd::ready(w[k], tag)) all = false, w[k] = Wd::load(v + tid + kThreads * k);
      }
      if (all) break;
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k)
      if (k < per && tid + kThreads * k < words) s += Wd::value(w[k]);
    if (s == -1.f) sink[1] = s;
    asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
    if (blockIdx.x == 0 && tid == 0) stamps[it] = global_ns();
  }
  if (tid == 0) run = 0;
}

using Kernel = void (*)(int, int, void*, const uint4*, size_t, unsigned long long*, float*);
constexpr Kernel kKernels[] = {probe<kF32>, probe<kHalf>, probe<kPk3>, probe<kQ3>};

}  // namespace

int main(int argc, char** argv) {
  ChainHost host(argc, argv, 20000, "qwen_bytes_probe");
  const int iters = host.iters, sms = host.sms;
  const size_t buf_bytes = size_t(iters) * kMaxWords * 16;
  void* buf = nullptr;
  CK(cudaMalloc(&buf, buf_bytes));
  const size_t smem = 150 * 1024;  // one block per SM
  for (Kernel k : kKernels)
    CK(cudaFuncSetAttribute(reinterpret_cast<const void*>(k), cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  printf("device %s, %d SMs, %d iterations per run, median / p10 / p90 ns per exchange\n", host.prop.name, sms, iters);
  struct Case {
    int format, elements;
  };
  const Case cases[] = {{kF32, 0}, {kF32, 256},  {kF32, 512},  {kF32, 1024}, {kF32, 2048}, {kF32, 3072}, {kHalf, 1024},
                        {kHalf, 2048}, {kHalf, 3072}, {kPk3, 1024}, {kPk3, 3072}, {kQ3, 1024},  {kQ3, 2048}};
  for (int load = 0; load < 2; ++load) {
    for (const Case& c : cases) {
      const int elements = c.elements ? c.elements : sms;  // 0: one word per block
      const int words = (elements + kValuesPerWord[c.format] - 1) / kValuesPerWord[c.format];
      if (words > kMaxWords || words < sms) {
        printf("case %d/%d: %d words do not fit the probe\n", c.format, elements, words);
        return 1;
      }
      double first = 0;
      ChainHost::Spread r{};
      for (int rep = 0; rep < 2; ++rep) {
        CK(cudaMemset(buf, 0, buf_bytes));
        int w = words, it = iters;
        const uint4* bp = host.big;
        size_t bn = load ? host.big_bytes / 16 : 0;
        void* args[] = {&w, &it, &buf, &bp, &bn, &host.stamps, &host.sink};
        r = host.chain(reinterpret_cast<const void*>(kKernels[c.format]), args, kThreads + 32, smem);
        if (rep == 0) first = r.median;
      }
      printf("%-9s %-26s %5d elements %5d words %6d B polled per block: %6.0f (first run %6.0f) / %6.0f / %6.0f\n",
             load ? "streaming" : "idle", kFormatNames[c.format], elements, words, words * kWordBytes[c.format],
             r.median, first, r.p10, r.p90);
    }
  }
  CK(cudaFree(buf));
  return 0;
}
