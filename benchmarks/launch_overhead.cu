// bench_launch_overhead: what kernel-launch overhead costs on this machine, and what graph replay
// (plain, through replay::graph_exec, and through a replay::graph_pool) saves.
//
// The workload is a chain of N tiny dependent kernels (each adds to one counter, in stream order,
// like the layers of a decode step), N = 1, 10, 25, 50, 100, 400, 1600. Every benchmark checks the
// counter afterwards, so a chain that did not run cannot look fast.
//
//   launch/<mode>/<sync>/N:n    one step = the N-kernel chain issued as
//       eager       N kernel launches from the host
//       eager_pdl   the same through replay::launch with programmatic dependent launch: each kernel
//                   may start while its predecessor runs and waits in replay::pdl::wait()
//       graph       one replay::graph_exec::launch of the captured chain
//       graph_pdl   the PDL chain captured: programmatic edges between the kernels
//       graph_raw   one raw cudaGraphLaunch of the same exec (the floor of replay's own overhead)
//       graph_meta  replay::step_meta::push then graph_exec::launch; the kernels read the increment
//                   through the step-metadata pointer (the decode-loop pattern)
//       pool        replay::graph_pool::run on a resident key (hash lookup, LRU touch, launch)
//     sync: each step ends with a stream synchronisation (a decode step that reads its token back);
//     nosync: steps are issued back to back in batches and synchronised once per batch (throughput).
//     Time = wall time per step (host launch + GPU, manual timing). Counters: us_per_kernel (time /
//     N), host_us_per_step and host_us_per_launch (host time spent issuing the step, before the
//     synchronisation).
//   gpu/<mode>/N:n    GPU time of the chain from CUDA events, with the stream held by a gate kernel
//     until the host has queued the whole chain: the GPU-side cost per kernel (launch gap included)
//     when the host is not the bottleneck. Counter gpu_us_per_kernel; gate_timeouts > 0 means the
//     launch queue filled up and the host blocked (the figure then includes host time).
//   capture/N:n, instantiate/N:n, exec_update/N:n    host time of stream capture, of
//     cudaGraphInstantiate, and of cudaGraphExecUpdate (graph_exec::update with a new capture of the
//     same topology whose kernels point at another buffer) for the chain.
//   step_meta/...    host cost of staging and pushing per-step metadata (replay::step_meta and
//     step_meta_array), with a raw cudaMemcpyAsync of the same bytes as the floor.
//
//   bench_launch_overhead --benchmark_min_time=0.05 --benchmark_repetitions=3
//       --benchmark_report_aggregates_only=true --benchmark_out=lo.json --benchmark_out_format=json
#include "common.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#if __has_include(<replay/graph_pool.hpp>)
#include <replay/graph_pool.hpp>
#define REPLAY_BENCH_HAVE_POOL 1
#else
#define REPLAY_BENCH_HAVE_POOL 0
#endif

namespace {

using replay_bench::host_clock;

constexpr int kSizes[] = {1, 10, 25, 50, 100, 400, 1600};

// ---- kernels ----------------------------------------------------------------------------------

/// counter += 1 (one thread). Each launch depends on the previous one through stream order.
__global__ void tick(unsigned long long* counter) { *counter += 1; }

/// counter += 1 under programmatic dependent launch: lets the next kernel start, then waits for the
/// previous one before touching the counter.
__global__ void tick_pdl(unsigned long long* counter) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  *counter += 1;
}

/// Per-step metadata of the graph_meta mode.
struct tick_meta {
  unsigned long long increment;
};

/// counter += meta->increment: the per-step value is read through the fixed metadata address.
__global__ void tick_meta_kernel(unsigned long long* counter, const tick_meta* meta) {
  *counter += meta->increment;
}

// ---- launchers --------------------------------------------------------------------------------

void launch_chain(replay::stream_ref s, unsigned long long* counter, int n) {
  for (int i = 0; i < n; ++i) tick<<<1, 1, 0, s.get()>>>(counter);
  REPLAY_CHECK_LAUNCH("tick");
}

void launch_pdl_chain(replay::stream_ref s, unsigned long long* counter, int n) {
  for (int i = 0; i < n; ++i) replay::launch(tick_pdl, {.stream = s, .pdl = true}, counter);
}

void launch_meta_chain(replay::stream_ref s, unsigned long long* counter, const tick_meta* meta, int n) {
  for (int i = 0; i < n; ++i) tick_meta_kernel<<<1, 1, 0, s.get()>>>(counter, meta);
  REPLAY_CHECK_LAUNCH("tick_meta_kernel");
}

/// The pool's step: the chain for the key's bucket (= N).
struct chain_step {
  unsigned long long* counter;
  int n;
  void operator()(replay::stream_ref s) const { launch_chain(s, counter, n); }
};

// ---- the chain under test ---------------------------------------------------------------------

