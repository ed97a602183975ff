// GPU tests of the core toolkit: capture, replay with step metadata, error recovery inside a
// capture, graph_exec::update, arena addresses and moved-from handles.
//
// Tests that provoke CUDA API errors on purpose are in the test suite "expected_cuda_errors", so
// compute-sanitizer can run the rest with API-error reporting on (scripts/gpu-check.sh).
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include <string>
#include <vector>

namespace {

struct meta_t {
  int token;
  int pos;
  float scale;
};

// Writes out[pos] = token * scale + pos, reading every per-step value through the pointer.
__global__ void write_step(const meta_t* meta, float* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const meta_t m = *meta;
    out[m.pos] = static_cast<float>(m.token) * m.scale + static_cast<float>(m.pos);
  }
}

__global__ void add_value(float* x, int n, float v) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += v;
}

__global__ void legacy_probe(int* p) { *p = 1; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("replay sees new step_meta values every step") {
  replay::stream s;
  constexpr int steps = 64;
  replay::device_buffer<float> out(steps);
  replay_test::poison(out.data(), out.size_bytes(), s);
  replay::step_meta<meta_t> meta(meta_t{0, 0, 1.0f});

  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    write_step<<<1, 32, 0, cs.get()>>>(meta.device(), out.data());
    REPLAY_CHECK_LAUNCH("write_step");
  });
  CHECK(g.kernel_node_count() == 1);
  replay::graph_exec exec = g.instantiate({.upload_stream = s.get()});

  for (int pos = 0; pos < steps; ++pos) {
    meta.staging() = meta_t{100 + pos, pos, 0.5f};  // double-buffered: never races the last push
    meta.push(s);
    exec.launch(s);
  }
  const auto host = replay_test::to_host(out.data(), steps, s);
  for (int pos = 0; pos < steps; ++pos) CHECK(host[pos] == doctest::Approx((100 + pos) * 0.5f + pos));
}

TEST_CASE("in-graph metadata copy: the graph copies staging itself") {
  replay::stream s;
  constexpr int steps = 16;
  replay::device_buffer<float> out(steps);
  replay_test::poison(out.data(), out.size_bytes(), s);
  replay::step_meta<meta_t> meta;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    meta.capture_copy(cs);
    write_step<<<1, 32, 0, cs.get()>>>(meta.device(), out.data());
    REPLAY_CHECK_LAUNCH("write_step");
  });
  CHECK(g.node_count() == 3);  // the copy, its guard (an event-record node), the kernel
  CHECK(g.kernel_node_count() == 1);
  replay::graph_exec exec = g.instantiate();
  for (int pos = 0; pos < steps; ++pos) {
    meta.graph_staging() = meta_t{pos * 3, pos, 2.0f};  // waits until the last launch copied it
    exec.launch(s);
  }
  const auto host = replay_test::to_host(out.data(), steps, s);
  for (int pos = 0; pos < steps; ++pos) CHECK(host[pos] == doctest::Approx(pos * 6.0f + pos));
}

TEST_CASE("step_meta_array pushes a batch and partial pushes") {
  replay::stream s;
  replay::step_meta_array<int> rows(8);
  for (int round = 0; round < 4; ++round) {
    auto st = rows.staging();
    for (int i = 0; i < 8; ++i) st[i] = round * 10 + i;
    rows.push(s);
  }
  auto host = replay_test::to_host(rows.device(), 8, s);
  for (int i = 0; i < 8; ++i) CHECK(host[i] == 30 + i);
  auto st = rows.staging();
  for (int i = 0; i < 8; ++i) st[i] = -1;
  rows.push(s, 3);  // only the first three rows
  host = replay_test::to_host(rows.device(), 8, s);
  CHECK(host[0] == -1);
  CHECK(host[2] == -1);
  CHECK(host[3] == 33);
  CHECK_THROWS_AS(rows.push(s, 9), replay::usage_error);
}

