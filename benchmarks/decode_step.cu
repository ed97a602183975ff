// bench_decode_step: one decode step of the example decoders, launched eagerly vs replayed as a
// CUDA graph, next to the floor measured in the same run.
//
//   floor/d2d_copy              device-to-device copy of 512 MiB: the bandwidth floor (GBps counts
//                               bytes read + written) of a step that streams its weights
//   floor/null_step             the smallest step that ends with a token on the host: push step
//                               metadata, one tiny kernel, copy 4 bytes back, synchronise
//   decode/nanogpt/<mode>/<sync>     the 4-layer character model (examples/nanogpt), batch 1:
//                               sync = decode_step() (push, launch, token back to the host: TPOT);
//                               nosync = enqueue_decode_step() back to back (GPU throughput);
//                               counters: kernels_per_step, us_per_kernel, floor_us (null step)
//   decode/<qwen preset>/<mode>/batch:B   Qwen3 shapes (0.6B, 4B) with random bf16 weights
//                               (examples/qwen), a paged KV cache and 16-token prompts; mode eager
//                               launches every kernel, mode graph replays the bucket's graph (one
//                               graph per power-of-two bucket, captured on first use: the engine's
//                               graph pool). Batch 1 is TPOT; larger batches are batched decode.
//                               The L2 cache is flushed before every step (outside the timing).
//                               Counters: tokens_per_s, GBps (weights read per second), pct_of_d2d
//                               (GBps / the D2D floor), floor_ms (weight bytes / D2D bandwidth).
//
// Times are host wall-clock per step (manual timing: what a serving loop pays), fixed iteration
// counts after a warm-up; pass --benchmark_repetitions=N --benchmark_report_aggregates_only=true
// for medians. The decoders are compiled in only when the build has their libraries
// (benchmarks/extra.cmake): REPLAY_BENCH_HAVE_NANOGPT, REPLAY_BENCH_HAVE_QWEN.
#include "common.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(REPLAY_BENCH_HAVE_NANOGPT)
#include <nanogpt/model.hpp>
#include <nanogpt/weights.hpp>
#endif
#if defined(REPLAY_BENCH_HAVE_QWEN)
#include <qwen/model.hpp>
#endif

namespace {

using replay_bench::host_clock;

// ---- floors -----------------------------------------------------------------------------------

/// Writes a token (one thread): the null step's only kernel.
__global__ void null_step_kernel(const std::int32_t* meta, std::int32_t* token) { *token = *meta + 1; }

/// The null decode step: step_meta push, one kernel, a 4-byte copy back to pinned memory,
/// synchronise; it checks the token it reads back.
struct null_stepper {
  replay::stream s;
  replay::step_meta<std::int32_t> meta;
  replay::device_buffer<std::int32_t> token{1};
  replay::pinned_buffer<std::int32_t> host{1};
  std::int32_t i = 0;

