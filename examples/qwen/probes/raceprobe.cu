// examples/qwen/probes/raceprobe.cu: what compute-sanitizer racecheck makes of the handoffs the
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

enum Case { k_sync, k_racy, k_mbar_raw, k_mbar_war, k_ring, k_ring_self, k_cases };
const char* const kNames[k_cases] = {"sync", "racy", "mbar_raw", "mbar_war", "ring", "ring_self"};

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
      if (warp == 0) {
        if (lane == 0)
          for (int r = 0; r < kRounds; ++r) {
            const int s = r % kSlots;
            if (r >= kSlots) {
              spin_wait(&empty[s], (r / kSlots - 1) & 1);  // the consumer's 32 lanes read piece r - kSlots
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

}  // namespace

int main(int argc, char** argv) {
  int c = -1;
  for (int i = 0; i < k_cases; ++i)
    if (argc == 2 && std::strcmp(argv[1], kNames[i]) == 0) c = i;
  if (c < 0) {
    std::printf("usage: qwen_race_probe sync|racy|mbar_raw|mbar_war|ring|ring_self\n");
    return 2;
  }
  const bool streams = c == k_ring || c == k_ring_self;
  const int words = streams ? kRounds * kWords : kWords;
  unsigned* host = nullptr;
  CK(cudaMallocHost(&host, sizeof(unsigned) * words));
  unsigned long long expect = 0;
  for (int i = 0; i < words; ++i) host[i] = 2654435761u * unsigned(i + 1) >> 7, expect += host[i];
  unsigned* src = nullptr;
  unsigned long long* out = nullptr;
  CK(cudaMalloc(&src, sizeof(unsigned) * words));
  CK(cudaMalloc(&out, sizeof(unsigned long long)));
  CK(cudaMemcpy(src, host, sizeof(unsigned) * words, cudaMemcpyHostToDevice));
  CK(cudaMemset(out, 0xff, sizeof(unsigned long long)));  // poison
  probe<<<1, 64>>>(c, src, out);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long got = 0;
  CK(cudaMemcpy(&got, out, sizeof got, cudaMemcpyDeviceToHost));
  // The racy case may read either value; every other case must see exactly the source words.
  const bool ok = c == k_racy || got == expect;
  std::printf("%s: %s (checksum %llu, expected %llu)\n", kNames[c], ok ? "ok" : "WRONG", got, expect);
  CK(cudaFree(src));
  CK(cudaFree(out));
  CK(cudaFreeHost(host));
  return ok ? 0 : 1;
}
