// benchmarks/common.hpp: helpers shared by replay's Google Benchmark programs.
//
// - replay_bench::main(): Google Benchmark's main plus the device, driver and CUDA runtime in the
//   benchmark context (so every JSON file names the machine it was measured on).
// - device_available() / skip_without_device(state): benchmarks are registered without touching
//   CUDA, so `--benchmark_list_tests` works on machines without a GPU (CI); each benchmark checks
//   for a device first and skips with "no CUDA device" where there is none.
// - host_clock: wall-clock timing for manual times that include host work (launch, synchronise).
// - gpu_timer: GPU time between two points of a stream (CUDA events).
// - l2_flusher: evicts the L2 cache (a memset of twice its size) where a warm cache would flatter
//   the result.
// - d2d_bandwidth(): device-to-device copy bandwidth (bytes read + written per second), the floor
//   of a bandwidth-bound decode step, measured once per process with buffers far larger than L2.
// - launch_gate: holds a stream on a spinning kernel until the host has queued all the work to be
//   timed, so GPU-side times are not throttled by the host's launch rate.
#pragma once

#include <replay/replay.hpp>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

namespace replay_bench {

// ---- device presence and context --------------------------------------------------------------

/// True when a CUDA device can be used. Never throws; asked of CUDA once per process.
inline bool device_available() noexcept {
  static const bool ok = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess && n > 0;
  }();
  return ok;
}

/// Skips the benchmark (an error entry in the report, not a result) when there is no device.
/// Returns true when it skipped; the caller returns at once.
inline bool skip_without_device(benchmark::State& state) {
  if (device_available()) return false;
  state.SkipWithError("no CUDA device");
  return true;
}

/// Properties of device 0, read once.
inline const cudaDeviceProp& device_properties() {
  static const cudaDeviceProp prop = [] {
    cudaDeviceProp p{};
    REPLAY_CHECK(cudaGetDeviceProperties(&p, 0));
    return p;
  }();
  return prop;
}

/// "13.0" from 13000.
inline std::string cuda_version_string(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

/// Adds the device (name, compute capability, memory, L2, SMs), the driver's CUDA version, the
/// runtime version and the driver release (when NVML-free means allow) to the benchmark context.
inline void add_device_context() {
  benchmark::AddCustomContext("cuda_runtime", cuda_version_string(CUDART_VERSION));
  if (!device_available()) {
    benchmark::AddCustomContext("device", "none");
    return;
  }
  const cudaDeviceProp& p = device_properties();
  int driver = 0;
  REPLAY_CHECK(cudaDriverGetVersion(&driver));
  benchmark::AddCustomContext("device", p.name);
  benchmark::AddCustomContext("compute_capability", fmt::format("{}.{}", p.major, p.minor));
  benchmark::AddCustomContext("sm_count", std::to_string(p.multiProcessorCount));
  benchmark::AddCustomContext("gpu_memory_gib", fmt::format("{:.1f}", p.totalGlobalMem / 1073741824.0));
  benchmark::AddCustomContext("l2_bytes", std::to_string(p.l2CacheSize));
  benchmark::AddCustomContext("driver_cuda", cuda_version_string(driver));
  // The driver's release number (e.g. 580.65.06) is not in the runtime API; run.sh passes it in
  // from nvidia-smi as --benchmark_context=driver=<release>.
}

/// Google Benchmark's main with the device context. Use: `int main(int c, char** v) { return
/// replay_bench::main(c, v); }`.
inline int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--benchmark_list_tests") == 0 ||
        std::strcmp(argv[i], "--benchmark_list_tests=true") == 0)
      listing = true;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    if (!listing) add_device_context();
    benchmark::RunSpecifiedBenchmarks();
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    benchmark::Shutdown();
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}

// ---- timing -----------------------------------------------------------------------------------

/// Wall clock (steady) for manual times that include host work.
struct host_clock {
  using clock = std::chrono::steady_clock;
  clock::time_point t0 = clock::now();
  void restart() noexcept { t0 = clock::now(); }
  [[nodiscard]] double seconds() const noexcept {
    return std::chrono::duration<double>(clock::now() - t0).count();
  }
};

/// GPU time between start() and stop() on one stream.
class gpu_timer {
 public:
  gpu_timer() : a_(replay::event_flags::timing), b_(replay::event_flags::timing) {}
  void start(replay::stream_ref s) { a_.record(s); }
  void stop(replay::stream_ref s) { b_.record(s); }
  /// Waits for the stop event; seconds between the two events.
  [[nodiscard]] double seconds() const { return replay::elapsed_ms(a_, b_) * 1e-3; }

