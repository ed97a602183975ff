// research/qwen/probes/raceprobe.cu: what compute-sanitizer racecheck makes of the handoffs the
// persistent kernel uses. Each case is one small kernel (one block: a producer warp and a consumer
// warp sharing a buffer in shared memory) and checks its own result; run each case in its own
// process under racecheck and compare the hazard counts:
//   compute-sanitizer --tool racecheck --racecheck-report all qwen_race_probe <case>
// Cases (every one but `racy` is correctly synchronised by the PTX memory model):
//   sync       write, __syncthreads, read (the tool's baseline: no hazard expected)
//   racy       write and read with nothing between them (a real race: hazards expected)
//   mbar_raw   32 lanes write, each arrives on an mbarrier; the other warp waits on it, then reads
//   mbar_war   32 lanes read, each arrives; the other warp waits on it, then writes (generic stores)
//   ring       the persistent kernel's ring: the producer lane waits on the slot's "empty" barrier
//              (32 consumer arrivals), fences the async proxy, bulk-copies the next piece into the
//              slot on its "full" barrier; the consumer warp waits on "full", reads, arrives
//   ring_self  the same ring refilled by the consumer warp's lane 0 after __syncwarp
//   ring_test  `ring` with the producer polling the "empty" barrier with mbarrier.test_wait
//   ring8_try  the persistent kernel's block: 8 consumer warps with a ring each, producer lane w
//              serving warp w's ring (lanes diverge; try_wait)
//   ring8_test the same with test_wait, as the persistent kernel's producer does
//   ring8_serial ring8_test with the ready lanes issuing their fence and copy one lane at a time
//   ring8_sync ring8_test with a __syncwarp between the lanes' waits and their (joint) copies
//   qwen_race_probe <case>    (prints "<case>: ok" or what went wrong; exit 0 on ok)
#include "../device_helpers.cuh"

#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

using namespace qwen::dev;

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e_));                      \
      return 2;                                                                 \
    }                                                                           \
  } while (0)

