// GPU tests of conditional nodes (conditional.hpp) and the device-side token loop (device_loop.hpp):
// exact trip counts read from device memory, PDL launches inside a WHILE body, IF nodes taking
// both branches, a loop inside a graph_pool, early stops on a stop token and at the context limit,
// and the step metadata advanced on the device.
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include "fake_decode.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// One run of a loop body: trace[n] = 7 n + 1, n = ++*count; stops when n reaches *limit.
__global__ void count_step(int* count, const int* limit, int* trace, replay::condition c) {
  const int n = *count;
  trace[n] = 7 * n + 1;
  *count = n + 1;
  if (n + 1 >= *limit) c.set(false);
}

// Three kernels chained with PDL: a[0] = n + 100, then b[0] = a[0] * 2, then the counter step.
__global__ void pdl_first(const int* count, int* a) {
  replay::pdl::launch_dependents();
  a[0] = *count + 100;
}
__global__ void pdl_second(const int* a, int* b) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  b[0] = a[0] * 2;
}
__global__ void pdl_third(const int* b, int* count, const int* limit, int* trace, replay::condition c) {
  replay::pdl::wait();
  const int n = *count;
  trace[n] = b[0];
  *count = n + 1;
  if (n + 1 >= *limit) c.set(false);
}

__global__ void set_from(const int* flag, replay::condition c, replay::condition d) {
  c.set(*flag != 0);
  d.set(*flag != 0);
}
__global__ void write_value(int* out, int v) { *out = v; }

using fake_decode::fake_meta;
using fake_decode::fake_decode_step;
using fake_decode::host_tokens;

void set_int(int* p, int v, replay::stream_ref s) {
  REPLAY_CHECK(cudaMemcpyAsync(p, &v, sizeof v, cudaMemcpyHostToDevice, s.get()));
  s.synchronize();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("a WHILE node runs its body exactly the number of times device memory says") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(64);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), cs.get()));
    replay::while_loop(cs, [&](replay::stream_ref body, replay::condition c) {
      replay::launch(count_step, {.stream = body}, count.data(), limit.data(), trace.data(), c);
    });
  });
  CHECK(g.count_nodes(cudaGraphNodeTypeConditional) == 1);
  replay::graph_exec exec = g.instantiate();
  for (int n : {5, 1, 17, 3}) {
    CAPTURE(n);
    set_int(limit.data(), n, s);
    replay_test::poison(trace.data(), trace.size_bytes(), s);
    exec.launch(s);
    const auto t = replay_test::to_host(trace.data(), 64, s);
    CHECK(replay_test::to_host(count.data(), 1, s)[0] == n);
    for (int i = 0; i < n; ++i) CHECK(t[i] == 7 * i + 1);
    CHECK(static_cast<std::uint32_t>(t[n]) == 0xEFEFEFEFu);  // the run after the last did not happen
  }
}

TEST_CASE("a WHILE node whose condition starts at 0 does not run its body") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(4);
  set_int(limit.data(), 3, s);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), cs.get()));
    replay::while_loop(
        cs,
        [&](replay::stream_ref body, replay::condition c) {
          replay::launch(count_step, {.stream = body}, count.data(), limit.data(), trace.data(), c);
        },
        {.default_value = 0});
  });
  replay::graph_exec exec = g.instantiate();
  exec.launch(s);
  CHECK(replay_test::to_host(count.data(), 1, s)[0] == 0);
}

TEST_CASE("PDL launches inside a WHILE body are captured with programmatic edges and run in order") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(32), a(1), b(1);
  std::size_t body_programmatic = 0;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), cs.get()));
    replay::while_loop(cs, [&](replay::stream_ref body, replay::condition c) {
      replay::launch(pdl_first, {.stream = body}, count.data(), a.data());
      replay::launch(pdl_second, {.stream = body, .pdl = true}, a.data(), b.data());
      replay::launch(pdl_third, {.stream = body, .pdl = true}, b.data(), count.data(), limit.data(), trace.data(), c);
      // The body graph as captured so far (owned by the node: borrowed, then released).
      cudaStreamCaptureStatus st{};
      cudaGraph_t bg = nullptr;
#if CUDART_VERSION >= 13000
      REPLAY_CHECK(cudaStreamGetCaptureInfo(body.get(), &st, nullptr, &bg, nullptr, nullptr, nullptr));
#else
      REPLAY_CHECK(cudaStreamGetCaptureInfo(body.get(), &st, nullptr, &bg, nullptr, nullptr));
#endif
      replay::graph view(bg);
      body_programmatic = view.programmatic_edge_count();
      (void)view.release();
    });
  });
  CHECK(body_programmatic == 2);
  replay::graph_exec exec = g.instantiate();
  for (int n : {9, 2}) {
    set_int(limit.data(), n, s);
    replay_test::poison(trace.data(), trace.size_bytes(), s);
    exec.launch(s);
    const auto t = replay_test::to_host(trace.data(), 32, s);
    CHECK(replay_test::to_host(count.data(), 1, s)[0] == n);
    for (int i = 0; i < n; ++i) CHECK(t[i] == 2 * (i + 100));
  }
}

