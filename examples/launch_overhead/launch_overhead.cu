// launch_overhead: what kernel-launch overhead costs, and what replaying a CUDA graph saves.
//
// N tiny dependent kernels (each adds 1 to a counter, in stream order) are launched eagerly, and
// the same chain is captured once and replayed as a graph. For each N the program prints the
// per-kernel cost (GPU-inclusive wall time / N) of both, the host cost of one graph launch through
// replay::graph_exec and through raw cudaGraphLaunch (measured in the same run), and checks the
// counter so a chain that did not run cannot look fast.
//
//   launch_overhead                    # N = 1, 10, 25, 50, 100, 400, 1600
//   launch_overhead --sizes 10,100 --iters 500 --json out.json
#include <replay/replay.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// ---- kernel -----------------------------------------------------------------------------------

/// One tiny kernel: counter += 1 (single thread). Each launch depends on the previous one through
/// stream order, like the layers of a decode step.
__global__ void tick(unsigned long long* counter) { *counter += 1; }

// ---- launchers --------------------------------------------------------------------------------

void launch_chain(replay::stream_ref s, unsigned long long* counter, int n) {
  for (int i = 0; i < n; ++i) tick<<<1, 1, 0, s.get()>>>(counter);
  REPLAY_CHECK_LAUNCH("tick");
}

using clock_type = std::chrono::steady_clock;
double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct row {
  int n;
  double eager_us_per_kernel;   // wall time of n eager launches (GPU included) / n
  double graph_us_per_kernel;   // wall time of one replay (GPU included) / n
  double launch_host_us;        // host cost of replay::graph_exec::launch
  double raw_launch_host_us;    // host cost of raw cudaGraphLaunch on the same exec
  double instantiate_us;        // cudaGraphInstantiate
};

/// Median over `reps` of the wall time of `body` followed by a stream synchronise.
template <class F>
double timed_us(replay::stream_ref s, int reps, F&& body) {
  std::vector<double> t;
  t.reserve(reps);
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    body();
    s.synchronize();
    t.push_back(us_since(t0));
  }
  return median(std::move(t));
}

/// Median host time of one call of `a` and of `b` (not waiting for the GPU), interleaved call by
/// call so that both see the same conditions; the stream is drained (untimed) after every call, so
/// the launch queue is empty and back-pressure never inflates one side.
template <class A, class B>
std::pair<double, double> host_launch_us(replay::stream_ref s, int reps, A&& a, B&& b) {
  std::vector<double> ta, tb;
  ta.reserve(reps);
  tb.reserve(reps);
  for (int r = 0; r < reps; ++r) {
    auto t0 = clock_type::now();
    a();
    ta.push_back(us_since(t0));
    s.synchronize();
    t0 = clock_type::now();
    b();
    tb.push_back(us_since(t0));
    s.synchronize();
  }
  return {median(std::move(ta)), median(std::move(tb))};
}

row measure(replay::stream_ref s, unsigned long long* counter, int n, int iters) {
  row r{};
  r.n = n;
  unsigned long long expected = 0;
  REPLAY_CHECK(cudaMemsetAsync(counter, 0, sizeof(*counter), s.get()));

  // Eager: n launches per step; warm-up then the median step.
  for (int w = 0; w < 3; ++w) launch_chain(s, counter, n);
  r.eager_us_per_kernel = timed_us(s, iters, [&] { launch_chain(s, counter, n); }) / n;
  expected += static_cast<unsigned long long>(n) * (3 + iters);

  // Graph: capture once, instantiate, upload, replay.
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { launch_chain(cs, counter, n); });
  const auto t0 = clock_type::now();
  replay::graph_exec exec = g.instantiate();
  r.instantiate_us = us_since(t0);
  exec.upload(s);
  for (int w = 0; w < 3; ++w) exec.launch(s);
  r.graph_us_per_kernel = timed_us(s, iters, [&] { exec.launch(s); }) / n;
  expected += static_cast<unsigned long long>(n) * (3 + iters);

  // Host cost of one launch: through replay and raw, interleaved in the same run.
  const int host_reps = std::max(iters, 200);
  std::tie(r.launch_host_us, r.raw_launch_host_us) = host_launch_us(
      s, host_reps, [&] { exec.launch(s); },
      [&] { REPLAY_CHECK(cudaGraphLaunch(exec.get(), s.get())); });
  expected += static_cast<unsigned long long>(n) * 2 * host_reps;

  unsigned long long got = 0;
  REPLAY_CHECK(cudaMemcpyAsync(&got, counter, sizeof(got), cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  if (got != expected)
    throw std::runtime_error(fmt::format("N={}: counter is {}, expected {}: a chain did not run", n, got,
                                         expected));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"launch_overhead: eager kernel launches vs CUDA graph replay"};
  std::vector<int> sizes{1, 10, 25, 50, 100, 400, 1600};
  int iters = 200;
  std::string json_path;
  app.add_option("--sizes", sizes, "chain lengths N")->delimiter(',');
  app.add_option("--iters", iters, "timed repetitions per measurement (medians are reported)")
      ->check(CLI::Range(5, 100000));
  app.add_option("--json", json_path, "also write the results as JSON to this file");
  CLI11_PARSE(app, argc, argv);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "launch_overhead: no CUDA device found. This demo measures kernel launches "
                         "and needs an NVIDIA GPU.\n");
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    REPLAY_CHECK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0;
    REPLAY_CHECK(cudaDriverGetVersion(&driver));
    fmt::print("device: {} (sm_{}{}), driver {}, runtime {}\n", prop.name, prop.major, prop.minor, driver,
               CUDART_VERSION);

    replay::stream s;
    replay::device_buffer<unsigned long long> counter(1);
    std::vector<row> rows;
    fmt::print("{:>6} {:>14} {:>14} {:>9} {:>16} {:>16} {:>14}\n", "N", "eager us/kern", "graph us/kern",
               "speedup", "launch host us", "raw launch us", "instantiate us");
    for (int n : sizes) {
      if (n < 1) throw std::invalid_argument("sizes must be >= 1");
      const row r = measure(s, counter.data(), n, iters);
      rows.push_back(r);
      fmt::print("{:>6} {:>14.3f} {:>14.3f} {:>8.2f}x {:>16.3f} {:>16.3f} {:>14.1f}\n", r.n,
                 r.eager_us_per_kernel, r.graph_us_per_kernel, r.eager_us_per_kernel / r.graph_us_per_kernel,
                 r.launch_host_us, r.raw_launch_host_us, r.instantiate_us);
    }
    fmt::print("replay::graph_exec::launch vs raw cudaGraphLaunch (host, median): ");
    for (const row& r : rows) fmt::print("N={} {:+.3f} us  ", r.n, r.launch_host_us - r.raw_launch_host_us);
    fmt::print("\n");
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << fmt::format("{{\"device\": \"{}\", \"driver\": {}, \"runtime\": {}, \"rows\": [", prop.name, driver,
                       CUDART_VERSION);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const row& r = rows[i];
        f << fmt::format("{}{{\"n\": {}, \"eager_us_per_kernel\": {:.4f}, \"graph_us_per_kernel\": {:.4f}, "
                         "\"launch_host_us\": {:.4f}, \"raw_launch_host_us\": {:.4f}, \"instantiate_us\": {:.1f}}}",
                         i ? ", " : "", r.n, r.eager_us_per_kernel, r.graph_us_per_kernel, r.launch_host_us,
                         r.raw_launch_host_us, r.instantiate_us);
      }
      f << "]}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_overhead: %s\n", e.what());
    return 1;
  }
  return 0;
}