namespace {

constexpr int kWords = 1024;   // 32-bit words per slot (4 KiB, a 2048-weight ring slot)
constexpr int kSlots = 4;      // ring slots
constexpr int kRounds = 64;    // pieces streamed through the ring

enum Case {
  k_sync, k_racy, k_mbar_raw, k_mbar_war, k_ring, k_ring_self, k_ring_test, k_ring8_try, k_ring8_test, k_ring8_serial,
  k_ring8_sync, k_cases
};
const char* const kNames[k_cases] = {"sync",      "racy",      "mbar_raw",  "mbar_war",   "ring",
                                     "ring_self", "ring_test", "ring8_try", "ring8_test", "ring8_serial",
                                     "ring8_sync"};
constexpr int kRingWarps = 8;  // consumer warps of the ring8 cases

__device__ void spin_wait(unsigned long long* b, unsigned parity) {
  while (!mbar_try_wait(b, parity)) {
  }
}

/// Warp 0 is the producer, warp 1 the consumer; out[0] = the consumer's checksum.
__global__ void probe(int c, const unsigned* src, unsigned long long* out) {
  __shared__ __align__(128) unsigned buf[kSlots][kWords];
  __shared__ unsigned long long full[kSlots], empty[kSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 32);
    mbar_fence_init();
  }
  __syncthreads();
  unsigned long long sum = 0;
  switch (c) {
    case k_sync:
    case k_racy:
      if (warp == 0)
        for (int i = lane; i < kWords; i += 32) buf[0][i] = src[i];
      if (c == k_sync) __syncthreads();
      if (warp == 1)
        for (int i = lane; i < kWords; i += 32) sum += buf[0][(i + 7) % kWords];
      break;
    case k_mbar_raw:
      if (warp == 0) {
        for (int i = lane; i < kWords; i += 32) buf[0][i] = src[i];
        mbar_arrive(&empty[0]);  // release of this lane's stores
      } else {
        spin_wait(&empty[0], 0);  // acquire
        for (int i = lane; i < kWords; i += 32) sum += buf[0][(i + 7) % kWords];
      }
      break;
    case k_mbar_war:
      for (int i = threadIdx.x; i < kWords; i += blockDim.x) buf[0][i] = src[i];
      __syncthreads();
      if (warp == 1) {
        for (int i = lane; i < kWords; i += 32) sum += buf[0][(i + 7) % kWords];
        mbar_arrive(&empty[0]);
      } else {
        spin_wait(&empty[0], 0);
        for (int i = lane; i < kWords; i += 32) buf[0][i] = 0xdeadbeefu;
      }
      break;
    case k_ring:
    case k_ring_test:
      if (warp == 0) {
        if (lane == 0)
          for (int r = 0; r < kRounds; ++r) {
            const int s = r % kSlots;
            if (r >= kSlots) {
              const unsigned parity = (r / kSlots - 1) & 1;  // the consumer's 32 lanes read piece r - kSlots
              if (c == k_ring) spin_wait(&empty[s], parity);
              else
                while (!mbar_test_wait(&empty[s], parity)) {
                }
              fence_proxy_async();
            }
            mbar_arrive_tx(&full[s], kWords * 4);
            bulk_load(buf[s], src + std::size_t(r) * kWords, kWords * 4, &full[s]);
          }
      } else {
        for (int r = 0; r < kRounds; ++r) {
          const int s = r % kSlots;
          spin_wait(&full[s], (r / kSlots) & 1);
          for (int i = lane; i < kWords; i += 32) sum += buf[s][(i + 7) % kWords];
          mbar_arrive(&empty[s]);
        }
      }
      break;
    case k_ring_self:
      if (warp == 1) {
        if (lane == 0)
          for (int r = 0; r < kSlots; ++r) {
            mbar_arrive_tx(&full[r], kWords * 4);
            bulk_load(buf[r], src + std::size_t(r) * kWords, kWords * 4, &full[r]);
          }
        __syncwarp();
        for (int r = 0; r < kRounds; ++r) {
          const int s = r % kSlots;
          spin_wait(&full[s], (r / kSlots) & 1);
          for (int i = lane; i < kWords; i += 32) sum += buf[s][(i + 7) % kWords];
          __syncwarp();
          if (lane == 0 && r + kSlots < kRounds) {
            fence_proxy_async();
            mbar_arrive_tx(&full[s], kWords * 4);
            bulk_load(buf[s], src + std::size_t(r + kSlots) * kWords, kWords * 4, &full[s]);
          }
        }
      }
      break;
    default:
      break;
  }
  if (warp == 1) {
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) out[0] = sum;
  }
}