TEST_CASE("an IF node takes both branches") {
  replay::stream s;
  replay::device_buffer<int> flag(1), out(1), other(1);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    const replay::condition c = replay::make_condition(cs, {.default_value = 0});
    const replay::condition d = replay::make_condition(cs, {.default_value = 0});  // one per node
    replay::launch(set_from, {.stream = cs}, flag.data(), c, d);
#if CUDART_VERSION >= 12080
    replay::if_then_else(
        cs, c, [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, out.data(), 11); },
        [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, out.data(), 22); });
#else
    replay::if_then(cs, c, [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, out.data(), 11); });
#endif
    // A plain IF: runs only when its condition is set.
    replay::if_then(cs, d, [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, other.data(), 33); });
  });
  CHECK(g.count_nodes(cudaGraphNodeTypeConditional) == 2);
  replay::graph_exec exec = g.instantiate();
  for (int f : {1, 0, 1}) {
    CAPTURE(f);
    set_int(flag.data(), f, s);
    replay_test::poison(out.data(), sizeof(int), s);
    replay_test::poison(other.data(), sizeof(int), s);
    exec.launch(s);
    const int o = replay_test::to_host(out.data(), 1, s)[0];
    const int x = replay_test::to_host(other.data(), 1, s)[0];
#if CUDART_VERSION >= 12080
    CHECK(o == (f != 0 ? 11 : 22));
#else
    if (f != 0) CHECK(o == 11);
#endif
    if (f != 0) CHECK(x == 33);
    else CHECK(static_cast<std::uint32_t>(x) == 0xEFEFEFEFu);
  }
}

TEST_CASE("a WHILE loop inside a graph_pool step: one capture, trip count from device memory") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(64);
  auto step = [&](replay::stream_ref cs) {
    REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), cs.get()));
    replay::while_loop(cs, [&](replay::stream_ref body, replay::condition c) {
      replay::launch(count_step, {.stream = body}, count.data(), limit.data(), trace.data(), c);
    });
  };
  replay::graph_pool<replay::graph_key> pool({.warmup = 1});  // the warm-up runs the loop eagerly
  for (int n : {4, 9, 1, 30}) {
    CAPTURE(n);
    set_int(limit.data(), n, s);
    replay_test::poison(trace.data(), trace.size_bytes(), s);
    (void)pool.run(replay::graph_key{.bucket = 1}, s, step);
    const auto t = replay_test::to_host(trace.data(), 64, s);
    CHECK(replay_test::to_host(count.data(), 1, s)[0] == n);
    for (int i = 0; i < n; ++i) CHECK(t[i] == 7 * i + 1);
  }
  CHECK(pool.stats().captures == 1);
  CHECK(pool.stats().hits == 3);
}

TEST_CASE("step_runner replays a step with a WHILE loop") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(16);
  auto step = [&](replay::stream_ref cs, const replay::graph_key&) {
    REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), cs.get()));
    replay::while_loop(cs, [&](replay::stream_ref body, replay::condition c) {
      replay::launch(count_step, {.stream = body}, count.data(), limit.data(), trace.data(), c);
    });
  };
  replay::step_runner<replay::graph_key> runner(step);
  for (int n : {3, 6}) {
    set_int(limit.data(), n, s);
    (void)runner.run(replay::graph_key{.bucket = 2}, s);
    CHECK(replay_test::to_host(count.data(), 1, s)[0] == n);
  }
}

TEST_CASE("token_loop: K steps per launch, metadata advanced on the device") {
  replay::stream s;
  constexpr int context = 1000;
  replay::step_meta<fake_meta> meta;
  replay::token_loop loop(16);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(fake_decode_step, {.stream = body}, meta.device(), context, ref);
    });
  });
  replay::graph_exec exec = g.instantiate();
  const fake_meta first{3, 10, 11, 5};
  const auto expected = host_tokens(first, 40);
  meta.push(s, first);
  std::vector<int> got;
  for (int k : {16, 16, 1, 7}) {  // 40 tokens; the device carries the metadata between launches
    CAPTURE(k);
    loop.arm(s, k);
    exec.launch(s);
    const replay::loop_result r = loop.wait(s);
    CHECK(r.stop == replay::loop_stop::steps);
    CHECK(r.tokens.size() == static_cast<std::size_t>(k));
    got.insert(got.end(), r.tokens.begin(), r.tokens.end());
  }
  CHECK(got == expected);
  const fake_meta after = replay_test::to_host(meta.device(), 1, s)[0];
  CHECK(after.pos == first.pos + 40);
  CHECK(after.seq_len == first.seq_len + 40);
  CHECK(after.token == expected.back());
}