TEST_CASE("an exception inside capture discards it and leaves the stream usable") {
  replay::stream s;
  replay::device_buffer<float> x(256);
  REPLAY_CHECK(cudaMemsetAsync(x.data(), 0, x.size_bytes(), s.get()));
  struct boom {};
  CHECK_THROWS_AS(
      (void)replay::capture(s, [&](replay::stream_ref cs) {
        add_value<<<1, 256, 0, cs.get()>>>(x.data(), 256, 1.0f);
        REPLAY_CHECK_LAUNCH("add_value");
        throw boom{};
      }),
      boom);
  CHECK_FALSE(s.is_capturing());
  CHECK(replay::detail::current_capture_state() == replay::capture_state::none);
  // The captured (discarded) kernel never ran; eager work on the same stream runs normally.
  add_value<<<1, 256, 0, s.get()>>>(x.data(), 256, 2.0f);
  REPLAY_CHECK_LAUNCH("add_value");
  const auto host = replay_test::to_host(x.data(), 256, s);
  CHECK(host[0] == 2.0f);
  CHECK(host[255] == 2.0f);
}

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("cudaMalloc inside capture: cuda_error names the API and the capture, stream recovers") {
  replay::stream s;
  bool threw = false;
  try {
    replay::capture_scope scope(s);
    void* p = nullptr;
    REPLAY_CHECK(cudaMalloc(&p, 1024));
    (void)scope.finish();
  } catch (const replay::cuda_error& e) {
    threw = true;
    const std::string msg = e.what();
    MESSAGE(msg);
    CHECK(e.api() == "cudaMalloc");
    CHECK(e.during_capture());
    CHECK(contains(msg, "cudaMalloc failed"));
    CHECK(contains(msg, "capturing"));
    CHECK(contains(msg, "allocate every buffer before capture"));
  }
  CHECK(threw);
  CHECK_FALSE(s.is_capturing());
  replay::device_buffer<float> y(64);  // allocation works again
  add_value<<<1, 64, 0, s.get()>>>(y.data(), 64, 1.0f);
  REPLAY_CHECK_LAUNCH("add_value");
  s.synchronize();
}
}  // TEST_SUITE

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("device_buffer allocation inside a capture is reported the same way") {
  replay::stream s;
  replay::capture_scope scope(s);
  CHECK_THROWS_WITH_AS(replay::device_buffer<float>(16), doctest::Contains("capturing"), replay::cuda_error);
  scope.discard();
  CHECK_FALSE(s.is_capturing());
}
}  // TEST_SUITE

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("cudaStreamSynchronize inside capture: cuda_error with a hint, stream recovers") {
  replay::stream s;
  replay::device_buffer<float> x(32);
  try {
    replay::capture_scope scope(s);
    add_value<<<1, 32, 0, s.get()>>>(x.data(), 32, 1.0f);
    REPLAY_CHECK_LAUNCH("add_value");
    s.synchronize();  // capture-unsafe
    FAIL("synchronize inside capture did not throw");
  } catch (const replay::cuda_error& e) {
    const std::string msg = e.what();
    MESSAGE(msg);
    CHECK(e.api() == "cudaStreamSynchronize");
    CHECK(e.during_capture());
    CHECK(contains(msg, "must not synchronise"));
  }
  CHECK_FALSE(s.is_capturing());
  REPLAY_CHECK(cudaMemsetAsync(x.data(), 0, x.size_bytes(), s.get()));
  s.synchronize();
}
}  // TEST_SUITE

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("a launch on the legacy default stream during capture is reported") {
  replay::stream s;  // non-blocking: legacy-stream work would not join it implicitly
  replay::stream blocking(replay::stream_flags::blocking);
  replay::device_buffer<int> p(1);
  try {
    replay::capture_scope scope(blocking);
    legacy_probe<<<1, 1>>>(p.data());  // stream 0 while a blocking stream captures
    REPLAY_CHECK_LAUNCH("legacy_probe");
    (void)scope.finish();
    FAIL("legacy launch during capture did not fail");
  } catch (const replay::cuda_error& e) {
    MESSAGE(e.what());
    CHECK(e.during_capture());
    CHECK(contains(e.what(), "capturing"));
  }
  CHECK_FALSE(blocking.is_capturing());
  blocking.synchronize();
  s.synchronize();
}
}  // TEST_SUITE

TEST_CASE("finish() twice and capturing stream 0 are usage errors") {
  replay::stream s;
  replay::capture_scope scope(s);
  replay::graph g = scope.finish();
  CHECK(g.node_count() == 0);
  CHECK_THROWS_WITH_AS((void)scope.finish(), doctest::Contains("already finished"), replay::usage_error);
  CHECK_THROWS_AS(replay::capture_scope(replay::stream_ref::legacy()), replay::usage_error);
}

