// GPU tests of the device loop, conditional nodes, step metadata and the audit combined with the
// pieces an engine uses every day: a token_loop step inside a graph_pool and a step_runner (default
// options, graphs off, fallback), the launch numbering that wait() matches, conditions' defaults,
// empty WHILE bodies, capture_copy on eager paths, the runner's device check, an unused condition,
// and the audit reading conditional bodies.
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include "fake_decode.cuh"

#include <cstdint>
#include <string>
#include <vector>

namespace {

using fake_decode::fake_meta;
using fake_decode::fake_sample;
using fake_decode::host_tokens;

using fake_decode::fake_decode_step;
// The same step with the position passed by value (frozen at capture): what the audit must find.
__global__ void loop_step_frozen(fake_meta* meta, int pos, replay::token_loop_ref loop) {
  const fake_meta m = *meta;
  const int token = fake_sample({m.token, pos, m.seq_len, m.seed});
  meta->token = token;
  meta->pos = m.seq_len;
  meta->seq_len = m.seq_len + 1;
  (void)loop.append(token);
}

__global__ void write_value(int* out, int v) { *out = v; }
__global__ void copy_meta(const int* meta, int* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = meta[i] * 3 + 1;
}
__global__ void set_if(const int* flag, replay::condition c) { c.set(*flag != 0); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A token_loop step, its metadata and the reference tokens, driven through any launcher.
struct loop_fixture {
  replay::stream s;
  replay::step_meta<fake_meta> meta;
  replay::token_loop loop{16};
  const fake_meta first{3, 10, 11, 5};
  std::vector<int> expected = host_tokens(first, 64);
  std::vector<int> got;

  void step(replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(fake_decode_step, {.stream = body}, meta.device(), 100000, ref);
    });
  }
  /// Runs `launch()` for each K, collecting the tokens, then checks tokens and metadata.
  template <class Launch>
  void decode(const std::vector<int>& ks, Launch&& launch) {
    meta.push(s, first);
    int total = 0;
    for (int k : ks) {
      CAPTURE(k);
      loop.arm(s, k);
      launch();
      const replay::loop_result r = loop.wait(s);
      CHECK(r.stop == replay::loop_stop::steps);
      CHECK(r.tokens.size() == static_cast<std::size_t>(k));
      got.insert(got.end(), r.tokens.begin(), r.tokens.end());
      total += k;
    }
    CHECK(got == std::vector<int>(expected.begin(), expected.begin() + total));
    const fake_meta after = replay_test::to_host(meta.device(), 1, s)[0];
    CHECK(after.seq_len == first.seq_len + total);  // advanced exactly once per token
  }
};

}  // namespace

TEST_CASE("a token_loop step in a graph_pool with default options decodes each token once") {
  loop_fixture f;
  replay::graph_pool<replay::graph_key> pool;  // default warm-up: 1
  f.decode({16, 5, 16, 1}, [&] { (void)pool.run(replay::graph_key{.bucket = 1}, f.s, [&](replay::stream_ref cs) { f.step(cs); }); });
  CHECK(pool.stats().captures == 1);
  CHECK(pool.stats().hits == 3);
}

TEST_CASE("a token_loop step in a step_runner: graphs, graphs off, and after a fallback") {
  SUBCASE("graphs (default options)") {
    loop_fixture f;
    replay::step_runner<replay::graph_key> runner([&](replay::stream_ref cs, const replay::graph_key&) { f.step(cs); });
    f.decode({7, 16, 2}, [&] { CHECK(runner.run(replay::graph_key{.bucket = 1}, f.s) != replay::step_path::eager_disabled); });
  }
  SUBCASE("graphs off: every eager run is one launch") {
    loop_fixture f;
    replay::step_runner<replay::graph_key> runner([&](replay::stream_ref cs, const replay::graph_key&) { f.step(cs); },
                                                  {.use_graphs = false});
    f.decode({4, 9}, [&] { CHECK(runner.run(replay::graph_key{.bucket = 1}, f.s) == replay::step_path::eager_disabled); });
  }
  SUBCASE("a capture that fails falls back to one eager launch") {
    loop_fixture f;
    std::vector<std::string> warnings;
    bool fail = true;
    replay::step_runner<replay::graph_key> runner(
        [&](replay::stream_ref cs, const replay::graph_key&) {
          if (fail && cs.capture_status() != cudaStreamCaptureStatusNone) throw std::runtime_error("capture refused");
          f.step(cs);
        },
        {.warn = [&](std::string_view m) { warnings.emplace_back(m); }});
    f.decode({6, 3}, [&] { CHECK(runner.run(replay::graph_key{.bucket = 1}, f.s) == replay::step_path::eager_fallback); });
    CHECK(warnings.size() == 1);
  }
}

