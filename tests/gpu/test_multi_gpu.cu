// Tensor parallel on two GPUs: one host thread per rank, each with its own lockstep_runner, stream
// and buffers; the step fills its shard, all-reduces it through NCCL and post-processes the sum,
// so the collective sits in the middle of the captured graph. Checked exactly (integers in float,
// outputs poisoned before every step): graph == eager, the same bucket on every rank from
// different batch sizes, a capture failure on rank 1 only (before or after its collective) leaves
// no graph on any rank and both run eagerly and agree, the kill switch, and the misuses that
// all_reduce refuses; all_gather eagerly and in a graph. Skipped (CTest skip code) with fewer than two GPUs.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <env_guard.hpp>
#include <gpu_test.hpp>
#include <replay/lockstep.hpp>
#include <replay/nccl.hpp>

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int world = 2;
constexpr std::size_t hidden = 1024;  // elements per row
constexpr std::size_t max_rows = 16;

// x[i] = (rank + 1) * (i % 97 + 1 + step): integers, exact in float.
__global__ void fill_shard(float* x, std::size_t n, int rank, const int* step) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<float>((rank + 1) * (static_cast<int>(i % 97) + 1 + *step));
}
// y = 2 * y + 1 after the all-reduce: work that depends on the collective.
__global__ void post(float* y, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = 2.0f * y[i] + 1.0f;
}

float expected(std::size_t i, int step) {
  float sum = 0.0f;
  for (int r = 0; r < world; ++r) sum += static_cast<float>((r + 1) * (static_cast<int>(i % 97) + 1 + step));
  return 2.0f * sum + 1.0f;
}

/// Where rank 1's step breaks its capture (nowhere, before or after its all-reduce).
enum class inject { none, before_collective, after_collective };

/// One rank: device, stream, buffers, communicators.
struct rank_ctx {
  int rank = 0;
  replay::nccl_comm comm;
  replay::nccl_comm agree_comm;
  replay::stream s;
  replay::device_buffer<float> x{max_rows * hidden};
  replay::device_buffer<float> y{max_rows * hidden};
  replay::device_buffer<int> step_value{1};
  inject fault = inject::none;
  std::vector<std::string> warnings;

  // The decode step for `rows` rows: fill, all-reduce (x -> y), post.
  void step(replay::stream_ref st, std::size_t rows) {
    const std::size_t n = rows * hidden;
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    fill_shard<<<blocks, 256, 0, st.get()>>>(x.data(), n, rank, step_value.data());
    REPLAY_CHECK_LAUNCH("fill_shard");
    const bool capturing = st.is_capturing();
    if (capturing && fault == inject::before_collective) REPLAY_CHECK(cudaStreamSynchronize(st.get()));
    replay::all_reduce(comm, x.data(), y.data(), n, ncclSum, st);
    if (capturing && fault == inject::after_collective) REPLAY_CHECK(cudaStreamSynchronize(st.get()));
    post<<<blocks, 256, 0, st.get()>>>(y.data(), n);
    REPLAY_CHECK_LAUNCH("post");
  }

  // Sets the step value, poisons y (rows .. max_rows too).
  void before_step(int step) {
    REPLAY_CHECK(cudaMemcpyAsync(step_value.data(), &step, sizeof(int), cudaMemcpyHostToDevice, s.get()));
    replay_test::poison(y.data(), y.size() * sizeof(float), s);
    s.synchronize();  // `step` lives on the caller's stack
  }

  // Number of wrong elements among the first `rows` rows; the rest must still be poison.
  std::size_t check(std::size_t rows, int step) {
    const auto host = replay_test::to_host(y.data(), y.size(), s);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (i < rows * hidden) {
        if (host[i] != expected(i, step)) ++wrong;
      } else {
        std::uint32_t bits = 0;
        std::memcpy(&bits, &host[i], sizeof bits);
        if (bits != 0xEFEFEFEFu) ++wrong;
      }
    }
    return wrong;
  }
};

using runner_t = replay::lockstep_runner<replay::graph_key>;

replay::graph_key key_for(std::size_t rows) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(rows)};
}

