// examples/qwen/device.cuh: device helpers of the decoder's kernels: bf16 packing, warp sums,
// streaming loads, the argmax key, per-head RMSNorm + RoPE, the online-softmax state of decode
// attention, and the mbarrier, bulk-copy and tensor-copy wrappers of the GEMVs' rings. Internal to
// the example (namespace qwen::dev, every function inline).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace qwen::dev {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// 8 bf16 packed in a uint4 -> 8 floats (bf16 -> fp32 is a 16-bit shift).
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ unsigned pack2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

/// Streaming 16-byte load of weights: read once per step, so do not pollute L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

/// Brings the `n` elements at `p` into this SM's L1, one 128-byte line per thread of the block, for a
/// kernel to issue before pdl::wait() on data that does not depend on earlier kernels (norm weights):
/// read after the wait they then cost an L1 hit instead of a round trip to L2.
template <class T>
__device__ __forceinline__ void prefetch_l1(const T* p, int n) {
  constexpr int kPerLine = 128 / sizeof(T);
  for (int i = threadIdx.x * kPerLine; i < n; i += blockDim.x * kPerLine)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p + i));
}

/// Maps a float to an unsigned int with the same order, and back.
__device__ __forceinline__ unsigned ordered(float v) {
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ordered(unsigned o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

/// ordered(v) packed with ~index, so that atomicMax picks the largest value and, among equal
/// values, the lowest index.
__device__ __forceinline__ unsigned long long argmax_key(float v, int idx) {
  return (static_cast<unsigned long long>(ordered(v)) << 32) | (0xFFFFFFFFu - static_cast<unsigned>(idx));
}

/// Per-head RMSNorm then rotate-half RoPE of one head (D values), done by one warp. Lane owns dims
/// lane*E+e (first half) and D/2+lane*E+e (second half), so RoPE pairs stay in the lane. The
/// parameters (norm weights, RoPE row) are loaded first, the head's values next, then `apply`.
template <int D>
struct HeadNormRope {
  static constexpr int E = D / 64;
  float wl[E], wh[E];
  float2 cs[E];
  __device__ __forceinline__ void load(const bf16* w, const float2* rope_row, int lane) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane * E + e;
      wl[e] = __bfloat162float(w[d]);
      wh[e] = __bfloat162float(w[D / 2 + d]);
      cs[e] = rope_row[d];
    }
  }
  /// lo/hi: the lane's values of the head in, normalised and rotated out.
  __device__ __forceinline__ void apply(float eps, float* lo, float* hi) const {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss += lo[e] * lo[e] + hi[e] * hi[e];
    ss = warp_sum(ss);
    const float rs = rsqrtf(ss / D + eps);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float a = lo[e] * rs * wl[e];
      const float b = hi[e] * rs * wh[e];
      lo[e] = a * cs[e].x - b * cs[e].y;
      hi[e] = b * cs[e].x + a * cs[e].y;
    }
  }
};

/// The same for a head at x written by an earlier kernel (read through L2). The norm
/// weights and the RoPE row are loaded together with x, not after the warp sum (one round trip to
/// memory instead of two).
template <int D>
__device__ __forceinline__ void norm_rope_head(const float* x, const bf16* w, float eps, const float2* rope_row,
                                               int lane, float* lo, float* hi) {
  constexpr int E = D / 64;
  HeadNormRope<D> nr;
  nr.load(w, rope_row, lane);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    lo[e] = __ldcg(x + lane * E + e);
    hi[e] = __ldcg(x + D / 2 + lane * E + e);
  }
  nr.apply(eps, lo, hi);
}

/// Merges the softmax states (max m, sum l, unnormalised outputs acc) of a warp's lane groups of LPT
/// lanes each (one position per group): after it every lane holds the state of the whole warp.
template <int G, int DPL, int LPT>
__device__ __forceinline__ void combine_lane_groups(float (&m)[G], float (&l)[G], float (&acc)[G][DPL]) {
#pragma unroll
  for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], o);
      const float mn = fmaxf(m[h], mo);
      const float a = m[h] == -INFINITY ? 0.f : __expf(m[h] - mn);
      const float b = mo == -INFINITY ? 0.f : __expf(mo - mn);
      l[h] = l[h] * a + lo * b;
#pragma unroll
      for (int j = 0; j < DPL; ++j) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[h][j], o);
        acc[h][j] = acc[h][j] * a + ao * b;
      }
      m[h] = mn;
    }
  }
}

