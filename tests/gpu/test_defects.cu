// GPU regression tests of the library's audited defects. Each case uses only APIs that predate its
// fix, so the file also builds against older headers and shows the defect there.
//
// Tests that provoke CUDA API errors on purpose are in the test suite "expected_cuda_errors".
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace {

struct meta_t {
  int token;
  int pos;
};

// Busy-waits for about `cycles` SM clock cycles (keeps a stream occupied).
__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// out[m.pos] = m.token.
__global__ void write_token(const meta_t* meta, int* out) {
  if (threadIdx.x == 0) out[meta->pos] = meta->token;
}

// out[0] = the metadata's token and position as read now.
__global__ void read_meta(const meta_t* meta, int* out) {
  out[0] = meta->token;
  out[1] = meta->pos;
}

__global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }

constexpr long long spin_ms = 2'000'000;  // about 1 ms at 2 GHz

}  // namespace

TEST_CASE("step_meta::push while capturing is refused") {
  replay::stream s;
  replay::step_meta<meta_t> meta;
  replay::device_buffer<int> out(4);
  bool threw = false;
  try {
    replay::capture_scope scope(s);
    meta.staging() = {1, 0};
    meta.push(s);  // would bake in the current staging slot
    write_token<<<1, 1, 0, s.get()>>>(meta.device(), out.data());
    (void)scope.finish();
  } catch (const replay::usage_error& e) {
    threw = std::string(e.what()).find("capture_copy") != std::string::npos;
  }
  CHECK(threw);
  CHECK_FALSE(s.is_capturing());
}

TEST_CASE("the in-graph copy is guarded without any call after launch") {
  // Each replay spins before its copy, so back-to-back launches queue up; writing the next values
  // into graph_staging() must wait for the previous replay's copy.
  replay::stream s;
  constexpr int steps = 12;
  replay::device_buffer<int> out(steps);
  replay_test::poison(out.data(), out.size_bytes(), s);
  replay::step_meta<meta_t> meta;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    spin<<<1, 1, 0, cs.get()>>>(spin_ms / 4);
    REPLAY_CHECK_LAUNCH("spin");
    meta.capture_copy(cs);
    write_token<<<1, 32, 0, cs.get()>>>(meta.device(), out.data());
    REPLAY_CHECK_LAUNCH("write_token");
  });
  replay::graph_exec exec = g.instantiate();
  for (int pos = 0; pos < steps; ++pos) {
    meta.graph_staging() = meta_t{1000 + pos, pos};
    exec.launch(s);
  }
  const auto host = replay_test::to_host(out.data(), steps, s);
  for (int pos = 0; pos < steps; ++pos) CHECK(host[pos] == 1000 + pos);
}

TEST_CASE("step_meta is zero for a non-blocking stream right after construction") {
  replay::stream s;
  // Leave a poisoned allocation behind for the metadata to reuse, and keep the legacy stream busy.
  {
    void* p = nullptr;
    REPLAY_CHECK(cudaMalloc(&p, 1 << 20));
    REPLAY_CHECK(cudaMemset(p, 0x7F, 1 << 20));
    REPLAY_CHECK(cudaDeviceSynchronize());
    REPLAY_CHECK(cudaFree(p));
  }
  replay::device_buffer<int> out(2);
  replay_test::poison(out.data(), out.size_bytes(), s);
  s.synchronize();
  spin<<<1, 1, 0, cudaStreamLegacy>>>(spin_ms * 20);
  REPLAY_CHECK_LAUNCH("spin");
  replay::step_meta<meta_t> meta;
  read_meta<<<1, 1, 0, s.get()>>>(meta.device(), out.data());
  REPLAY_CHECK_LAUNCH("read_meta");
  const auto host = replay_test::to_host(out.data(), 2, s);
  CHECK(host[0] == 0);
  CHECK(host[1] == 0);
  REPLAY_CHECK(cudaDeviceSynchronize());
}

TEST_CASE("graph_exec::update keeps the exec's instantiate flags when it re-instantiates" *
          doctest::test_suite("expected_cuda_errors")) {
  replay::stream s;
  replay::device_buffer<float> x(32);
  auto step = [&](int kernels) {
    return replay::capture(s, [&](replay::stream_ref cs) {
      for (int i = 0; i < kernels; ++i) add_one<<<1, 32, 0, cs.get()>>>(x.data());
      REPLAY_CHECK_LAUNCH("add_one");
    });
  };
  replay::graph_exec exec = step(1).instantiate({.device_launch = true, .upload_stream = s.get()});
  unsigned long long before = 0;
  REPLAY_CHECK(cudaGraphExecGetFlags(exec.get(), &before));
  CHECK((before & cudaGraphInstantiateFlagDeviceLaunch) != 0);
  const replay::update_result r = exec.update(step(3));  // topology changed: re-instantiated
  CHECK(r.reinstantiated);
  unsigned long long after = 0;
  REPLAY_CHECK(cudaGraphExecGetFlags(exec.get(), &after));
  CHECK((after & cudaGraphInstantiateFlagDeviceLaunch) != 0);
  exec.launch(s);
  s.synchronize();
}

TEST_CASE("an evicted graph whose last stream was destroyed is retired once its replay ends") {
  replay::device_buffer<float> x(32);
  replay::graph_pool<int> pool({.warmup = 0});
  {
    replay::stream tmp;
    pool.run(1, tmp, [&](replay::stream_ref cs) {
      spin<<<1, 1, 0, cs.get()>>>(spin_ms * 50);
      add_one<<<1, 32, 0, cs.get()>>>(x.data());
      REPLAY_CHECK_LAUNCH("spin + add_one");
    });
  }  // the stream of the last replay is gone; its work is still running
  CHECK(pool.evict(1));
  CHECK(cudaGetLastError() == cudaSuccess);
  // Not destroyed yet (its replay runs on), and no device-wide wait happened.
  CHECK(pool.stats().retired_pending == 1);
  REPLAY_CHECK(cudaDeviceSynchronize());
  pool.collect();
  CHECK(pool.stats().retired_pending == 0);
}

TEST_CASE("step_meta_array destruction waits for the copies still reading its staging") {
  replay::stream s;
  constexpr std::size_t n = 4 << 20;  // 16 MiB of ints: the copy runs long after push() returns
  replay::device_buffer<int> snapshot(n);
  replay_test::poison(snapshot.data(), snapshot.size_bytes(), s);
  {
    replay::step_meta_array<int> meta(n);
    auto st = meta.staging();
    for (std::size_t i = 0; i < n; ++i) st[i] = static_cast<int>(i ^ 0x5a5a);
    spin<<<1, 1, 0, s.get()>>>(spin_ms * 20);
    REPLAY_CHECK_LAUNCH("spin");
    meta.push(s);  // queued behind the spin
    REPLAY_CHECK(cudaMemcpyAsync(snapshot.data(), meta.device(), n * sizeof(int),
                                 cudaMemcpyDeviceToDevice, s.get()));
  }  // frees the pinned staging (before the device copy): must wait for the push first
  const auto host = replay_test::to_host(snapshot.data(), n, s);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += host[i] != static_cast<int>(i ^ 0x5a5a) ? 1 : 0;
  CHECK(wrong == 0);
}