TEST_CASE("fork/join side streams; an unjoined stream is named") {
  replay::stream s;
  replay::stream side;
  replay::device_buffer<float> a(64);
  replay::device_buffer<float> b(64);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 0, a.size_bytes(), s.get()));
  REPLAY_CHECK(cudaMemsetAsync(b.data(), 0, b.size_bytes(), s.get()));
  s.synchronize();
  replay::graph g;
  {
    replay::capture_scope scope(s);
    scope.fork(side);
    add_value<<<1, 64, 0, s.get()>>>(a.data(), 64, 1.0f);
    add_value<<<1, 64, 0, side.get()>>>(b.data(), 64, 2.0f);
    scope.join(side);
    g = scope.finish();
  }
  CHECK(g.kernel_node_count() == 2);
  auto exec = g.instantiate();
  exec.launch(s);
  exec.launch(s);
  CHECK(replay_test::to_host(a.data(), 64, s)[10] == 2.0f);
  CHECK(replay_test::to_host(b.data(), 64, s)[10] == 4.0f);

  replay::capture_scope scope(s);
  scope.fork(side);
  add_value<<<1, 64, 0, side.get()>>>(b.data(), 64, 2.0f);
  CHECK_THROWS_WITH_AS((void)scope.finish(), doctest::Contains("not joined"), replay::usage_error);
  CHECK_FALSE(s.is_capturing());
  CHECK_FALSE(side.is_capturing());
}

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("graph_exec::update: parameter change updates, topology change is reported") {
  replay::stream s;
  replay::device_buffer<float> x(128);
  REPLAY_CHECK(cudaMemsetAsync(x.data(), 0, x.size_bytes(), s.get()));
  auto step = [&](float v, int kernels) {
    return replay::capture(s, [&](replay::stream_ref cs) {
      for (int k = 0; k < kernels; ++k) {
        add_value<<<1, 128, 0, cs.get()>>>(x.data(), 128, v);
        REPLAY_CHECK_LAUNCH("add_value");
      }
    });
  };
  replay::graph_exec exec = step(1.0f, 2).instantiate();
  exec.launch(s);  // x = 2
  const auto same_topology = exec.update(step(10.0f, 2));
  CHECK(same_topology.updated);
  CHECK_FALSE(same_topology.reinstantiated);
  exec.launch(s);  // x = 22
  CHECK(replay_test::to_host(x.data(), 128, s)[5] == 22.0f);

  const auto changed = exec.update(step(100.0f, 3));
  CHECK_FALSE(changed);
  CHECK(changed.reinstantiated);
  CHECK(changed.reason == cudaGraphExecUpdateErrorTopologyChanged);
  MESSAGE(changed.message);
  CHECK(contains(changed.message, "topology changed"));
  exec.launch(s);  // re-instantiated exec runs the new graph: x = 322
  CHECK(replay_test::to_host(x.data(), 128, s)[5] == 322.0f);
}
}  // TEST_SUITE

TEST_CASE("arena addresses stay fixed across replays and allocation after freeze throws") {
  replay::stream s;
  replay::static_arena arena(1 << 16);
  auto a = arena.allocate<float>(100);
  auto b = arena.allocate<float>(100);
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 256 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 256 == 0);
  CHECK(b.data() == reinterpret_cast<float*>(arena.base() + 512));
  arena.freeze();
  CHECK_THROWS_AS((void)arena.allocate<float>(1), replay::usage_error);
  CHECK_THROWS_AS((void)replay::static_arena(1024).allocate<float>(1024), replay::usage_error);
  std::byte* const base = arena.base();

  replay_test::poison(a.data(), a.size_bytes(), s);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 0, a.size_bytes(), s.get()));
  auto exec = replay::capture(s, [&](replay::stream_ref cs) {
                add_value<<<1, 100, 0, cs.get()>>>(a.data(), 100, 1.0f);
              }).instantiate();
  replay::static_arena moved = std::move(arena);  // moving the owner does not move the memory
  CHECK(moved.base() == base);
  CHECK(arena.capacity() == 0);
  for (int i = 0; i < 5; ++i) exec.launch(s);
  CHECK(replay_test::to_host(a.data(), 100, s)[99] == 5.0f);
}

TEST_CASE("moved-from handles throw usage_error on use") {
  replay::stream s;
  replay::graph_exec empty;
  CHECK_THROWS_WITH_AS(empty.launch(s), doctest::Contains("empty"), replay::usage_error);

  auto exec = replay::capture(s, [&](replay::stream_ref) {}).instantiate();
  replay::graph_exec other = std::move(exec);
  CHECK_THROWS_AS(exec.launch(s), replay::usage_error);  // NOLINT(bugprone-use-after-move)
  CHECK_THROWS_AS(exec.upload(s), replay::usage_error);
  CHECK_NOTHROW(other.launch(s));

  replay::graph g = replay::capture(s, [&](replay::stream_ref) {});
  replay::graph g2 = std::move(g);
  CHECK_THROWS_AS((void)g.node_count(), replay::usage_error);
  CHECK_THROWS_AS((void)g.instantiate(), replay::usage_error);
  CHECK_THROWS_AS((void)other.update(g), replay::usage_error);

  replay::step_meta<meta_t> meta;
  replay::step_meta<meta_t> meta2 = std::move(meta);
  CHECK_THROWS_WITH_AS(meta.push(s), doctest::Contains("moved-from"), replay::usage_error);
  CHECK_THROWS_AS((void)meta.device(), replay::usage_error);
  CHECK_NOTHROW(meta2.push(s));

  replay::stream s2 = std::move(s);
  CHECK_THROWS_AS(s.synchronize(), replay::usage_error);
  s2.synchronize();
}
