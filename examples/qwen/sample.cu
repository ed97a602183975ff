// examples/qwen/sample.cu: the token sampler: greedy, or temperature / top-k / top-p sampling by the
// Gumbel-max trick; one block per row, exact, no sort, no allocation (safe under capture).
//
// A row's logits are read from global memory (L2) once per pass:
//   1. the largest logit, as argmax_key (ties to the lowest index); greedy rows stop here;
//   2. top-k: the k-th largest logit by radix select over the logits' order-preserving 32-bit keys,
//      8 bits per pass from the most significant: each pass counts, in a 256-bin histogram, the
//      logits that match the digits chosen so far, and picks the digit at which the count from the
//      top reaches k (4 passes);
//   3. top-p: the same radix select weighing each logit kept by top-k by its probability mass,
//      exp((x - max) / T) in 2^-40 fixed point (integer sums: the same threshold on every run),
//      down to the smallest key whose mass from the top reaches ceil(top_p * total);
//   4. Gumbel-max over the kept logits: the winner of (x - max) / T + g_i with g_i = -log(-log(u_i)),
//      u_i uniform in (0, 1) from (seed, position generated, i) (common/rng.hpp). The winner is a
//      draw from softmax(x / T) over the kept set.
// Every logit tied with a threshold is kept.
#include "sample.cuh"
#include "device.cuh"

#include <common/rng.hpp>

#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <cstdint>

namespace qwen {
namespace {

using namespace dev;
using u64 = unsigned long long;

/// Probability mass of logit v relative to the largest, exp((v - xmax) / T) in [0, 1], in units of 2^-40.
__device__ __forceinline__ u64 mass(float v, float xmax, float inv_t) {
  const float e = expf((v - xmax) * inv_t);
  return e > 0.f ? __float2ull_rn(e * 1099511627776.0f) : 0ull;
}

struct Shared {
  u64 hist[256];   // one radix pass's histogram
  u64 red[32];     // per-warp maxima
  u64 need;        // weight still to collect at and below the digits chosen so far
  unsigned digit;  // the digit the last pass chose
};

/// The largest v over the block, returned to every thread.
__device__ u64 block_max(u64 v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  if ((threadIdx.x & 31) == 0) sh.red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh.red[0];
  for (int w = 1; w < kSampleThreads / 32; ++w) v = sh.red[w] > v ? sh.red[w] : v;
  __syncthreads();  // sh.red may be reused
  return v;
}

/// hist[bin] += w, summed first over the lanes of the warp with the same bin (bin 256: nothing to
/// add), so that logits crowding one bin do not serialise on one shared-memory atomic. Called by
/// every lane of the warp together; w < 2^41 (added as two 20-bit halves, 32 lanes at most).
__device__ __forceinline__ void hist_add(u64* hist, unsigned bin, u64 w) {
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(w & 0xFFFFFu));
  const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(w >> 20));
  if (bin < 256 && int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (u64(hi) << 20) + lo);
}

enum class weigh { count, mass };

