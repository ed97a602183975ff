// research/qwen/probes/clusterprobe.cu: what an exchange costs inside a thread-block cluster
// (distributed shared memory and the cluster barrier), against the grid-wide exchanges of the
// persistent kernel (mega.cu) and of the counted sums of reduceprobe.cu (docs/perf-notes.md). The
// 0.6B layer has five grid-wide exchanges; a design with clusters could keep one of them inside a
// cluster (a query head's q/k/v rows computed by the cluster that runs its attention) and
// pre-reduce a projection split by its input inside each cluster before the grid-wide atomic sums
// (fewer contributors per element).
//
// One block per SM (the dynamic shared memory keeps them apart), 8 warps; grid = the most blocks
// that are whole clusters and resident together (cudaOccupancyMaxActiveClusters). Each iteration
// every block contributes, then waits for the exchange to complete; block 0 stamps each iteration.
// Modes:
//   0 tagged:        block b writes its own ~1024/grid elements as {value, tag} words; every block
//                    polls all 1024 words (the persistent kernel's exchange).
//   1 counted:       every block adds its partial of all 1024 elements to counted 64-bit words
//                    (red.relaxed.gpu.add.u64: count in the top 8 bits, fixed point below); every
//                    block polls until each count equals the number of blocks.
//   2 counted, pre-reduced in the cluster: every block writes its partial of all 1024 elements to
//                    its shared memory; after a cluster barrier, rank r of a cluster sums its 1024/C
//                    elements over the cluster's blocks (distributed shared memory) and adds them to
//                    the counted words, whose counts then go to the number of clusters.
//   3 cluster exchange: rank r writes its 512/C elements of a 512-element vector (a query head's
//                    q, k and v rows are 384) into its shared memory; after a cluster barrier every
//                    block reads all 512 from the cluster's blocks. Nothing grid-wide.
//   4 cluster barrier alone.
//   5 cluster push: rank r stores its 512/C elements into every block of the cluster (st.async,
//                    which completes bytes on the receiver's mbarrier); each block waits on its own
//                    mbarrier (acquire, cluster scope) and reads the vector from its shared memory.
//                    No cluster barrier on the path.
//   qwen_cluster_probe [iterations]
#include "../device_helpers.cuh"
#include "exchange_words.cuh"

#include <algorithm>
#include <cooperative_groups.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

namespace cg = cooperative_groups;
using namespace qwen::dev;
using namespace qwen::probes;

constexpr int kN = 1024;       // elements of a grid-wide exchange (the 0.6B hidden size)
constexpr int kV = 512;        // elements of a cluster exchange
constexpr int kThreads = 256;  // threads per block (8 warps)