 private:
  replay::event a_, b_;
};

/// Median of a sample (0 for an empty one).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// ---- L2 flush ---------------------------------------------------------------------------------

/// Evicts the L2 cache by writing a buffer twice its size. flush() is asynchronous on the stream:
/// time only what follows it (or synchronise before starting a host clock).
class l2_flusher {
 public:
  l2_flusher() : buf_(2 * static_cast<std::size_t>(std::max(device_properties().l2CacheSize, 1 << 20))) {}
  void flush(replay::stream_ref s) {
    REPLAY_CHECK(cudaMemsetAsync(buf_.data(), ++value_ & 0xff, buf_.size_bytes(), s.get()));
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return buf_.size_bytes(); }

 private:
  replay::device_buffer<unsigned char> buf_;
  int value_ = 0;
};

// ---- floors -----------------------------------------------------------------------------------

/// Device-to-device copy bandwidth in bytes per second, counting bytes read + written (so it is
/// comparable to a step that reads weights: read bandwidth ~ half of it per direction, and a
/// read-only kernel can at best reach about this figure). Median of 10 copies of 512 MiB, after
/// 2 warm-up copies; measured once per process and cached.
inline double d2d_bandwidth() {
  static const double bw = [] {
    const std::size_t bytes = 512ull << 20;
    replay::stream s;
    replay::device_buffer<std::byte> a(bytes), b(bytes);
    REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
    std::vector<double> t;
    gpu_timer timer;
    for (int i = 0; i < 12; ++i) {
      timer.start(s);
      REPLAY_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s.get()));
      timer.stop(s);
      const double sec = timer.seconds();
      if (i >= 2) t.push_back(sec);
    }
    return 2.0 * static_cast<double>(bytes) / median(t);
  }();
  return bw;
}

// ---- launch gate ------------------------------------------------------------------------------

namespace detail {
/// Spins until *flag != 0 or `timeout_ns` have passed (then counts a timeout).
__global__ inline void gate_kernel(const volatile int* flag, unsigned long long timeout_ns, int* timeouts) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*flag == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      *timeouts += 1;
      return;
    }
    __nanosleep(200);
  }
}
}  // namespace detail

/// Holds a stream until the host opens the gate, so that everything queued behind it runs back to
/// back on the GPU: GPU-side times then measure the GPU's own cost per kernel, not the host's
/// launch rate. A timeout (the host blocked because the launch queue filled up) keeps it from
/// hanging; timeouts() counts them, and a measurement with a timeout is not a clean one.
class launch_gate {
 public:
  explicit launch_gate(double timeout_ms = 50.0)
      : timeout_ns_(static_cast<unsigned long long>(timeout_ms * 1e6)), timeouts_(1) {
    void* host = nullptr;
    REPLAY_CHECK(cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped));
    flag_ = static_cast<volatile int*>(host);
    *flag_ = 0;
    void* dev = nullptr;
    REPLAY_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    flag_dev_ = static_cast<const int*>(dev);
    REPLAY_CHECK(cudaMemset(timeouts_.data(), 0, sizeof(int)));
  }
  launch_gate(const launch_gate&) = delete;
  launch_gate& operator=(const launch_gate&) = delete;
  ~launch_gate() { (void)replay::detail::check_noexcept(cudaFreeHost(const_cast<int*>(flag_))); }

  /// Queues the closed gate on `s` (the previous use must have finished: synchronise first).
  void close(replay::stream_ref s) {
    *flag_ = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    detail::gate_kernel<<<1, 1, 0, s.get()>>>(flag_dev_, timeout_ns_, timeouts_.data());
    REPLAY_CHECK_LAUNCH("gate_kernel");
  }
  /// Lets the queued work run.
  void open() noexcept {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *flag_ = 1;
  }
  /// Gates that timed out so far (reads the device; synchronises).
  [[nodiscard]] int timeouts() const {
    int n = 0;
    REPLAY_CHECK(cudaMemcpy(&n, timeouts_.data(), sizeof(int), cudaMemcpyDeviceToHost));
    return n;
  }

 private:
  volatile int* flag_ = nullptr;
  const int* flag_dev_ = nullptr;
  unsigned long long timeout_ns_;
  replay::device_buffer<int> timeouts_;
};

}  // namespace replay_bench