/// Warp 0, after a pass's histogram: picks the highest bin at which the weight summed from the top
/// bin down reaches sh.need (on the first pass: k, or ceil(top_p * total mass)), and leaves in
/// sh.need what is still to collect inside that bin. Lane l scans bins 255 - 8l down to 248 - 8l.
template <weigh W>
__device__ void choose_digit(Shared& sh, bool first, float top_p, int k) {
  const int lane = threadIdx.x;
  u64 v[8], sum = 0;
  for (int j = 0; j < 8; ++j) v[j] = sh.hist[255 - 8 * lane - j], sum += v[j];
  u64 incl = sum;  // inclusive prefix over lanes: weight in bins >= 248 - 8 lane
  for (int o = 1; o < 32; o <<= 1) {
    const u64 t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  const u64 total = __shfl_sync(0xffffffffu, incl, 31);
  const u64 need = !first              ? sh.need
                   : W == weigh::count ? u64(k)
                                       : static_cast<u64>(ceil(double(top_p) * double(total)));
  __syncwarp();  // every lane has read sh.need before one lane writes it
  u64 c = incl - sum;
  if (c < need && incl >= need)  // exactly one lane: the digit is in its bins
    for (int j = 0; j < 8; c += v[j], ++j)
      if (c + v[j] >= need) {
        sh.digit = 255u - 8u * lane - j;
        sh.need = need - c;
        break;
      }
}

/// The largest key t for which the weight (count, or mass) of the logits with key >= t, among
/// those with key >= floor, reaches k (count) or ceil(top_p * their total mass) (mass).
template <weigh W>
__device__ unsigned radix_select(const float* x, int V, unsigned floor, float xmax, float inv_t, float top_p,
                                 int k, Shared& sh) {
  unsigned prefix = 0, mask = 0;  // the digits chosen so far and the bits they cover
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kSampleThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < V; base += kSampleThreads) {  // the same trip count in every lane: hist_add
      const int i = base + int(threadIdx.x);
      unsigned bin = 256;
      u64 w = 0;
      if (i < V) {
        const float v = x[i];
        const unsigned o = ordered(v);
        if (o >= floor && (o & mask) == prefix) {
          bin = (o >> shift) & 255u;
          w = W == weigh::count ? 1ull : mass(v, xmax, inv_t);
        }
      }
      hist_add(sh.hist, bin, w);
    }
    __syncthreads();
    if (threadIdx.x < 32) choose_digit<W>(sh, shift == 24, top_p, k);
    __syncthreads();
    prefix |= sh.digit << shift;
    mask |= 255u << shift;
  }
  return prefix;
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int V, const RowStep* rows, const SampleParams* params,
                  u64* keys) {
  replay::pdl::launch_dependents();
  __shared__ Shared sh;
  const int r = blockIdx.x;
  const SampleParams p = *params;        // step metadata, read before the wait as every kernel does
  const std::int32_t pos = rows[r].pos;  // position of the row's input token
  replay::pdl::wait();
  const float* x = logits + std::size_t(r) * V;

  // 1. The largest logit, ties to the lowest index (the fused argmax's key).
  u64 best = 0;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const u64 key = argmax_key(x[i], i);
    best = key > best ? key : best;
  }
  best = block_max(best, sh);
  const float xmax = from_ordered(static_cast<unsigned>(best >> 32));
  const float inv_t = 1.f / p.temperature;
  if (p.temperature <= 0.f || p.top_k == 1 || !isfinite(inv_t) || !isfinite(xmax)) {
    if (threadIdx.x == 0) keys[r] = best;
    return;
  }

  // 2, 3. The smallest key kept: top-k's, then top-p's over what top-k keeps.
  unsigned floor = 0;
  if (p.top_k > 1 && p.top_k < V) floor = radix_select<weigh::count>(x, V, 0u, xmax, inv_t, 1.f, p.top_k, sh);
  if (p.top_p < 1.f) floor = radix_select<weigh::mass>(x, V, floor, xmax, inv_t, p.top_p, 0, sh);

  // 4. Gumbel-max over the kept logits; the counter is (position generated, token id).
  const std::uint64_t counter = std::uint64_t(static_cast<std::uint32_t>(pos + 1)) << 32;
  u64 win = 0;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const float v = x[i];
    if (ordered(v) < floor) continue;
    const std::uint64_t bits = replay_examples::random_bits(p.seed, counter | static_cast<std::uint32_t>(i));
    const float u = (static_cast<float>(bits >> 41) + 0.5f) * (1.0f / 8388608.0f);  // 23 bits: in (0, 1)
    const u64 key = argmax_key((v - xmax) * inv_t - logf(-logf(u)), i);
    win = key > win ? key : win;
  }
  win = block_max(win, sh);
  if (threadIdx.x == 0) keys[r] = win;
}

}  // namespace

void launch_sample(const float* logits, int V, const RowStep* rows, const SampleParams* params, int nrows,
                   unsigned long long* keys, replay::stream_ref s) {
  if (logits == nullptr || rows == nullptr || params == nullptr || keys == nullptr)
    throw replay::usage_error("qwen::launch_sample: logits, rows, params and keys must be device pointers");
  if (V < 1 || nrows < 1) throw replay::usage_error("qwen::launch_sample: needs V >= 1 and at least one row");
  replay::launch(sample_kernel,
                 {.grid = dim3(nrows), .block = dim3(kSampleThreads), .stream = s, .pdl = true}, logits, V,
                 rows, params, keys);
}

}  // namespace qwen