__device__ __forceinline__ unsigned cluster_addr(const void* p, int rank) {  // a peer's shared address
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_async(unsigned remote, float v, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait_cluster(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\tselp.u32 "
      "%0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(smem_addr(b)), "r"(parity)
      : "memory");
  return ok != 0;
}

__global__ void probe(int mode, int iters, unsigned long long* buf, unsigned long long* stamps,
                      long long* cycles, float* sink) {
  extern __shared__ float4 smem_raw[];
  float* part = reinterpret_cast<float*>(smem_raw);  // [2][kN]: this block's partials, by iteration parity
  __shared__ unsigned long long bar[2];               // mode 5: data of iterations of each parity received
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, G = gridDim.x;
  float keep = 0.f;
  if (tid == 0) mbar_init(&bar[0], 1), mbar_init(&bar[1], 1), mbar_fence_init();
  cluster.sync();  // every block's barriers are initialised before any peer stores to it
  for (int it = 0; it < iters; ++it) {
    unsigned long long* v = buf + size_t(it) * kN;
    float* mine = part + (it & 1) * kN;
    const unsigned tag = static_cast<unsigned>(it + 1);
    int need = G;  // counted modes: contributions per element
    if (mode == 0) {
      const int e0 = split(blockIdx.x, kN, G), e1 = split(blockIdx.x + 1, kN, G);
      for (int e = e0 + tid; e < e1; e += kThreads)
        st_w(v + e, (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(float(e)));
    } else if (mode == 1) {
#pragma unroll
      for (int k = 0; k < kN / kThreads; ++k) {
        const int e = tid + kThreads * k;
        red_w(v + e, counted(0.001f * e - 0.3f));
      }
    } else if (mode == 2) {
#pragma unroll
      for (int k = 0; k < kN / kThreads; ++k) {
        const int e = tid + kThreads * k;
        mine[e] = 0.001f * e - 0.3f + 0.01f * rank;
      }
      cluster.sync();  // every block's partials are in its shared memory
      const int e0 = split(rank, kN, C), e1 = split(rank + 1, kN, C);
      for (int e = e0 + tid; e < e1; e += kThreads) {
        float s = 0.f;
        for (int q = 0; q < C; ++q) s += cluster.map_shared_rank(mine, q)[e];
        red_w(v + e, counted(s));
      }
      need = G / C;
    } else if (mode == 5) {
      // Expect this iteration's kV floats (the arrival may come after some of the bytes: the phase
      // completes once both the arrival and every byte are in). Iterations it and it + 2 share a
      // buffer and a barrier: a peer stores for it + 2 only after its own it + 1 completed, which
      // needs this block's stores of it + 1, issued after this block read iteration it.
      if (tid == 0) mbar_arrive_tx(&bar[it & 1], kV * 4);
      const int n = kV / C;
      for (int i = tid; i < n * C; i += kThreads) {  // element rank * n + i % n, to block i / n
        const int q = i / n, e = rank * n + i % n;
        st_async(cluster_addr(mine + e, q), float(e + it), cluster_addr(&bar[it & 1], q));
      }
      while (!mbar_try_wait_cluster(&bar[it & 1], (it >> 1) & 1)) {
      }
      for (int e = tid; e < kV; e += kThreads) keep += mine[e];
    } else {
      if (mode == 3)  // (C divides kV)
        for (int e = rank * (kV / C) + tid; e < (rank + 1) * (kV / C); e += kThreads) mine[e] = float(e + it);
      cluster.sync();
      if (mode == 3) {
        // every block reads the whole vector: element e from the rank that wrote it
        for (int e = tid; e < kV; e += kThreads) keep += cluster.map_shared_rank(mine, e / (kV / C))[e];
        // the next iteration writes the other buffer; the one after writes this one again, after
        // a barrier that every reader of this iteration has passed
      }
    }
    if (mode <= 2) {
      // poll all kN elements: 4 per thread, re-requesting those not complete
      unsigned long long w[kN / kThreads];
#pragma unroll
      for (int k = 0; k < kN / kThreads; ++k) w[k] = ld_w(v + tid + kThreads * k);
      for (;;) {
        bool all = true;
#pragma unroll
        for (int k = 0; k < kN / kThreads; ++k) {
          const bool ok = mode == 0 ? static_cast<unsigned>(w[k] >> 32) == tag : static_cast<int>(w[k] >> 56) == need;
          if (!ok) all = false, w[k] = ld_w(v + tid + kThreads * k);
        }
        if (all) break;
      }
#pragma unroll
      for (int k = 0; k < kN / kThreads; ++k) keep += static_cast<float>(w[k] & 0xff);
    }
    __syncthreads();
    if (blockIdx.x == 0 && tid == 0) stamps[it] = global_ns(), cycles[it] = clock64();
  }
  if (keep == -1.f) sink[0] = keep;
  cluster.sync();  // no block leaves while a peer may still read its shared memory
}

/// A launch of `probe` in clusters of C blocks: the configuration, and how many such clusters can be
/// resident at once (0 where none can).
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  ClusterLaunch(int C, int grid, size_t smem) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(C), attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr, cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // cfg points at attr
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
  [[nodiscard]] int resident(cudaError_t* error = nullptr) const {
    int n = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, probe, &cfg);
    if (error != nullptr) *error = e;
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess ? n : 0;
  }
};

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 400;
  if (iters <= 20 || iters > 100000) {  // the first 20 exchanges are warm-up, not timed
    printf("usage: qwen_cluster_probe [iterations: 21..100000, default 400]\n");
    return 2;
  }
  int dev = 0, sms = 0, clock_khz = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  if (sms > 255) {
    printf("more SMs than a counted word's 8-bit count holds\n");
    return 1;
  }
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const int cluster_sizes[] = {1, 2, 4, 8, 16};

  // Which grids of clusters can be resident at once, with one block per SM at two shared-memory sizes
  // (the persistent kernel uses nearly all of it).
  printf("device %s, %d SMs; resident clusters of C blocks, one block per SM:\n", prop.name, sms);
  cudaFuncAttributes fa{};
  CK(cudaFuncGetAttributes(&fa, probe));
  for (size_t smem : {size_t(150) << 10, size_t(prop.sharedMemPerBlockOptin) - fa.sharedSizeBytes}) {
    CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    printf("  %zu KiB:", smem >> 10);
    for (int C : cluster_sizes) {
      cudaError_t e = cudaSuccess;
      const int n = ClusterLaunch(C, sms / C * C, smem).resident(&e);
      if (e != cudaSuccess) printf("  C=%d: %s", C, cudaGetErrorString(e));
      else printf("  C=%d: %d (%d SMs)", C, n, n * C);
    }
    printf("\n");
  }

  const size_t smem = size_t(150) << 10;
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  unsigned long long *buf = nullptr, *stamps = nullptr;
  long long* cycles = nullptr;
  float* sink = nullptr;
  const size_t buf_words = size_t(iters) * kN;
  CK(cudaMalloc(&buf, buf_words * 8));
  CK(cudaMalloc(&stamps, iters * 8));
  CK(cudaMalloc(&cycles, iters * 8));
  CK(cudaMalloc(&sink, 64));
  const char* names[] = {"tagged own slice (grid)", "counted, every block adds all 1024 (grid)",
                         "counted, pre-reduced in the cluster (grid)", "cluster exchange of 512 (DSMEM)",
                         "cluster barrier alone", "cluster push of 512 (st.async, mbarrier)"};
  printf("%d iterations per run; per exchange: median ns (globaltimer) / median cycles (clock64, SM clock "
         "%d MHz) / mean ns\n",
         iters, clock_khz / 1000);
  std::vector<unsigned long long> h(iters);
  std::vector<long long> hc(iters);
  for (int mode = 0; mode < 6; ++mode) {
    for (int C : cluster_sizes) {
      if (mode <= 1 && C != 1) continue;   // grid-wide baselines: no cluster
      if (mode >= 2 && C == 1) continue;   // cluster modes
      const int resident = ClusterLaunch(C, sms / C * C, smem).resident();
      if (resident <= 0) {
        printf("%-44s C=%-2d  (cannot be resident)\n", names[mode], C);
        continue;
      }
      const int grid = std::min(sms / C, resident) * C;  // every block resident: the polls need it
      const ClusterLaunch launch(C, grid, smem);
      for (int rep = 0; rep < 2; ++rep) {
        CK(cudaMemset(buf, 0, buf_words * 8));
        CK(cudaLaunchKernelEx(&launch.cfg, probe, mode, iters, buf, stamps, cycles, sink));
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        if (rep == 0) continue;  // warm-up run
        CK(cudaMemcpy(h.data(), stamps, iters * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hc.data(), cycles, iters * 8, cudaMemcpyDeviceToHost));
        std::vector<double> d, dc;
        for (int i = 20; i < iters; ++i) d.push_back(double(h[i] - h[i - 1])), dc.push_back(double(hc[i] - hc[i - 1]));
        std::sort(d.begin(), d.end());
        std::sort(dc.begin(), dc.end());
        const double mean = double(h[iters - 1] - h[19]) / (iters - 20);
        printf("%-44s C=%-2d grid %3d: %7.0f ns / %6.0f cycles / %7.1f ns\n", names[mode], C, grid, d[d.size() / 2],
               dc[dc.size() / 2], mean);
      }
    }
  }
  return 0;
}
