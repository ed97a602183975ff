// Host cost of serving a decode step from the graph pool vs launching the same graph raw.
//
// Every benchmark times a batch of `calls` back-to-back calls on one stream with a steady clock
// (manual time, per call), then synchronises outside the timed region, so the GPU never applies
// back-pressure to the host and what is measured is the host's own cost per call:
//   raw_launch          cudaGraphLaunch of a cached exec (the floor)
//   pool_run            graph_pool::run hit: hash lookup + LRU touch + stats + cudaGraphLaunch
//   runner_run          step_runner::run hit: the pool plus the runner's switch checks
//   *_push              the same, preceded by step_meta_array::push of the batch's rows (an async
//                       host-to-device copy of pinned staging plus its guard event), done the same
//                       way in the raw and the pool variants
// The argument is the number of resident graphs the calls cycle through (1: always the same key;
// 16: a different bucket each call, as a scheduler with varying batch sizes would do).
// The graph is one small kernel reading per-row metadata, so the launch itself is as cheap as it
// gets and the pool's share is as visible as it gets.
//
// Report medians over repetitions: --benchmark_repetitions=10 --benchmark_report_aggregates_only=true
// (about 25 s on an H200 with those flags).
#include "common.hpp"

#include <benchmark/benchmark.h>
#include <replay/replay.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int calls = 32;          // calls per timed batch
constexpr int batches = 2000;      // timed batches per repetition (fixed: the manual time is per
                                   // call, so letting the library pick would run ~50x too long)
constexpr std::size_t max_rows = 64;

__global__ void tiny_step(const int* meta, int* out) {
  const int r = blockIdx.x;
  if (threadIdx.x == 0) out[r] = meta[r] + 1;
}

/// Device state shared by all benchmarks of the process (created on first use, after the device
/// check, so --benchmark_list_tests works without a GPU).
struct world {
  replay::stream s;
  replay::step_meta_array<int> meta{max_rows};
  replay::device_buffer<int> out{max_rows};

  void step(replay::stream_ref cs, std::size_t rows) const {
    tiny_step<<<static_cast<unsigned>(rows), 32, 0, cs.get()>>>(meta.device(), out.data());
    REPLAY_CHECK_LAUNCH("tiny_step");
  }
  static world& get() {
    static world w;
    return w;
  }
};

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}
std::size_t bucket_of(int i, int keys) { return static_cast<std::size_t>(i % keys) + 1; }

void stage_and_push(world& w, std::size_t rows) {
  auto st = w.meta.staging();
  for (std::size_t r = 0; r < rows; ++r) st[r] = static_cast<int>(r);
  w.meta.push(w.s, rows);
}

/// Times `calls` invocations of `call(i)` per iteration (host steady clock), per-call manual time.
template <class F>
void run_batches(benchmark::State& state, world& w, F&& call) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < calls; ++i) call(i);  // warm (captures, caches)
  w.s.synchronize();
  for (auto _ : state) {
    const auto t0 = clock::now();
    for (int i = 0; i < calls; ++i) call(i);
    const auto t1 = clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count() / calls);
    w.s.synchronize();  // untimed: the GPU catches up, no back-pressure in the next batch
  }
  state.counters["calls_per_batch"] = calls;
}

std::vector<replay::graph_exec> raw_execs(world& w, int keys) {
  std::vector<replay::graph_exec> execs;
  for (int k = 0; k < keys; ++k) {
    replay::graph g = replay::capture(w.s, [&](replay::stream_ref cs) { w.step(cs, bucket_of(k, keys)); });
    execs.push_back(g.instantiate({.upload_stream = w.s.get()}));
  }
  return execs;
}

void BM_raw_launch(benchmark::State& state, bool push) {
  if (replay_bench::skip_without_device(state)) return;
  world& w = world::get();
  const int keys = static_cast<int>(state.range(0));
  const auto execs = raw_execs(w, keys);
  run_batches(state, w, [&](int i) {
    if (push) stage_and_push(w, bucket_of(i, keys));
    const cudaError_t e = cudaGraphLaunch(execs[static_cast<std::size_t>(i % keys)].get(), w.s.get());
    if (e != cudaSuccess) [[unlikely]] REPLAY_CHECK(e);
  });
}

void BM_pool_run(benchmark::State& state, bool push) {
  if (replay_bench::skip_without_device(state)) return;
  world& w = world::get();
  const int keys = static_cast<int>(state.range(0));
  replay::graph_pool<replay::graph_key> pool({.warmup = 0, .measure_memory = false});
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) { w.step(cs, k.bucket); };
  run_batches(state, w, [&](int i) {
    const std::size_t b = bucket_of(i, keys);
    if (push) stage_and_push(w, b);
    pool.run(key_for(b), w.s, step, {.real = b, .bucket = b});
  });
  const auto st = pool.stats();
  state.counters["hit_rate"] = st.hit_rate();
  state.counters["captures"] = static_cast<double>(st.captures);
}

void BM_runner_run(benchmark::State& state, bool push) {
  if (replay_bench::skip_without_device(state)) return;
  world& w = world::get();
  const int keys = static_cast<int>(state.range(0));
  replay::step_runner<replay::graph_key> runner(
      [&](replay::stream_ref cs, const replay::graph_key& k) { w.step(cs, k.bucket); },
      {.pool = {.warmup = 0, .measure_memory = false}});
  if (!runner.graphs_enabled()) return state.SkipWithError("graphs disabled (REPLAY_CUDA_GRAPHS)");
  run_batches(state, w, [&](int i) {
    const std::size_t b = bucket_of(i, keys);
    if (push) stage_and_push(w, b);
    runner.run(key_for(b), w.s, {.real = b, .bucket = b});
  });
  state.counters["hit_rate"] = runner.stats().hit_rate();
}

}  // namespace

BENCHMARK_CAPTURE(BM_raw_launch, launch, false)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_pool_run, launch, false)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_runner_run, launch, false)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_raw_launch, push, true)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_pool_run, push, true)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(BM_runner_run, push, true)->Arg(1)->Arg(16)->Iterations(batches)->UseManualTime()->Unit(benchmark::kNanosecond);

int main(int argc, char** argv) { return replay_bench::main(argc, argv); }