  void step() {
    meta.staging() = i;
    meta.push(s);
    null_step_kernel<<<1, 1, 0, s.get()>>>(meta.device(), token.data());
    REPLAY_CHECK_LAUNCH("null_step_kernel");
    REPLAY_CHECK(cudaMemcpyAsync(host.data(), token.data(), sizeof(std::int32_t), cudaMemcpyDeviceToHost, s.get()));
    s.synchronize();
    if (host.data()[0] != i + 1) throw std::runtime_error("null step: wrong token");
    ++i;
  }
};

/// Median wall time (seconds) of the null step over 200 steps after 20 of warm-up. Measured once
/// per process.
double null_step_seconds() {
  static const double sec = [] {
    null_stepper n;
    std::vector<double> t;
    for (int i = 0; i < 220; ++i) {
      host_clock c;
      n.step();
      if (i >= 20) t.push_back(c.seconds());
    }
    return replay_bench::median(t);
  }();
  return sec;
}

void bm_d2d(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const std::size_t bytes = 512ull << 20;
    replay::stream s;
    replay::device_buffer<std::byte> a(bytes), b(bytes);
    REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
    replay_bench::gpu_timer timer;
    for (int i = 0; i < 2; ++i)
      REPLAY_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s.get()));
    for (auto _ : state) {
      timer.start(s);
      REPLAY_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s.get()));
      timer.stop(s);
      state.SetIterationTime(timer.seconds());
    }
    state.counters["GBps"] = benchmark::Counter(2.0 * bytes * 1e-9 * static_cast<double>(state.iterations()),
                                                benchmark::Counter::kIsRate);
    state.counters["bytes"] = static_cast<double>(bytes);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void bm_null_step(benchmark::State& state) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    null_stepper n;
    for (int w = 0; w < 10; ++w) n.step();
    for (auto _ : state) {
      host_clock c;
      n.step();
      state.SetIterationTime(c.seconds());
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// ---- NanoGPT ----------------------------------------------------------------------------------

#if defined(REPLAY_BENCH_HAVE_NANOGPT)

constexpr int kNanoPrompt = 8;  // prompt tokens; decode positions cycle through [8, block_size)

/// The model (random weights, seed 1337) with its graph captured and an 8-token prompt prefilled.
/// Built once per process and metadata path: steps synchronised one by one use the example's
/// default (the sampler writes the next step's metadata on the device, so a step is launch →
/// token); steps issued back to back push the metadata before each step (an enqueued step's
/// successor cannot rely on a token the host has not read).
struct nano_fixture {
  nanogpt::Model model;
  nanogpt::Sampling sampling{.temperature = 1.0f, .seed = 1337, .greedy = true};
  std::int32_t token = 0;
  int pos = kNanoPrompt;

  explicit nano_fixture(nanogpt::MetaPath meta)
      : model(nanogpt::random_weights(1337), nanogpt::ModelOptions{.meta = meta}) {
    std::vector<std::int32_t> prompt(kNanoPrompt);
    for (int i = 0; i < kNanoPrompt; ++i) prompt[i] = (i * 7 + 3) % nanogpt::Config::vocab_size;
    token = model.prefill(prompt, sampling);
    model.capture_decode_graph();
  }
  /// The next position (wraps to just after the prompt at the end of the context; the cache slots
  /// are rewritten, the work per step is the same).
  int next_pos() {
    const int p = pos;
    pos = pos + 1 < nanogpt::Config::block_size ? pos + 1 : kNanoPrompt;
    return p;
  }
};

nano_fixture& nano(bool sync) {
  if (sync) {
    static nano_fixture advanced(nanogpt::MetaPath::device);
    return advanced;
  }
  static nano_fixture pushed(nanogpt::MetaPath::push);
  return pushed;
}

void bm_nanogpt(benchmark::State& state, nanogpt::Mode mode, bool sync) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    nano_fixture& f = nano(sync);
    const double floor = null_step_seconds();
    for (int w = 0; w < 10; ++w) f.token = f.model.decode_step(f.token, f.next_pos(), f.sampling, mode);
    double total = 0;
    if (sync) {
      for (auto _ : state) {
        host_clock c;
        f.token = f.model.decode_step(f.token, f.next_pos(), f.sampling, mode);
        const double sec = c.seconds();
        state.SetIterationTime(sec);
        total += sec;
      }
    } else {
      constexpr int k = 32;  // steps per synchronisation
      while (state.KeepRunningBatch(k)) {
        host_clock c;
        for (int i = 0; i < k; ++i) f.model.enqueue_decode_step(f.token, f.next_pos(), f.sampling, mode);
        f.model.synchronize();
        const double sec = c.seconds();
        state.SetIterationTime(sec);
        total += sec;
      }
    }
    const double steps = static_cast<double>(state.iterations());
    const double kernels = nanogpt::Model::kernels_per_decode_step;
    state.counters["batch"] = 1;
    state.counters["kernels_per_step"] = kernels;
    state.counters["us_per_kernel"] = total * 1e6 / (steps * kernels);
    state.counters["tokens_per_s"] = benchmark::Counter(steps, benchmark::Counter::kIsRate);
    state.counters["floor_us"] = floor * 1e6;
    state.counters["graph_kernel_nodes"] = static_cast<double>(f.model.graph_kernel_nodes());
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

#endif  // REPLAY_BENCH_HAVE_NANOGPT

// ---- Qwen -------------------------------------------------------------------------------------

#if defined(REPLAY_BENCH_HAVE_QWEN)

constexpr int kQwenMaxBatch = 64;
constexpr int kQwenPrompt = 16;   // prompt tokens per sequence
constexpr int kQwenWindow = 128;  // decode positions cycle through [prompt, prompt + window)

/// One engine per preset (random weights on the GPU), with kQwenMaxBatch sequences prefilled.
/// Built on first use and kept for the process.
struct qwen_fixture {
  qwen::Config cfg;
  std::unique_ptr<qwen::Engine> engine;
  std::vector<int> slots, tokens, positions;
  replay_bench::l2_flusher flusher;

  explicit qwen_fixture(const std::string& preset) : cfg(qwen::preset(preset)) {
    qwen::EngineOptions opt;
    opt.max_batch = kQwenMaxBatch;
    opt.max_bucket = kQwenMaxBatch;
    opt.max_context = kQwenPrompt + kQwenWindow;
    opt.kv_budget_bytes = std::size_t(2) << 30;
    engine = std::make_unique<qwen::Engine>(cfg, opt, nullptr);
    auto& book = engine->kv();
    for (int i = 0; i < kQwenMaxBatch; ++i) {
      const int slot = book.acquire_slot();
      book.ensure(slot, kQwenPrompt + kQwenWindow);
      std::vector<int> prompt(kQwenPrompt);
      for (int j = 0; j < kQwenPrompt; ++j) prompt[j] = (1000 + 7919 * (i * kQwenPrompt + j)) % cfg.vocab_size;
      slots.push_back(slot);
      tokens.push_back(engine->prefill(slot, prompt, 0));
      positions.push_back(kQwenPrompt);
    }
  }

  /// One decode step of the first `batch` sequences; each row's token becomes its next token.
  void step(int batch, bool graph) {
    std::vector<qwen::DecodeRow> rows(batch);
    for (int i = 0; i < batch; ++i) rows[i] = {slots[i], tokens[i], positions[i]};
    std::vector<int> next(batch);
    engine->decode(rows, graph, next);
    for (int i = 0; i < batch; ++i) {
      tokens[i] = next[i];
      positions[i] = positions[i] + 1 < kQwenPrompt + kQwenWindow ? positions[i] + 1 : kQwenPrompt;
    }
  }
};

qwen_fixture& qwen_for(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<qwen_fixture>> fixtures;
  auto& f = fixtures[preset];
  if (!f) f = std::make_unique<qwen_fixture>(preset);
  return *f;
}

void bm_qwen(benchmark::State& state, std::string preset, bool graph) {
  if (replay_bench::skip_without_device(state)) return;
  try {
    const int batch = static_cast<int>(state.range(0));
    qwen_fixture& f = qwen_for(preset);
    const double d2d = replay_bench::d2d_bandwidth();
    const replay::stream_ref s = f.engine->stream();
    for (int w = 0; w < 3; ++w) f.step(batch, graph);  // warm-up (and the bucket's capture)
    const long long fallbacks_before = f.engine->graph_stats().fallback_steps;
    double total = 0;
    for (auto _ : state) {
      f.flusher.flush(s);
      s.synchronize();
      host_clock c;
      f.step(batch, graph);
      const double sec = c.seconds();
      state.SetIterationTime(sec);
      total += sec;
    }
    const double steps = static_cast<double>(state.iterations());
    const double wbytes = static_cast<double>(f.cfg.decode_weight_bytes());
    const double mean = total / steps;
    state.counters["batch"] = batch;
    state.counters["bucket"] = f.engine->bucket_for(batch);
    state.counters["tokens_per_s"] = benchmark::Counter(steps * batch, benchmark::Counter::kIsRate);
    state.counters["GBps"] = benchmark::Counter(steps * wbytes * 1e-9, benchmark::Counter::kIsRate);
    state.counters["weight_GB"] = wbytes * 1e-9;
    state.counters["d2d_GBps"] = d2d * 1e-9;
    state.counters["pct_of_d2d"] = 100.0 * (wbytes / mean) / d2d;
    state.counters["floor_ms"] = wbytes / d2d * 1e3;
    if (graph) {  // a graph failure falls back to eager: then this row would not measure graphs
      const auto gs = f.engine->graph_stats();
      if (gs.fallback_steps != fallbacks_before)
        throw std::runtime_error(fmt::format("{} graph steps ran eagerly (graph fallback)", gs.fallback_steps - fallbacks_before));
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

#endif  // REPLAY_BENCH_HAVE_QWEN

bool register_all() {
  benchmark::RegisterBenchmark("floor/d2d_copy", bm_d2d)->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("floor/null_step", bm_null_step)->UseManualTime()->Iterations(500)->Unit(benchmark::kMicrosecond);
#if defined(REPLAY_BENCH_HAVE_NANOGPT)
  for (const bool sync : {true, false})
    for (const nanogpt::Mode m : {nanogpt::Mode::eager, nanogpt::Mode::graph})
      benchmark::RegisterBenchmark(
          fmt::format("decode/nanogpt/{}/{}", nanogpt::to_string(m), sync ? "sync" : "nosync").c_str(), bm_nanogpt, m, sync)
          ->UseManualTime()
          ->Iterations(sync ? 500 : 1024)
          ->Unit(benchmark::kMicrosecond);
#endif
#if defined(REPLAY_BENCH_HAVE_QWEN)
  struct qwen_case {
    const char* preset;
    int iterations_b1, iterations_batched;
  };
  for (const qwen_case q : {qwen_case{"qwen3-0.6b", 100, 50}, qwen_case{"qwen3-4b", 60, 30}})
    for (const int batch : {1, 8, 32, 64})
      for (const bool graph : {false, true})
        benchmark::RegisterBenchmark(fmt::format("decode/{}/{}", q.preset, graph ? "graph" : "eager").c_str(), bm_qwen,
                                     std::string(q.preset), graph)
            ->ArgName("batch")
            ->Arg(batch)
            ->UseManualTime()
            ->Iterations(batch == 1 ? q.iterations_b1 : q.iterations_batched)
            ->Unit(benchmark::kMillisecond);
#endif
  return true;
}

[[maybe_unused]] const bool registered = register_all();

}  // namespace

int main(int argc, char** argv) { return replay_bench::main(argc, argv); }