TEST_CASE("token_loop: a stop token ends the launch early; the context limit too") {
  replay::stream s;
  replay::step_meta<fake_meta> meta;
  replay::token_loop loop(32);
  replay::device_buffer<int> context(1);
  int ctx = 1000;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(fake_decode_step, {.stream = body}, meta.device(), ctx, ref);
    });
  });
  replay::graph_exec exec = g.instantiate();
  const fake_meta first{1, 0, 1, 9};
  const auto expected = host_tokens(first, 32);
  // The stop token: the 6th token (its first occurrence).
  int stop_at = 5;
  while (stop_at > 0 && std::find(expected.begin(), expected.begin() + stop_at, expected[stop_at]) !=
                            expected.begin() + stop_at)
    ++stop_at;
  meta.push(s, first);
  loop.arm(s, 32, expected[stop_at]);
  exec.launch(s);
  replay::loop_result r = loop.wait(s);
  CHECK(r.stop == replay::loop_stop::stop_token);
  REQUIRE(r.tokens.size() == static_cast<std::size_t>(stop_at + 1));
  CHECK(std::vector<int>(r.tokens.begin(), r.tokens.end()) ==
        std::vector<int>(expected.begin(), expected.begin() + stop_at + 1));
  CHECK(replay_test::to_host(meta.device(), 1, s)[0].seq_len == first.seq_len + stop_at + 1);

  // The context limit (a new capture with a small context): stops when seq_len + 1 reaches it.
  ctx = 9;
  replay::graph g2 = replay::capture(s, [&](replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(fake_decode_step, {.stream = body}, meta.device(), ctx, ref);
    });
  });
  replay::graph_exec exec2 = g2.instantiate();
  meta.push(s, first);
  loop.arm(s, 32);
  exec2.launch(s);
  r = loop.wait(s);
  CHECK(r.stop == replay::loop_stop::context);
  CHECK(r.tokens.size() == 8u);  // seq_len 1 -> 9
  CHECK(std::vector<int>(r.tokens.begin(), r.tokens.end()) == std::vector<int>(expected.begin(), expected.begin() + 8));
}

TEST_CASE("conditional nodes refuse misuse with usage_error") {
  replay::stream s;
  replay::device_buffer<int> count(1), limit(1), trace(4);
  // No capture: make_condition and the explicit-condition forms need one.
  try {
    (void)replay::make_condition(s);
    FAIL("make_condition outside a capture did not throw");
  } catch (const replay::usage_error& e) {
    CHECK(contains(e.what(), "is not capturing"));
  }
  CHECK_THROWS_AS(replay::if_then(s, replay::condition{}, [](replay::stream_ref) {}), replay::usage_error);
  // A null condition inside a capture: the capture is discarded, the stream stays usable.
  CHECK_THROWS_AS((void)replay::capture(s,
                                        [&](replay::stream_ref cs) {
                                          replay::while_loop(cs, replay::condition{}, [](replay::stream_ref) {});
                                        }),
                  replay::usage_error);
  // An exception inside a body propagates; the stream is usable afterwards.
  CHECK_THROWS_AS((void)replay::capture(s,
                                        [&](replay::stream_ref cs) {
                                          replay::while_loop(cs, [](replay::stream_ref, replay::condition) {
                                            throw std::runtime_error("body failed");
                                          });
                                        }),
                  std::runtime_error);
  CHECK_FALSE(s.is_capturing());
  set_int(limit.data(), 2, s);
  // Eager while_loop still works on the same stream.
  REPLAY_CHECK(cudaMemsetAsync(count.data(), 0, sizeof(int), s.get()));
  replay::while_loop(s, [&](replay::stream_ref body, replay::condition c) {
    replay::launch(count_step, {.stream = body}, count.data(), limit.data(), trace.data(), c);
  });
  CHECK(replay_test::to_host(count.data(), 1, s)[0] == 2);

  replay::token_loop loop(4);
  CHECK_THROWS_AS(loop.arm(s, 5), replay::usage_error);
  CHECK_THROWS_AS(loop.arm(s, 0), replay::usage_error);
  CHECK_THROWS_AS((void)loop.wait(s), replay::usage_error);  // never armed
  replay::token_loop moved = std::move(loop);
  CHECK_THROWS_AS(loop.arm(s, 1), replay::usage_error);
  CHECK_THROWS_AS((void)loop.wait(s), replay::usage_error);
  CHECK(moved.capacity() == 4u);
  moved.arm(s, 2);
  CHECK_THROWS_AS((void)moved.wait(s), replay::usage_error);  // armed, never launched: nothing stopped
}

TEST_CASE("a condition drives one node: a second node on it is refused, naming the rule" *
          doctest::test_suite("expected_cuda_errors")) {
  replay::stream s;
  replay::device_buffer<int> out(1);
  const auto body = [&](replay::stream_ref b) { replay::launch(write_value, {.stream = b}, out.data(), 1); };
  try {
    (void)replay::capture(s, [&](replay::stream_ref cs) {
      const replay::condition c = replay::make_condition(cs);
      replay::if_then(cs, c, body);
      replay::if_then(cs, c, body);
    });
    FAIL("a second node on one condition was accepted");
  } catch (const replay::cuda_error& e) {
    CHECK(contains(e.what(), "a condition drives one node only"));
  }
  CHECK_FALSE(s.is_capturing());
}