/// The persistent kernel's block shape: consumer warps 0..7 each stream kRounds pieces of `src`
/// through their own ring in dynamic shared memory; lane w of the producer warp (warp 8) keeps ring w
/// full, polling its "empty" barriers round-robin as the persistent kernel's producer does.
/// out[w] = consumer warp w's checksum.
// Wait 0: try_wait; 1: test_wait; 2: test_wait, then the ready lanes issue one at a time; 3: test_wait,
// __syncwarp, then the ready lanes issue together.
template <int Wait>
__global__ void ring8(const unsigned* src, unsigned long long* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned long long full[kRingWarps][kSlots], empty[kRingWarps][kSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kRingWarps; ++w)
      for (int s = 0; s < kSlots; ++s) mbar_init(&full[w][s], 1), mbar_init(&empty[w][s], 32);
    mbar_fence_init();
  }
  __syncthreads();
  auto slot = [&](int w, int s) { return reinterpret_cast<unsigned*>(smem) + (std::size_t(w) * kSlots + s) * kWords; };
  auto piece = [&](int w, int r) { return src + (std::size_t(w) * kRounds + r) * kWords; };
  if (warp == kRingWarps) {
    bool active = lane < kRingWarps;
    int r = 0;
    if (active)
      for (; r < kSlots; ++r) {
        mbar_arrive_tx(&full[lane][r], kWords * 4);
        bulk_load(slot(lane, r), piece(lane, r), kWords * 4, &full[lane][r]);
      }
    while (__any_sync(0xffffffffu, active)) {
      const int s = r % kSlots;
      const unsigned parity = (r / kSlots - 1) & 1;
      const bool ready = active && (Wait == 0 ? mbar_try_wait(&empty[lane][s], parity) : mbar_test_wait(&empty[lane][s], parity));
      auto issue = [&] {
        fence_proxy_async();
        mbar_arrive_tx(&full[lane][s], kWords * 4);
        bulk_load(slot(lane, s), piece(lane, r), kWords * 4, &full[lane][s]);
        active = ++r < kRounds;
      };
      if constexpr (Wait == 3) __syncwarp();
      if constexpr (Wait == 2) {
        for (unsigned m = __ballot_sync(0xffffffffu, ready); m != 0; m &= m - 1) {
          if (lane == __ffs(m) - 1) issue();
          __syncwarp();
        }
      } else if (ready) {
        issue();
      }
    }
  } else {
    unsigned long long sum = 0;
    for (int r = 0; r < kRounds; ++r) {
      const int s = r % kSlots;
      spin_wait(&full[warp][s], (r / kSlots) & 1);
      const unsigned* b = slot(warp, s);
      for (int i = lane; i < kWords; i += 32) sum += b[(i + 7) % kWords];
      mbar_arrive(&empty[warp][s]);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) out[warp] = sum;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int c = -1;
  for (int i = 0; i < k_cases; ++i)
    if (argc == 2 && std::strcmp(argv[1], kNames[i]) == 0) c = i;
  if (c < 0) {
    std::printf("usage: qwen_race_probe sync|racy|mbar_raw|mbar_war|ring|ring_self|ring_test|ring8_try|ring8_test|ring8_serial|ring8_sync\n");
    return 2;
  }
  const bool eight = c == k_ring8_try || c == k_ring8_test || c == k_ring8_serial || c == k_ring8_sync;
  const bool streams = c == k_ring || c == k_ring_self || c == k_ring_test || eight;
  const int outs = eight ? kRingWarps : 1;
  const int words = eight ? kRingWarps * kRounds * kWords : streams ? kRounds * kWords : kWords;
  unsigned* host = nullptr;
  CK(cudaMallocHost(&host, sizeof(unsigned) * words));
  unsigned long long expect[kRingWarps] = {};
  for (int i = 0; i < words; ++i)
    host[i] = 2654435761u * unsigned(i + 1) >> 7, expect[eight ? i / (kRounds * kWords) : 0] += host[i];
  unsigned* src = nullptr;
  unsigned long long* out = nullptr;
  CK(cudaMalloc(&src, sizeof(unsigned) * words));
  CK(cudaMalloc(&out, sizeof(unsigned long long) * outs));
  CK(cudaMemcpy(src, host, sizeof(unsigned) * words, cudaMemcpyHostToDevice));
  CK(cudaMemset(out, 0xff, sizeof(unsigned long long) * outs));  // poison
  if (eight) {
    const int smem = kRingWarps * kSlots * kWords * 4;
    auto k = c == k_ring8_try ? ring8<0> : c == k_ring8_test ? ring8<1> : c == k_ring8_serial ? ring8<2> : ring8<3>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    k<<<1, (kRingWarps + 1) * 32, smem>>>(src, out);
  } else {
    probe<<<1, 64>>>(c, src, out);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long got[kRingWarps] = {};
  CK(cudaMemcpy(got, out, sizeof(unsigned long long) * outs, cudaMemcpyDeviceToHost));
  // The racy case may read either value; every other case must see exactly the source words.
  bool ok = true;
  for (int w = 0; w < outs; ++w) ok = ok && (c == k_racy || got[w] == expect[w]);
  std::printf("%s: %s (checksum %llu, expected %llu)\n", kNames[c], ok ? "ok" : "WRONG", got[0], expect[0]);
  CK(cudaFree(src));
  CK(cudaFree(out));
  CK(cudaFreeHost(host));
  return ok ? 0 : 1;
}