enum class mode { eager, eager_pdl, graph, graph_pdl, graph_raw, graph_meta, pool };

constexpr const char* to_string(mode m) {
  switch (m) {
    case mode::eager: return "eager";
    case mode::eager_pdl: return "eager_pdl";
    case mode::graph: return "graph";
    case mode::graph_pdl: return "graph_pdl";
    case mode::graph_raw: return "graph_raw";
    case mode::graph_meta: return "graph_meta";
    case mode::pool: return "pool";
  }
  return "?";
}

/// A stream, a counter and the chain of N kernels prepared for one mode (graph captured,
/// instantiated and uploaded; pool key captured). step() issues one step; verify() checks that
/// every step issued since reset() ran.
class chain {
 public:
  chain(mode m, int n) : mode_(m), n_(n), counter_(1), meta_(tick_meta{1}) {
    switch (m) {
      case mode::eager:
      case mode::eager_pdl: break;
      case mode::graph_pdl:
        exec_ = replay::capture(s_, [&](replay::stream_ref cs) { launch_pdl_chain(cs, counter_.data(), n_); })
                    .instantiate({.upload_stream = s_.get()});
        break;
      case mode::graph:
      case mode::graph_raw:
        exec_ = replay::capture(s_, [&](replay::stream_ref cs) { launch_chain(cs, counter_.data(), n_); })
                    .instantiate({.upload_stream = s_.get()});
        break;
      case mode::graph_meta:
        exec_ = replay::capture(s_, [&](replay::stream_ref cs) {
                  launch_meta_chain(cs, counter_.data(), meta_.device(), n_);
                }).instantiate({.upload_stream = s_.get()});
        break;
      case mode::pool:
#if REPLAY_BENCH_HAVE_POOL
        pool_.emplace(replay::pool_options{.capacity = 4, .warmup = 1});
        key_ = replay::graph_key{.bucket = static_cast<std::uint32_t>(n)};
        (void)pool_->run(key_, s_, chain_step{counter_.data(), n_});  // miss: warm-up, capture, replay
#else
        throw std::runtime_error("replay/graph_pool.hpp is not available in this build");
#endif
        break;
    }
    s_.synchronize();
    reset();
  }

  [[nodiscard]] replay::stream_ref stream() const { return s_; }
  [[nodiscard]] int kernels() const noexcept { return n_; }
  /// Host calls that issue one step (kernel launches or graph launches).
  [[nodiscard]] int launches_per_step() const noexcept {
    return mode_ == mode::eager || mode_ == mode::eager_pdl ? n_ : 1;
  }

  /// Issues one step (asynchronous).
  void step() {
    switch (mode_) {
      case mode::eager: launch_chain(s_, counter_.data(), n_); break;
      case mode::eager_pdl: launch_pdl_chain(s_, counter_.data(), n_); break;
      case mode::graph:
      case mode::graph_pdl: exec_.launch(s_); break;
      case mode::graph_raw: REPLAY_CHECK(cudaGraphLaunch(exec_.get(), s_.get())); break;
      case mode::graph_meta:
        meta_.staging() = tick_meta{1};
        meta_.push(s_);
        exec_.launch(s_);
        break;
      case mode::pool:
#if REPLAY_BENCH_HAVE_POOL
        (void)pool_->run(key_, s_, chain_step{counter_.data(), n_});
#endif
        break;
    }
    ++steps_;
  }

  /// Waits for the stream, zeroes the counter and the step count.
  void reset() {
    s_.synchronize();
    REPLAY_CHECK(cudaMemsetAsync(counter_.data(), 0, sizeof(unsigned long long), s_.get()));
    s_.synchronize();
    steps_ = 0;
  }

  /// Throws unless the counter equals N x the steps issued since reset().
  void verify() {
    unsigned long long got = 0;
    REPLAY_CHECK(cudaMemcpyAsync(&got, counter_.data(), sizeof(got), cudaMemcpyDeviceToHost, s_.get()));
    s_.synchronize();
    const unsigned long long want = static_cast<unsigned long long>(n_) * steps_;
    if (got != want)
      throw std::runtime_error(fmt::format("{} N={}: counter {} after {} steps, expected {}: a chain did not run",
                                           to_string(mode_), n_, got, steps_, want));
#if REPLAY_BENCH_HAVE_POOL
    if (pool_ && pool_->counters().misses != 1)
      throw std::runtime_error(fmt::format("pool N={}: {} misses, expected 1 (the hit path was not measured)", n_,
                                           pool_->counters().misses));
#endif
  }

 private:
  mode mode_;
  int n_;
  replay::stream s_;
  replay::device_buffer<unsigned long long> counter_;
  replay::step_meta<tick_meta> meta_;
  replay::graph_exec exec_;
#if REPLAY_BENCH_HAVE_POOL
  std::optional<replay::graph_pool<replay::graph_key>> pool_;
  replay::graph_key key_{};
#endif
  unsigned long long steps_ = 0;
};

