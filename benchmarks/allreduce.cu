// benchmarks/allreduce.cu: one decode-sized bf16 all-reduce over every local GPU through NCCL,
// eager vs captured in a CUDA graph (a graph of one all-reduce, and a graph of 16 back-to-back to
// amortise the graph launch). Rows of the Qwen3-8B hidden size (4096 bf16 = 8 KiB per row): batch
// 1, 8 and 32. One host thread per GPU (the process model replay's lockstep runner is built for);
// rank 0's thread times, every thread issues `ops` all-reduces per timed iteration and waits for
// its stream, and the reported time is wall time per all-reduce (launch, transfer, completion):
// back to back (throughput), or waiting for each one (latency, the *_latency rows).
// The result of the last all-reduce is checked exactly on every rank (bf16-exact integers).
// Skipped with fewer than two GPUs. Use --benchmark_repetitions for medians.
#include "common.hpp"

#include <replay/nccl.hpp>

#include <cuda_bf16.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t hidden = 4096;     // Qwen3-8B hidden size
constexpr std::size_t max_rows = 32;
constexpr int ops = 256;                 // all-reduces per rank per timed iteration
constexpr int graph_n = 16;              // all-reduces in the "graph of N"
constexpr int iterations = 40;           // timed iterations (each `ops` all-reduces) per repetition

enum class mode { eager, graph1, graph_n };

/// Runs a function on every rank at once: ranks 1.. on their own threads (device set once), rank 0
/// on the calling thread; returns when all are done. Exceptions of worker ranks are rethrown.
class rank_threads {
 public:
  explicit rank_threads(int world) : world_(world) {
    for (int r = 1; r < world; ++r) workers_.emplace_back([this, r] { loop(r); });
  }
  ~rank_threads() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
      ++gen_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  rank_threads(const rank_threads&) = delete;
  rank_threads& operator=(const rank_threads&) = delete;

  void run(const std::function<void(int)>& f) {
    {
      std::lock_guard lock(m_);
      job_ = &f;
      pending_ = world_ - 1;
      error_ = nullptr;
      ++gen_;
    }
    cv_.notify_all();
    std::exception_ptr mine;
    try {
      REPLAY_CHECK(cudaSetDevice(0));
      f(0);
    } catch (...) {
      mine = std::current_exception();
    }
    std::unique_lock lock(m_);
    done_.wait(lock, [&] { return pending_ == 0; });
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop(int r) {
    std::uint64_t seen = 0;
    bool device_set = false;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return gen_ != seen; });
        seen = gen_;
        if (stop_) return;
        job = job_;
      }
      std::exception_ptr err;
      try {
        if (!device_set) REPLAY_CHECK(cudaSetDevice(r));
        device_set = true;
        (*job)(r);
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lock(m_);
        if (err && !error_) error_ = err;
        --pending_;
      }
      done_.notify_all();
    }
  }

  int world_;
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int pending_ = 0;
  std::uint64_t gen_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

/// Every local GPU: communicators, streams, send/receive buffers, and the rank threads.
struct tp_setup {
  int world = 0;
  std::vector<replay::nccl_comm> comms;
  std::vector<replay::stream> streams;
  std::vector<replay::device_buffer<__nv_bfloat16>> send, recv;
  std::unique_ptr<rank_threads> threads;

  tp_setup() {
    REPLAY_CHECK(cudaGetDeviceCount(&world));
    if (world < 2) return;
    std::vector<int> devices(static_cast<std::size_t>(world));
    for (int d = 0; d < world; ++d) devices[static_cast<std::size_t>(d)] = d;
    comms = replay::nccl_comm::init_all(devices);
    for (int d = 0; d < world; ++d) {
      REPLAY_CHECK(cudaSetDevice(d));
      streams.emplace_back();
      send.emplace_back(max_rows * hidden);
      recv.emplace_back(max_rows * hidden);
      // rank + 1 everywhere: the sum is world * (world + 1) / 2, exact in bf16.
      const std::vector<__nv_bfloat16> host(max_rows * hidden, __float2bfloat16(static_cast<float>(d + 1)));
      REPLAY_CHECK(cudaMemcpy(send.back().data(), host.data(), host.size() * sizeof(__nv_bfloat16),
                              cudaMemcpyHostToDevice));
    }
    REPLAY_CHECK(cudaSetDevice(0));
    threads = std::make_unique<rank_threads>(world);
  }
  ~tp_setup() {
    threads.reset();
    for (int d = 0; d < world; ++d) {
      (void)cudaSetDevice(d);
      (void)cudaDeviceSynchronize();
    }
    replay::destroy_all(comms);
  }