TEST_CASE("token_loop::wait matches launches: an extra launch is named, the next launch may be armed first") {
  loop_fixture f;
  replay::graph g = replay::capture(f.s, [&](replay::stream_ref cs) { f.step(cs); });
  replay::graph_exec exec = g.instantiate();
  f.meta.push(f.s, f.first);
  // Arming the next launch (a smaller limit) before waiting for this one.
  f.loop.arm(f.s, 12);
  exec.launch(f.s);
  f.loop.arm(f.s, 3);
  replay::loop_result r = f.loop.wait(f.s);
  CHECK(r.tokens.size() == 12);
  CHECK(std::vector<int>(r.tokens.begin(), r.tokens.end()) == std::vector<int>(f.expected.begin(), f.expected.begin() + 12));
  exec.launch(f.s);
  r = f.loop.wait(f.s);
  CHECK(r.tokens.size() == 3);
  // Two launches, one wait: the wait says so instead of returning the second launch's tokens.
  exec.launch(f.s);
  exec.launch(f.s);
  f.s.synchronize();
  try {
    (void)f.loop.wait(f.s);
    FAIL("no throw");
  } catch (const replay::usage_error& e) {
    CHECK(contains(e.what(), "expected launch 3 but launch 4 finished"));
  }
  exec.launch(f.s);  // back in step: the next wait takes launch 5
  CHECK(f.loop.wait(f.s).tokens.size() == 3);
  // No launch at all: named, after a synchronisation.
  CHECK_THROWS_AS((void)f.loop.wait(f.s), replay::usage_error);
}

TEST_CASE("the audit compares the bodies of a token_loop's WHILE node") {
  replay::stream s;
  replay::step_meta<fake_meta> meta;
  replay::token_loop loop(8);
  int pos = 10;
  const auto frozen = [&](replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(loop_step_frozen, {.stream = body}, meta.device(), pos, ref);
    });
  };
  const replay::audit_report bad = replay::audit_step(s, frozen, [&](int v) { pos = 10 + v; });
  CHECK_FALSE(bad.clean());
  REQUIRE(bad.frozen_values.size() == 1);
  CHECK(contains(bad.frozen_values[0].kernel, "loop_step_frozen"));
  CHECK(bad.frozen_values[0].path == "1/0/0");  // node 1 (the WHILE), body 0, node 0
  CHECK(bad.frozen_values[0].arg_index == 1);
  CHECK(bad.not_compared.empty());

  const auto good = [&](replay::stream_ref cs) {
    loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      replay::launch(fake_decode_step, {.stream = body}, meta.device(), 1000, ref);
    });
  };
  const replay::audit_report ok =
      replay::audit_step(s, good, [&](int v) { meta.push(s, {1 + v, 10 + v, 11 + v, 7}); });
  CHECK(ok.clean());
  CHECK(ok.nodes_compared == 3);  // the reset, the WHILE node, the step inside its body
  const replay::graph g = replay::capture(s, good);
  CHECK(replay::inspect(g).count(cudaGraphNodeTypeKernel) == 1);  // the body's kernel is visible
  // Captured without a capture_scope, the bodies were not recorded and (CUDA 13.0) cannot be read:
  // the report says "not compared" and is not clean.
  REPLAY_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  good(s);
  cudaGraph_t raw = nullptr;
  REPLAY_CHECK(cudaStreamEndCapture(s.get(), &raw));
  const replay::graph unrecorded(raw);
  const replay::audit_report unknown = replay::audit_graphs(unrecorded, unrecorded);
  if (replay::inspect(unrecorded).nodes[1].bodies_known) {
    CHECK(unknown.clean());  // a runtime that returns bodies (CUDA 13.1+)
  } else {
    CHECK_FALSE(unknown.clean());
    CHECK(unknown.not_compared.size() == 1);
  }
}