/// Decode attention's per-lane state for G query heads (LPT lanes per token, DPL dims per lane):
/// running max m, sum l and unnormalised output acc of an online softmax. `add` takes one token's K/V
/// (this lane's DPL dims as NV uint4 of bf16; `valid` false: a lane group past the context, which
/// still takes part in the shuffles); `combine_groups` merges the warp's 32 / LPT lane groups.
template <int G, int DPL, int LPT>
struct SoftmaxState {
  static constexpr int NV = DPL / 8;
  float m[G], l[G], acc[G][DPL];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = -INFINITY, l[h] = 0.f;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
    }
  }
  __device__ __forceinline__ void add(const float (&q)[G][DPL], const uint4 (&kr)[NV], const uint4 (&vr)[NV],
                                      bool valid) {
    float kf[DPL], vf[DPL];
#pragma unroll
    for (int i = 0; i < NV; ++i) unpack8(kr[i], kf + 8 * i), unpack8(vr[i], vf + 8 * i);
    float s[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float d = 0.f;
#pragma unroll
      for (int j = 0; j < DPL; ++j) d = fmaf(q[h][j], kf[j], d);
#pragma unroll
      for (int o = 1; o < LPT; o <<= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      s[h] = d;
    }
    if (valid) {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float mn = fmaxf(m[h], s[h]);
        const float corr = __expf(m[h] - mn);  // m = -inf -> 0
        const float p = __expf(s[h] - mn);
        l[h] = l[h] * corr + p;
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(p, vf[j], acc[h][j] * corr);
        m[h] = mn;
      }
    }
  }
  /// Combines the warp's lane groups (one position each): every lane then holds the warp's state.
  __device__ __forceinline__ void combine_groups() { combine_lane_groups<G, DPL, LPT>(m, l, acc); }
};

/// Stores a warp's softmax state (lane group 0 holds it after the lane groups are combined; lane
/// `sub` of the group its DPL outputs) as warp `warp`'s entry of the block's cross-warp arrays
/// m[warps][G], l[warps][G], acc[warps][G][D].
template <int G, int DPL>
__device__ __forceinline__ void store_warp_state(const float (&m)[G], const float (&l)[G], const float (&acc)[G][DPL],
                                                 int warp, int grp, int sub, float* red_m, float* red_l,
                                                 float* red_acc, int D) {
  if (grp != 0) return;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (sub == 0) red_m[warp * G + h] = m[h], red_l[warp * G + h] = l[h];
#pragma unroll
    for (int j = 0; j < DPL; ++j) red_acc[(warp * G + h) * D + sub * DPL + j] = acc[h][j];
  }
}

/// Query head h's output d merged over the nw warps' states (store_warp_state's arrays), in warp
/// order: the max, the sum and the unnormalised output (output = a / l).
struct MergedState {
  float m, l, a;
};
__device__ __forceinline__ MergedState merge_warp_states(const float* red_m, const float* red_l, const float* red_acc,
                                                         int nw, int G, int D, int h, int d) {
  float mx = -INFINITY;
  for (int w = 0; w < nw; ++w) mx = fmaxf(mx, red_m[w * G + h]);
  float L = 0.f, A = 0.f;
  for (int w = 0; w < nw; ++w) {
    const float f = red_m[w * G + h] == -INFINITY ? 0.f : __expf(red_m[w * G + h] - mx);
    L += red_l[w * G + h] * f;
    A += red_acc[(w * G + h) * D + d] * f;
  }
  return {mx, L, A};
}

// ------------------------------------------------------------------------------------------------
// PTX wrappers of the ring GEMVs: mbarriers, bulk and tensor copies (cp.async.bulk[.tensor], sm_90)
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
/// Brings a kernel parameter's tensor map into the descriptor cache.
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}
/// Tensor copy global -> shared of the box at (c0, c1, c2) of `map` (a __grid_constant__ parameter),
/// completing on `bar`.
__device__ __forceinline__ void tensor_load_3d(void* dst, const void* map, int c0, int c1, int c2,
                                               unsigned long long* bar, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4}], [%5], %6;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(smem_addr(b)), "r"(parity)
      : "memory");
  return ok != 0;
}
/// Waits until the phase with `parity` of `b` has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  while (!mbar_try_wait(b, parity)) {
  }
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
/// Bulk copy global -> shared (16-byte aligned, size a multiple of 16), completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                          unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
/// 16-byte copy global -> shared that bypasses L1; `valid` false: fills 16 zero bytes, reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
/// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/// Orders this thread's generic-proxy shared-memory writes before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace qwen::dev