  static tp_setup& get() {
    static tp_setup s;
    return s;
  }
};

/// Wrong elements among the first `count` of rank r's result (expected: the sum of rank + 1).
std::size_t count_wrong(tp_setup& tp, int r, std::size_t count) {
  std::vector<__nv_bfloat16> host(count);
  REPLAY_CHECK(cudaMemcpy(host.data(), tp.recv[static_cast<std::size_t>(r)].data(),
                          count * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  const float want = static_cast<float>(tp.world * (tp.world + 1) / 2);
  std::size_t wrong = 0;
  for (const auto& v : host)
    if (__bfloat162float(v) != want) ++wrong;
  return wrong;
}

void BM_allreduce(benchmark::State& state, mode m, bool sync_each) {
  if (replay_bench::skip_without_device(state)) return;
  tp_setup& tp = tp_setup::get();
  if (tp.world < 2) return state.SkipWithError("needs at least 2 GPUs");
  const std::size_t rows = static_cast<std::size_t>(state.range(0));
  const std::size_t count = rows * hidden;
  const auto rk = [](int r) { return static_cast<std::size_t>(r); };

  // Poison the results, then build the graphs (one per rank, captured on each rank's thread).
  std::vector<replay::graph_exec> execs(rk(tp.world));
  const int per_graph = m == mode::graph_n ? graph_n : 1;
  tp.threads->run([&](int r) {
    REPLAY_CHECK(cudaMemsetAsync(tp.recv[rk(r)].data(), 0xEF, max_rows * hidden * sizeof(__nv_bfloat16),
                                 tp.streams[rk(r)].get()));
    if (m != mode::eager) {
      replay::graph g = replay::capture(tp.streams[rk(r)], [&](replay::stream_ref s) {
        for (int i = 0; i < per_graph; ++i)
          replay::all_reduce(tp.comms[rk(r)], tp.send[rk(r)].data(), tp.recv[rk(r)].data(), count, ncclSum, s);
      });
      execs[rk(r)] = g.instantiate({.upload_stream = tp.streams[rk(r)].get()});
    }
    tp.streams[rk(r)].synchronize();
  });

  const auto body = [&](int r) {
    const replay::stream_ref s = tp.streams[rk(r)];
    if (m == mode::eager) {
      for (int i = 0; i < ops; ++i) {
        replay::all_reduce(tp.comms[rk(r)], tp.send[rk(r)].data(), tp.recv[rk(r)].data(), count, ncclSum, s);
        if (sync_each) s.synchronize();
      }
    } else {
      for (int i = 0; i < ops / per_graph; ++i) {
        execs[rk(r)].launch(s);
        if (sync_each) s.synchronize();
      }
    }
    s.synchronize();
  };
  tp.threads->run(body);  // warm-up (first launches, lazy connections)

  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    tp.threads->run(body);
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count() / ops);
  }

  std::size_t wrong = 0;
  for (int r = 0; r < tp.world; ++r) wrong += count_wrong(tp, r, count);
  if (wrong != 0) return state.SkipWithError(fmt::format("{} wrong elements", wrong).c_str());
  state.counters["ranks"] = tp.world;
  state.counters["bytes"] = static_cast<double>(count * sizeof(__nv_bfloat16));
  state.SetLabel(fmt::format("{} rows x {} bf16, {} per graph", rows, hidden,
                             m == mode::eager ? 0 : per_graph));
  // The graphs hold the communicators' captured work: destroy them before the next benchmark.
  tp.threads->run([&](int r) {
    tp.streams[rk(r)].synchronize();
    execs[rk(r)] = replay::graph_exec();
  });
}

}  // namespace

// Throughput: `ops` all-reduces back to back, then one wait (launches overlap the transfers).
BENCHMARK_CAPTURE(BM_allreduce, eager, mode::eager, false)->Arg(1)->Arg(8)->Arg(32)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_allreduce, graph1, mode::graph1, false)->Arg(1)->Arg(8)->Arg(32)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_allreduce, graph16, mode::graph_n, false)->Arg(1)->Arg(8)->Arg(32)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMicrosecond);
// Latency: each all-reduce (or graph of one) waited for before the next, as a step that needs the
// sum before its next launch.
BENCHMARK_CAPTURE(BM_allreduce, eager_latency, mode::eager, true)->Arg(1)->Arg(8)->Arg(32)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_allreduce, graph1_latency, mode::graph1, true)->Arg(1)->Arg(8)->Arg(32)->Iterations(iterations)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) { return replay_bench::main(argc, argv); }