/// Steps per synchronisation in the nosync benchmarks: enough to keep the GPU busy, few enough that
/// one batch of the longest chains stays short.
int nosync_batch(int n) { return std::clamp(6400 / n, 4, 64); }

// ---- benchmarks -------------------------------------------------------------------------------

void bm_launch(benchmark::State& state, mode m, bool sync) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    chain c(m, static_cast<int>(state.range(0)));
    for (int i = 0; i < 3; ++i) c.step();  // warm-up
    c.reset();
    double host_s = 0, total_s = 0;
    long long steps = 0;
    if (sync) {
      for (auto _ : state) {
        host_clock t;
        c.step();
        const double issued = t.seconds();
        c.stream().synchronize();
        const double sec = t.seconds();
        state.SetIterationTime(sec);
        host_s += issued, total_s += sec, ++steps;
      }
    } else {
      const int k = nosync_batch(c.kernels());
      while (state.KeepRunningBatch(k)) {
        host_clock t;
        for (int i = 0; i < k; ++i) c.step();
        const double issued = t.seconds();
        c.stream().synchronize();
        const double sec = t.seconds();
        state.SetIterationTime(sec);
        host_s += issued, total_s += sec, steps += k;
      }
      state.counters["steps_per_sync"] = k;
    }
    c.verify();
    const double n = c.kernels();
    state.counters["N"] = n;
    state.counters["us_per_kernel"] = total_s * 1e6 / (static_cast<double>(steps) * n);
    state.counters["host_us_per_step"] = host_s * 1e6 / static_cast<double>(steps);
    state.counters["host_us_per_launch"] = host_s * 1e6 / (static_cast<double>(steps) * c.launches_per_step());
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bm_gpu(benchmark::State& state, mode m) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    chain c(m, static_cast<int>(state.range(0)));
    replay_bench::launch_gate gate;
    replay_bench::gpu_timer timer;
    for (int i = 0; i < 3; ++i) c.step();  // warm-up
    c.reset();
    double total_s = 0;
    long long steps = 0;
    for (auto _ : state) {
      gate.close(c.stream());
      timer.start(c.stream());
      c.step();
      timer.stop(c.stream());
      gate.open();
      const double sec = timer.seconds();
      state.SetIterationTime(sec);
      total_s += sec, ++steps;
    }
    c.verify();
    const double n = c.kernels();
    state.counters["N"] = n;
    state.counters["gpu_us_per_kernel"] = total_s * 1e6 / (static_cast<double>(steps) * n);
    state.counters["gate_timeouts"] = gate.timeouts();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bm_capture(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const int n = static_cast<int>(state.range(0));
    replay::stream s;
    replay::device_buffer<unsigned long long> counter(1);
    for (auto _ : state) {
      host_clock t;
      replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { launch_chain(cs, counter.data(), n); });
      state.SetIterationTime(t.seconds());
      if (g.node_count() != static_cast<std::size_t>(n)) throw std::runtime_error("captured graph has the wrong size");
    }
    state.counters["N"] = n;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bm_instantiate(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const int n = static_cast<int>(state.range(0));
    replay::stream s;
    replay::device_buffer<unsigned long long> counter(1);
    const replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { launch_chain(cs, counter.data(), n); });
    { replay::graph_exec warm = g.instantiate(); }
    for (auto _ : state) {
      host_clock t;
      replay::graph_exec e = g.instantiate();
      state.SetIterationTime(t.seconds());
      benchmark::DoNotOptimize(e.get());
    }  // the exec is destroyed outside the timed region
    state.counters["N"] = n;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bm_exec_update(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const int n = static_cast<int>(state.range(0));
    replay::stream s;
    replay::device_buffer<unsigned long long> a(1), b(1);
    const replay::graph ga = replay::capture(s, [&](replay::stream_ref cs) { launch_chain(cs, a.data(), n); });
    const replay::graph gb = replay::capture(s, [&](replay::stream_ref cs) { launch_chain(cs, b.data(), n); });
    replay::graph_exec exec = ga.instantiate();
    long long i = 0;
    for (auto _ : state) {
      const replay::graph& g = (++i % 2) ? gb : ga;
      host_clock t;
      const replay::update_result r = exec.update(g);
      state.SetIterationTime(t.seconds());
      if (!r.updated) throw std::runtime_error("cudaGraphExecUpdate refused an update of the same topology: " + r.message);
    }
    // The exec now points at the last graph given: check it runs there.
    REPLAY_CHECK(cudaMemsetAsync(a.data(), 0, sizeof(unsigned long long), s.get()));
    REPLAY_CHECK(cudaMemsetAsync(b.data(), 0, sizeof(unsigned long long), s.get()));
    exec.launch(s);
    unsigned long long got_a = 0, got_b = 0;
    REPLAY_CHECK(cudaMemcpyAsync(&got_a, a.data(), sizeof(got_a), cudaMemcpyDeviceToHost, s.get()));
    REPLAY_CHECK(cudaMemcpyAsync(&got_b, b.data(), sizeof(got_b), cudaMemcpyDeviceToHost, s.get()));
    s.synchronize();
    const bool last_b = (i % 2) == 1;
    if ((last_b ? got_b : got_a) != static_cast<unsigned long long>(n) || (last_b ? got_a : got_b) != 0)
      throw std::runtime_error("the updated exec did not run on the buffer of the last update");
    state.counters["N"] = n;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// 32 bytes of decode metadata (token, position, sequence length, sampling settings).
struct decode_meta {
  std::int32_t token, pos, seq_len, flags;
  float temperature;
  std::uint32_t reserved;
  std::uint64_t seed;
};
static_assert(sizeof(decode_meta) == 32);

/// Host cost of staging + push of one step_meta<decode_meta> (the stream is idle before each push,
/// as in a decode loop where the previous step has finished).
void bm_meta_push(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    replay::stream s;
    replay::step_meta<decode_meta> meta;
    std::int32_t pos = 0;
    for (auto _ : state) {
      host_clock t;
      meta.staging() = decode_meta{7, pos, pos + 1, 0, 1.0f, 0, 1337};
      meta.push(s);
      state.SetIterationTime(t.seconds());
      s.synchronize();
      ++pos;
    }
    state.counters["bytes"] = sizeof(decode_meta);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// Host cost of staging + push of a step_meta_array<int> of `range(0)` elements (batched token ids,
/// positions, block-table rows).
void bm_meta_push_array(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const auto n = static_cast<std::size_t>(state.range(0));
    replay::stream s;
    replay::step_meta_array<std::int32_t> meta(n);
    std::int32_t v = 0;
    for (auto _ : state) {
      host_clock t;
      auto st = meta.staging();
      for (std::size_t i = 0; i < n; ++i) st[i] = v + static_cast<std::int32_t>(i);
      meta.push(s);
      state.SetIterationTime(t.seconds());
      s.synchronize();
      ++v;
    }
    state.counters["bytes"] = static_cast<double>(n * sizeof(std::int32_t));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// The floor: one raw cudaMemcpyAsync of 32 bytes from pinned memory.
void bm_raw_h2d(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    replay::stream s;
    replay::pinned_buffer<decode_meta> host(1);
    replay::device_buffer<decode_meta> dev(1);
    std::int32_t pos = 0;
    for (auto _ : state) {
      host_clock t;
      host.data()->pos = pos;
      REPLAY_CHECK(cudaMemcpyAsync(dev.data(), host.data(), sizeof(decode_meta), cudaMemcpyHostToDevice, s.get()));
      state.SetIterationTime(t.seconds());
      s.synchronize();
      ++pos;
    }
    state.counters["bytes"] = sizeof(decode_meta);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

bool register_all() {
  const auto sized = [](benchmark::internal::Benchmark* b) {
    for (int n : kSizes) b->Arg(n);
    return b->ArgName("N")->UseManualTime()->Unit(benchmark::kMicrosecond);
  };
  for (const bool sync : {true, false})
    for (const mode m : {mode::eager, mode::eager_pdl, mode::graph, mode::graph_pdl, mode::graph_raw,
                         mode::graph_meta, mode::pool}) {
      if (m == mode::pool && !REPLAY_BENCH_HAVE_POOL) continue;
      sized(benchmark::RegisterBenchmark(fmt::format("launch/{}/{}", to_string(m), sync ? "sync" : "nosync").c_str(),
                                         bm_launch, m, sync));
    }
  for (const mode m : {mode::eager, mode::eager_pdl, mode::graph, mode::graph_pdl})
    sized(benchmark::RegisterBenchmark(fmt::format("gpu/{}", to_string(m)).c_str(), bm_gpu, m));
  sized(benchmark::RegisterBenchmark("capture", bm_capture));
  sized(benchmark::RegisterBenchmark("instantiate", bm_instantiate));
  sized(benchmark::RegisterBenchmark("exec_update", bm_exec_update));
  benchmark::RegisterBenchmark("step_meta/push", bm_meta_push)->UseManualTime()->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("step_meta/push_array", bm_meta_push_array)
      ->ArgName("elems")
      ->Arg(64)
      ->Arg(4096)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("step_meta/raw_memcpy_async", bm_raw_h2d)->UseManualTime()->Unit(benchmark::kMicrosecond);
  return true;
}

[[maybe_unused]] const bool registered = register_all();

}  // namespace

int main(int argc, char** argv) { return replay_bench::main(argc, argv); }