/// Makes the ranks' communicators (ncclCommInitAll from this thread), then runs `body` on one
/// thread per rank with its device set; the agreement communicator is split off in each thread.
/// Returns each rank's exception (or null).
std::vector<std::exception_ptr> on_ranks(std::vector<rank_ctx>& ranks,
                                         const std::function<void(rank_ctx&)>& body) {
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        REPLAY_CHECK(cudaSetDevice(r));
        rank_ctx& ctx = ranks[static_cast<std::size_t>(r)];
        ctx.agree_comm = ctx.comm.split();
        body(ctx);
        ctx.s.synchronize();
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

/// Rank contexts, each made on its device, with communicators for devices 0 and 1.
std::vector<rank_ctx> make_ranks() {
  const std::array<int, world> devices{0, 1};
  std::vector<replay::nccl_comm> comms = replay::nccl_comm::init_all(devices);
  std::vector<rank_ctx> ranks;
  ranks.reserve(world);
  for (int r = 0; r < world; ++r) {
    REPLAY_CHECK(cudaSetDevice(r));
    ranks.emplace_back();
    ranks.back().rank = r;
    ranks.back().comm = std::move(comms[static_cast<std::size_t>(r)]);
    REQUIRE(ranks.back().comm.rank() == r);
    REQUIRE(ranks.back().comm.device() == r);
  }
  REPLAY_CHECK(cudaSetDevice(0));
  return ranks;
}

/// Destroys the ranks' communicators from this thread at the end of a test (finalized in one
/// group: one thread drives both devices here).
struct comms_closer {
  std::vector<rank_ctx>& ranks;
  ~comms_closer() {
    std::vector<replay::nccl_comm> all;
    for (auto& r : ranks) {
      all.push_back(std::move(r.comm));
      all.push_back(std::move(r.agree_comm));
    }
    replay::destroy_all(all);
  }
};

std::string what(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

/// Runs `steps` steps of `rows` requested rows per rank (agree_batch on), checks each exactly.
struct run_result {
  std::vector<replay::step_path> paths;
  std::vector<std::size_t> wrong;
  std::vector<replay::batch_plan> plans;
  bool graphs = false;
  std::size_t resident = 0;
};

std::vector<run_result> run_steps(std::vector<rank_ctx>& ranks, std::array<std::size_t, world> rows,
                                  int steps, bool use_graphs = true) {
  std::vector<run_result> out(world);
  const auto errors = on_ranks(ranks, [&](rank_ctx& ctx) {
    run_result& res = out[static_cast<std::size_t>(ctx.rank)];
    runner_t runner(
        [&ctx](replay::stream_ref st, const replay::graph_key& k) { ctx.step(st, k.bucket); },
        replay::nccl_agreement(ctx.agree_comm),
        {.rank = ctx.rank,
         .buckets = replay::bucket_policy::powers_of_two(max_rows),
         .agree_batch = true,
         .warn =
             [&ctx](std::string_view m) {
               std::fprintf(stderr, "rank %d warning: %.*s\n", ctx.rank, static_cast<int>(m.size()), m.data());
               ctx.warnings.emplace_back(m);
             },
         .use_graphs = use_graphs});
    for (int step = 0; step < steps; ++step) {
      const replay::batch_plan p = runner.plan(rows[static_cast<std::size_t>(ctx.rank)]);
      ctx.before_step(step);
      res.paths.push_back(runner.run_batch(p, ctx.s, key_for));
      res.wrong.push_back(ctx.check(p.bucket, step));
      res.plans.push_back(p);
    }
    res.graphs = runner.graphs_enabled();
    res.resident = runner.pool().size();
    ctx.s.synchronize();
  });
  for (int r = 0; r < world; ++r) REQUIRE_MESSAGE(!errors[static_cast<std::size_t>(r)], "rank ", r, ": ", what(errors[static_cast<std::size_t>(r)]));
  return out;
}

}  // namespace

TEST_CASE("multi-GPU: all-reduce inside the captured step, graph == eager, exact") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks();
  const comms_closer closer{ranks};
  const auto graph = run_steps(ranks, {4, 4}, 4);
  const auto eager = run_steps(ranks, {4, 4}, 4, /*use_graphs=*/false);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto& g = graph[static_cast<std::size_t>(r)];
    const auto& e = eager[static_cast<std::size_t>(r)];
    CHECK(g.paths == std::vector<replay::step_path>{replay::step_path::captured, replay::step_path::replayed,
                                                    replay::step_path::replayed, replay::step_path::replayed});
    CHECK(e.paths == std::vector<replay::step_path>(4, replay::step_path::eager_disabled));
    CHECK(g.wrong == std::vector<std::size_t>(4, 0));
    CHECK(e.wrong == std::vector<std::size_t>(4, 0));
    CHECK(g.graphs);
    CHECK(g.resident == 1);
  }
}

TEST_CASE("multi-GPU: different requested batch sizes run the same bucket on both ranks") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks();
  const comms_closer closer{ranks};
  const auto res = run_steps(ranks, {3, 6}, 3);
  for (int r = 0; r < world; ++r) {
    const auto& x = res[static_cast<std::size_t>(r)];
    for (const auto& p : x.plans) {
      CHECK(p.rows == 6);
      CHECK(p.bucket == 8);
    }
    CHECK(x.wrong == std::vector<std::size_t>(3, 0));
    CHECK(x.paths.front() == replay::step_path::captured);
    CHECK(x.paths.back() == replay::step_path::replayed);
  }
}

