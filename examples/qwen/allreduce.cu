// examples/qwen/allreduce.cu: the tensor-parallel sum of the ranks' O and down products over peer
// memory, added to the residual in one kernel (EngineOptions::tp_sum one_shot; kernels.cuh says
// what it guarantees). One launch per sum on every rank: a per-block arrival barrier across the
// ranks (flags written over NVLink, polled in local memory), then each block reads its share of
// every rank's product and adds the sum, in rank order, to the residual.
#include "kernels.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

namespace qwen {
namespace {

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) peer_sum_kernel(PeerSum p, int slot, std::size_t n4, float4* residual) {
  replay::pdl::launch_dependents();  // the next GEMV may stream its weights while the ranks meet
  replay::pdl::wait();               // this rank's product is complete
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    const unsigned call = p.calls[b] + 1;  // the same count on every rank: the ranks' launches match
    p.calls[b] = call;
    __threadfence_system();
    for (int r = 0; r < p.size; ++r)
      if (r != p.rank) store_release(p.flags[r] + p.rank * kPeerSumBlocks + b, call);
    const unsigned long long t0 = global_ns();
    for (int r = 0; r < p.size; ++r) {
      if (r == p.rank) continue;
      // A peer may already be one call ahead (it announced the next sum): compare modulo 2^32.
      while (static_cast<int>(load_acquire(p.flags[p.rank] + r * kPeerSumBlocks + b) - call) < 0)
        if (global_ns() - t0 > p.timeout_ns) __trap();
    }
  }
  __syncthreads();
  for (std::size_t i = b * std::size_t(kThreads) + threadIdx.x; i < n4; i += std::size_t(kPeerSumBlocks) * kThreads) {
    float4 sum = __ldcv(reinterpret_cast<const float4*>(p.in[0][slot]) + i);
    for (int r = 1; r < p.size; ++r) {
      const float4 v = __ldcv(reinterpret_cast<const float4*>(p.in[r][slot]) + i);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    float4 x = residual[i];
    x.x += sum.x, x.y += sum.y, x.z += sum.z, x.w += sum.w;
    residual[i] = x;
  }
}

}  // namespace

void launch_peer_sum(const PeerSum& p, int slot, std::size_t n, float* residual, replay::stream_ref s) {
  if (p.size < 2 || p.size > kMaxPeers || p.rank < 0 || p.rank >= p.size || p.calls == nullptr)
    throw replay::usage_error("qwen::launch_peer_sum: no peer group (PeerSum::size 0)");
  if ((slot != 0 && slot != 1) || n % 4 != 0)
    throw replay::usage_error("qwen::launch_peer_sum: slot must be 0 or 1 and n a multiple of 4");
  replay::launch(peer_sum_kernel, {.grid = dim3(kPeerSumBlocks), .block = dim3(kThreads), .stream = s, .pdl = true}, p,
                 slot, n / 4, reinterpret_cast<float4*>(residual));
}

}  // namespace qwen
