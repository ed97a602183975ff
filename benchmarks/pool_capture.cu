// What one bucket costs: capture + instantiate time and device memory per graph, for a 400-kernel
// decode-like step (grid = bucket rows), per bucket size.
//
//   capture_instantiate/<bucket>  raw capture_scope + instantiate with upload; manual time = both;
//                                 counters capture_ms, instantiate_ms, bytes_per_graph (free-memory
//                                 drop over all iterations / iterations; the graphs are kept alive
//                                 until the end of the run so the average is not rounded to the
//                                 driver's 2 MiB chunks)
//   pool_capture/<bucket>         the same through graph_pool::ensure (a fresh key per iteration,
//                                 memory probe on): what the pool's statistics report per key
//
// Report medians: --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include "common.hpp"

#include <benchmark/benchmark.h>
#include <replay/replay.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

constexpr int kernels = 400;
constexpr int width = 128;      // threads per row
constexpr int iterations = 24;  // graphs kept alive per run (memory average)

__global__ void layer_op(const int* meta, float* x, int layer) {
  const int r = blockIdx.x, d = threadIdx.x;
  x[r * width + d] = x[r * width + d] * 0.5f + static_cast<float>(meta[r] + layer);
}

struct world {
  static constexpr std::size_t max_rows = 512;
  replay::stream s;
  replay::step_meta_array<int> meta{max_rows};
  replay::device_buffer<float> x{max_rows * width};

  void step(replay::stream_ref cs, std::size_t rows) const {
    for (int k = 0; k < kernels; ++k) {
      layer_op<<<static_cast<unsigned>(rows), width, 0, cs.get()>>>(meta.device(), x.data(), k);
      REPLAY_CHECK_LAUNCH("layer_op");
    }
  }
  static world& get() {
    static world w;
    return w;
  }
};

std::int64_t free_bytes() {
  std::size_t free = 0, total = 0;
  REPLAY_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<std::int64_t>(free);
}

void BM_capture_instantiate(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  using clock = std::chrono::steady_clock;
  world& w = world::get();
  const auto rows = static_cast<std::size_t>(state.range(0));
  std::vector<replay::graph_exec> keep;
  keep.reserve(iterations);
  w.s.synchronize();
  const std::int64_t before = free_bytes();
  double capture_ms = 0, instantiate_ms = 0;
  std::size_t nodes = 0;
  for (auto _ : state) {
    const auto t0 = clock::now();
    replay::graph g = replay::capture(w.s, [&](replay::stream_ref cs) { w.step(cs, rows); });
    const auto t1 = clock::now();
    keep.push_back(g.instantiate({.upload_stream = w.s.get()}));
    const auto t2 = clock::now();
    nodes = g.node_count();
    capture_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    instantiate_ms += std::chrono::duration<double, std::milli>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t2 - t0).count());
  }
  w.s.synchronize();
  const std::int64_t after = free_bytes();
  const double n = static_cast<double>(state.iterations());
  state.counters["capture_ms"] = capture_ms / n;
  state.counters["instantiate_ms"] = instantiate_ms / n;
  state.counters["nodes"] = static_cast<double>(nodes);
  state.counters["bytes_per_graph"] = static_cast<double>(before - after) / n;
}

void BM_pool_capture(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  using clock = std::chrono::steady_clock;
  world& w = world::get();
  const auto rows = static_cast<std::uint32_t>(state.range(0));
  replay::graph_pool<replay::graph_key> pool({.warmup = 0, .measure_memory = true});
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) { w.step(cs, k.bucket); };
  w.s.synchronize();
  const std::int64_t before = free_bytes();
  std::int64_t i = 0;
  for (auto _ : state) {
    const auto t0 = clock::now();
    pool.ensure(replay::graph_key{.bucket = rows, .fields = {i++}}, w.s, step);  // always a new key
    state.SetIterationTime(std::chrono::duration<double>(clock::now() - t0).count());
  }
  w.s.synchronize();
  const std::int64_t after = free_bytes();
  const auto st = pool.stats();
  double capture_ms = 0, instantiate_ms = 0;
  for (const auto& k : st.keys) {
    capture_ms += k.last_capture.capture_ms;
    instantiate_ms += k.last_capture.instantiate_ms;
  }
  const double n = static_cast<double>(st.keys.size());
  state.counters["capture_ms"] = capture_ms / n;
  state.counters["instantiate_ms"] = instantiate_ms / n;
  state.counters["pool_device_bytes_per_graph"] = static_cast<double>(st.resident_device_bytes) / n;
  state.counters["bytes_per_graph"] = static_cast<double>(before - after) / n;
  state.counters["graph_mem_bytes"] = static_cast<double>(st.resident_graph_mem_bytes) / n;
}

}  // namespace

BENCHMARK(BM_capture_instantiate)
    ->RangeMultiplier(2)->Range(1, 512)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_pool_capture)
    ->RangeMultiplier(2)->Range(1, 512)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) { return replay_bench::main(argc, argv); }