// The injected failures are CUDA errors on purpose (memcheck's API-error pass leaves this suite out).
TEST_SUITE("expected_cuda_errors") {
TEST_CASE("multi-GPU: a capture failure on rank 1 leaves no graph on any rank; both run eagerly") {
  replay_test::env_guard env(nullptr);
  for (const inject where : {inject::before_collective, inject::after_collective}) {
    CAPTURE(static_cast<int>(where));
    auto ranks = make_ranks();
    const comms_closer closer{ranks};
    ranks[1].fault = where;
    const auto res = run_steps(ranks, {2, 2}, 3);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const auto& x = res[static_cast<std::size_t>(r)];
      CHECK(x.paths == std::vector<replay::step_path>(3, replay::step_path::eager_fallback));
      CHECK(x.wrong == std::vector<std::size_t>(3, 0));
      CHECK_FALSE(x.graphs);
      CHECK(x.resident == 0);
      CHECK(ranks[static_cast<std::size_t>(r)].warnings.size() == 1);
    }
    CHECK(ranks[0].warnings[0].find("another rank failed to capture") != std::string::npos);
    CHECK(ranks[1].warnings[0].find("cudaStreamSynchronize") != std::string::npos);
  }
}
}  // TEST_SUITE

TEST_CASE("multi-GPU: REPLAY_CUDA_GRAPHS=0 runs every rank eagerly") {
  replay_test::env_guard env("0");
  auto ranks = make_ranks();
  const comms_closer closer{ranks};
  const auto res = run_steps(ranks, {5, 5}, 2);
  for (const auto& x : res) {
    CHECK(x.paths == std::vector<replay::step_path>(2, replay::step_path::eager_disabled));
    CHECK(x.wrong == std::vector<std::size_t>(2, 0));
    CHECK(x.resident == 0);
  }
}

TEST_CASE("multi-GPU: all_reduce refuses a stream of another device and an uncaptured stream") {
  auto ranks = make_ranks();
  const comms_closer closer{ranks};
  REPLAY_CHECK(cudaSetDevice(1));
  replay::stream s1;
  CHECK_THROWS_AS(replay::all_reduce(ranks[0].comm, ranks[0].x.data(), ranks[0].y.data(), 8, ncclSum, s1),
                  replay::usage_error);
  REPLAY_CHECK(cudaSetDevice(0));
  replay::stream cap, other;
  {
    replay::capture_scope scope(cap);
    CHECK_THROWS_AS(
        replay::all_reduce(ranks[0].comm, ranks[0].x.data(), ranks[0].y.data(), 8, ncclSum, other),
        replay::usage_error);
  }  // discarded
  replay::nccl_comm moved = std::move(ranks[0].comm);
  CHECK_THROWS_AS(replay::all_reduce(ranks[0].comm, ranks[0].x.data(), ranks[0].y.data(), 8, ncclSum, cap),
                  replay::usage_error);
  CHECK(moved.rank() == 0);
  ranks[0].comm = std::move(moved);  // destroyed with the others, in one group
}

TEST_CASE("multi-GPU: all_gather eagerly and inside a captured graph") {
  auto ranks = make_ranks();
  const comms_closer closer{ranks};
  constexpr std::size_t n = hidden;  // elements per rank; y holds world * n of max_rows * hidden
  std::array<std::array<std::size_t, 3>, world> bad{};  // wrong elements: eager, two replays
  const auto errors = on_ranks(ranks, [&](rank_ctx& r) {
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    auto step = [&](replay::stream_ref st) {
      fill_shard<<<blocks, 256, 0, st.get()>>>(r.x.data(), n, r.rank, r.step_value.data());
      REPLAY_CHECK_LAUNCH("fill_shard");
      replay::all_gather(r.comm, r.x.data(), r.y.data(), n, st);
    };
    // Rank k's shard lands at y + k * n on every rank; the rest of y stays poison.
    auto wrong = [&](int value) {
      const auto host = replay_test::to_host(r.y.data(), r.y.size(), r.s);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < host.size(); ++i) {
        if (i < world * n) {
          const int k = static_cast<int>(i / n);
          bad += host[i] != static_cast<float>((k + 1) * (static_cast<int>(i % n % 97) + 1 + value));
        } else {
          std::uint32_t bits = 0;
          std::memcpy(&bits, &host[i], sizeof bits);
          bad += bits != 0xEFEFEFEFu;
        }
      }
      return bad;
    };
    auto& b = bad[static_cast<std::size_t>(r.rank)];
    r.before_step(3);
    step(r.s);
    b[0] = wrong(3);
    const replay::graph_exec exec = replay::capture(r.s, step).instantiate({.upload_stream = r.s.get()});
    for (int v : {5, 8}) {
      r.before_step(v);
      exec.launch(r.s);
      b[v == 5 ? 1 : 2] = wrong(v);
    }
  });
  for (const auto& e : errors) CHECK_MESSAGE(!e, what(e));
  for (const auto& b : bad) CHECK(b == std::array<std::size_t, 3>{});
}

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count < world) {
    std::printf("SKIP: needs %d CUDA devices (%s)\n", world,
                err == cudaSuccess ? (std::to_string(count) + " found").c_str() : cudaGetErrorName(err));
    return 77;
  }
  int version = 0;
  (void)ncclGetVersion(&version);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("devices: %d x %s, NCCL %d\n", count, prop.name, version);
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