TEST_CASE("make_condition's default is 0: an IF body runs only when a kernel sets the condition") {
  replay::stream s;
  replay::device_buffer<int> flag(1), out(1);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    const replay::condition c = replay::make_condition(cs);
    replay::if_then(cs, c, [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, out.data(), 42); });
  });
  replay::graph_exec exec = g.instantiate();
  replay_test::poison(out.data(), out.size_bytes(), s);
  exec.launch(s);
  CHECK(static_cast<std::uint32_t>(replay_test::to_host(out.data(), 1, s)[0]) == 0xEFEFEFEFu);  // not run
  // Set by a kernel before the node: runs.
  replay::graph g2 = replay::capture(s, [&](replay::stream_ref cs) {
    const replay::condition c = replay::make_condition(cs);
    replay::launch(set_if, {.stream = cs}, flag.data(), c);
    replay::if_then(cs, c, [&](replay::stream_ref body) { replay::launch(write_value, {.stream = body}, out.data(), 42); });
  });
  replay::graph_exec e2 = g2.instantiate();
  for (int f : {1, 0}) {
    REPLAY_CHECK(cudaMemcpyAsync(flag.data(), &f, sizeof f, cudaMemcpyHostToDevice, s.get()));
    replay_test::poison(out.data(), out.size_bytes(), s);
    e2.launch(s);
    const int v = replay_test::to_host(out.data(), 1, s)[0];
    if (f) CHECK(v == 42);
    else CHECK(static_cast<std::uint32_t>(v) == 0xEFEFEFEFu);
  }
}

TEST_CASE("a WHILE body that captured nothing is refused, naming the likely cause; the stream stays usable") {
  replay::stream s;
  replay::device_buffer<int> out(1);
  try {
    replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
      replay::while_loop(cs, [&](replay::stream_ref, replay::condition) {
        replay::launch(write_value, {.stream = cs}, out.data(), 1);  // the slip: the outer stream
      });
    });
    FAIL("no throw");
  } catch (const replay::usage_error& e) {
    CHECK(contains(e.what(), "captured no work"));
    CHECK(contains(e.what(), "outer stream"));
  }
  replay::launch(write_value, {.stream = s}, out.data(), 5);
  CHECK(replay_test::to_host(out.data(), 1, s)[0] == 5);
}

TEST_CASE("capture_copy works on every path that runs the step: pool warm-up and replay, runner eager paths") {
  replay::stream s;
  replay::step_meta_array<int> meta(4);
  replay::device_buffer<int> out(4);
  auto step = [&](replay::stream_ref cs, const replay::graph_key&) {
    meta.capture_copy(cs);
    replay::launch(copy_meta, {.stream = cs}, meta.device(), out.data(), 4);
  };
  const auto run_and_check = [&](auto&& run, int base) {
    auto st = meta.graph_staging();
    for (int i = 0; i < 4; ++i) st[i] = base + i;
    replay_test::poison(out.data(), out.size_bytes(), s);
    run();
    const auto v = replay_test::to_host(out.data(), 4, s);
    for (int i = 0; i < 4; ++i) CHECK(v[i] == (base + i) * 3 + 1);
  };
  replay::graph_pool<replay::graph_key> pool;  // default warm-up calls capture_copy eagerly
  for (int base : {10, 20, 30}) run_and_check([&] { (void)pool.run(replay::graph_key{.bucket = 4}, s, step); }, base);
  replay::step_runner<replay::graph_key> off(step, {.use_graphs = false});
  for (int base : {40, 50}) run_and_check([&] { CHECK(off.run(replay::graph_key{.bucket = 4}, s) == replay::step_path::eager_disabled); }, base);
  replay::step_runner<replay::graph_key> sized(step, {.buckets = replay::bucket_policy::list({1, 2})});
  run_and_check([&] {
    CHECK(sized.run_batch(4, s, [](std::size_t n) { return replay::graph_key{.bucket = static_cast<std::uint32_t>(n)}; }) ==
          replay::step_path::eager_oversize);
  }, 60);
}

TEST_CASE("the runner's eager paths check the pool's device as the graph path does") {
  int devices = 0;
  REPLAY_CHECK(cudaGetDeviceCount(&devices));
  replay::stream s;
  int runs = 0;
  auto step = [&](replay::stream_ref, const replay::graph_key&) { ++runs; };
  // A runner whose pool belongs to a device that is not current (one that does not exist here).
  replay::step_runner<replay::graph_key> graphs(step, {}, replay::cuda_graph_backend(devices));
  replay::step_runner<replay::graph_key> off(step, {.use_graphs = false}, replay::cuda_graph_backend(devices));
  CHECK_THROWS_AS(graphs.run(replay::graph_key{.bucket = 1}, s), replay::usage_error);
  CHECK_THROWS_AS(off.run(replay::graph_key{.bucket = 1}, s), replay::usage_error);
  CHECK(runs == 0);
}

TEST_CASE("a condition that drives no node: instantiation fails naming it" * doctest::test_suite("expected_cuda_errors")) {
  replay::stream s;
  replay::device_buffer<int> out(1);
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    (void)replay::make_condition(cs);  // made, never used
    replay::launch(write_value, {.stream = cs}, out.data(), 1);
  });
  try {
    (void)g.instantiate();
    FAIL("no throw");
  } catch (const replay::cuda_error& e) {
    CHECK(contains(e.what(), "drive no conditional node"));
  }
}
