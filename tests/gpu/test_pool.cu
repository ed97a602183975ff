// GPU tests of graph_pool over a real step (pool_toy_model.cuh): bucketed replay matches eager for
// the real rows, LRU eviction under a capacity, eviction while a replay is still running, prewarm
// with a workspace shared across buckets, per-key capture time and memory.
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include "pool_toy_model.cuh"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <vector>

using pool_toy::model;

namespace {

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}

// Spins for about `cycles` clock cycles, then writes `value` to *out: a replay that is still
// running when the host evicts its graph.
__global__ void spin_then_write(long long cycles, float* out, float value) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (threadIdx.x == 0) *out = value;
}

__global__ void scale_into(const float* in, float* out, float factor) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[i] * factor;
}

}  // namespace

TEST_CASE("bucketed pool over batch sizes 1..64 matches eager for the real rows") {
  for (const auto& policy : {replay::bucket_policy::powers_of_two(64), replay::bucket_policy::every(8, 64)}) {
    CAPTURE(policy.describe());
    replay::stream s;
    model m(64);
    replay::graph_pool<replay::graph_key> pool({.warmup = 1});
    auto step = [&](replay::stream_ref cs, const replay::graph_key& k) { m.step(cs, k.bucket); };

    std::uint64_t padded = 0;
    int bit_mismatch = 0, formula_mismatch = 0, sum_mismatch = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t n = 1; n <= 64; ++n) {
        const int t = static_cast<int>(n) + 100 * pass;
        const std::size_t b = *policy.pad(n);
        // Eager reference: exactly n rows.
        m.poison(s);
        m.stage(n, n, t, s);
        m.step(s, n);
        const auto ref_out = m.out_rows(n, s);
        const auto ref_sums = m.sum_rows(n, s);
        // Graph: padded to the bucket.
        m.poison(s);
        m.stage(n, b, t, s);
        const auto path = pool.run(key_for(b), s, step, {.real = n, .bucket = b});
        CHECK((path == replay::step_path::captured || path == replay::step_path::replayed));
        const auto out = m.out_rows(n, s);
        const auto sums = m.sum_rows(n, s);
        bit_mismatch += pool_toy::same_bits(out, ref_out) ? 0 : 1;
        sum_mismatch += pool_toy::same_bits(sums, ref_sums) ? 0 : 1;
        formula_mismatch += pool_toy::mismatches(out, n, t);
        padded += b;
      }
    }
    CHECK(bit_mismatch == 0);
    CHECK(sum_mismatch == 0);
    CHECK(formula_mismatch == 0);
    const auto st = pool.stats();
    CHECK(st.captures == policy.count());  // one capture per bucket, ever
    CHECK(st.misses == policy.count());
    CHECK(st.hits == 128 - policy.count());
    CHECK(st.evictions == 0);
    CHECK(st.real_rows == 2 * 2080);
    CHECK(st.padded_rows == padded);
    CHECK(st.capture_failures == 0);
    for (const auto& k : st.keys) {
      CHECK(k.last_capture.nodes == 4);
      CHECK(k.last_capture.memory_measured);
      CHECK(k.last_capture.capture_ms > 0.0);
    }
    MESSAGE(fmt::format("{}", st));
  }
}

TEST_CASE("LRU capacity 4 over 10 keys: evicts in LRU order and still computes correctly") {
  replay::stream s;
  model m(16);
  replay::graph_pool<replay::graph_key> pool({.capacity = 4});
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) { m.step(cs, k.bucket); };

  // A reference LRU over bucket numbers, most recent first.
  std::list<std::size_t> lru;
  std::vector<std::size_t> expected_evictions;
  const std::vector<std::size_t> sequence{1, 2, 3, 4, 1, 5, 6, 1, 7, 8, 9, 10, 2, 1, 3, 10, 10, 4, 5, 6,
                                          7, 8, 9, 1, 2, 9, 8, 3, 4, 5};
  int bad = 0;
  std::uint64_t hits = 0;
  for (std::size_t i = 0; i < sequence.size(); ++i) {
    const std::size_t b = sequence[i];
    const int t = static_cast<int>(i);
    const auto it = std::find(lru.begin(), lru.end(), b);
    if (it != lru.end()) {
      lru.erase(it);
      ++hits;
    } else if (lru.size() == 4) {
      expected_evictions.push_back(lru.back());
      lru.pop_back();
    }
    lru.push_front(b);

    m.poison(s);
    m.stage(b, b, t, s);
    pool.run(key_for(b), s, step, {.real = b, .bucket = b});
    bad += pool_toy::mismatches(m.out_rows(b, s), b, t);

    std::vector<replay::graph_key> want;
    for (std::size_t k : lru) want.push_back(key_for(k));
    CHECK(pool.lru_order() == want);
    CHECK(pool.size() <= 4);
  }
  CHECK(bad == 0);
  const auto st = pool.stats();
  CHECK(st.hits == hits);
  CHECK(st.evictions == expected_evictions.size());
  // Per-key eviction counts agree with the reference.
  for (const auto& k : st.keys) {
    const auto bucket = static_cast<std::size_t>(std::stoul(k.key.substr(k.key.find(' ') + 1)));
    CHECK(k.evictions ==
          static_cast<std::uint64_t>(std::count(expected_evictions.begin(), expected_evictions.end(), bucket)));
  }
  s.synchronize();
  pool.collect();
  CHECK(pool.stats().retired_pending == 0);
  MESSAGE(fmt::format("{}", st));
}

TEST_CASE("evicting a graph whose replay is still running is deferred and safe") {
  replay::stream s;
  replay::device_buffer<float> out(2);
  replay_test::poison(out.data(), out.size_bytes(), s);
  int clock_khz = 0;
  REPLAY_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const long long cycles = static_cast<long long>(clock_khz) * 200;  // ~200 ms
  replay::graph_pool<int> pool({.capacity = 1, .warmup = 0});
  auto slow = [&](replay::stream_ref cs, int key) {
    spin_then_write<<<1, 32, 0, cs.get()>>>(key == 0 ? cycles : 1, out.data() + key, 10.0f + key);
    REPLAY_CHECK_LAUNCH("spin_then_write");
  };
  pool.run(0, s, slow);  // ~200 ms replay in flight
  pool.run(1, s, slow);  // evicts 0 while it runs
  CHECK_FALSE(pool.contains(0));
  CHECK(pool.stats().retired_pending == 1);  // not destroyed: its replay has not finished
  s.synchronize();
  pool.collect();
  CHECK(pool.stats().retired_pending == 0);
  const auto host = replay_test::to_host(out.data(), 2, s);
  CHECK(host[0] == 10.0f);
  CHECK(host[1] == 11.0f);
  // Destroying a pool with a replay in flight is safe too (the backend waits for retired graphs).
  {
    replay::graph_pool<int> p2({.warmup = 0});
    p2.run(0, s, slow);
  }
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("prewarm largest first: a workspace grown on first use is allocated once, for the largest bucket") {
  replay::stream s;
  model m(64);
  struct lazy_workspace {
    replay::device_buffer<float> buf;
    int allocations = 0;
    float* get(std::size_t n) {  // grows outside capture only (cudaMalloc is capture-unsafe)
      if (buf.size() < n) {
        buf = replay::device_buffer<float>(n);
        ++allocations;
      }
      return buf.data();
    }
  } ws;
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) {
    float* w = ws.get(k.bucket * pool_toy::width);
    m.step(cs, k.bucket);
    scale_into<<<k.bucket, pool_toy::width, 0, cs.get()>>>(m.out.data(), w, 2.0f);
    REPLAY_CHECK_LAUNCH("scale_into");
    scale_into<<<k.bucket, pool_toy::width, 0, cs.get()>>>(w, m.x.data(), 0.5f);  // x = out again
    REPLAY_CHECK_LAUNCH("scale_into");
  };
  const auto buckets = replay::bucket_policy::powers_of_two(64);
  replay::graph_pool<replay::graph_key> pool({.warmup = 1});
  std::vector<replay::graph_key> keys;
  for (std::size_t b : buckets.sizes()) keys.push_back(key_for(b));  // ascending on purpose
  CHECK(pool.prewarm(keys, s, step) == buckets.count());
  CHECK(ws.allocations == 1);                           // sized once, for bucket 64
  CHECK(ws.buf.size() == 64 * pool_toy::width);
  CHECK(pool.stats().prewarmed == buckets.count());

  int bad = 0;
  for (std::size_t n = 1; n <= 64; n += 5) {
    const std::size_t b = *buckets.pad(n);
    m.poison(s);
    replay_test::poison(m.x.data(), m.x.size_bytes(), s);
    m.stage(n, b, static_cast<int>(n), s);
    CHECK(pool.run(key_for(b), s, step, {.real = n, .bucket = b}) == replay::step_path::replayed);
    const auto x = replay_test::to_host(m.x.data(), n * pool_toy::width, s);  // x == out via workspace
    bad += pool_toy::mismatches(x, n, static_cast<int>(n));
  }
  CHECK(bad == 0);
  CHECK(ws.allocations == 1);
}

TEST_CASE("memory per key: graph allocation nodes show in graph_mem_bytes; stats JSON parses") {
  replay::stream s;
  replay::device_buffer<float> out(1 << 16);
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) {
    // A graph-owned scratch buffer (cudaMallocAsync inside the capture): graph memory.
    float* scratch = nullptr;
    const std::size_t n = static_cast<std::size_t>(k.bucket) * 4096;
    REPLAY_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), n * sizeof(float), cs.get()));
    scale_into<<<static_cast<unsigned>(n / 256), 256, 0, cs.get()>>>(out.data(), scratch, 1.0f);
    REPLAY_CHECK_LAUNCH("scale_into");
    scale_into<<<static_cast<unsigned>(n / 256), 256, 0, cs.get()>>>(scratch, out.data(), 2.0f);
    REPLAY_CHECK_LAUNCH("scale_into");
    REPLAY_CHECK(cudaFreeAsync(scratch, cs.get()));
  };
  REPLAY_CHECK(cudaMemsetAsync(out.data(), 0, out.size_bytes(), s.get()));
  replay::graph_pool<replay::graph_key> pool({.warmup = 1});
  for (std::size_t b : {16, 8, 4}) pool.run(key_for(b), s, step);
  s.synchronize();
  const auto st = pool.stats();
  MESSAGE(fmt::format("{}", st));
  for (const auto& k : st.keys) {
    CHECK(k.last_capture.memory_measured);
    CHECK(k.last_capture.nodes == 4);  // alloc, 2 kernels, free
    CHECK(k.last_capture.graph_mem_bytes >= 0);
    MESSAGE(fmt::format("{}: device {} B, graph memory {} B, capture {:.3f} ms, instantiate {:.3f} ms",
                        k.key, k.last_capture.device_bytes, k.last_capture.graph_mem_bytes,
                        k.last_capture.capture_ms, k.last_capture.instantiate_ms));
  }
  const auto json = nlohmann::json::parse(st.to_json());
  CHECK(json["keys"].size() == 3);
  CHECK(json["captures"] == 3);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("graph_key fields separate graphs that differ in more than the bucket") {
  replay::stream s;
  model m(8);
  replay::graph_pool<replay::graph_key> pool;
  // fields[0] selects whether the step runs the last kernel twice: a different graph, same bucket.
  auto step = [&](replay::stream_ref cs, const replay::graph_key& k) {
    m.step(cs, k.bucket);
    if (k.fields[0] != 0) m.step(cs, k.bucket);
  };
  pool.run(replay::graph_key{.bucket = 8}, s, step);
  pool.run(replay::graph_key{.bucket = 8, .fields = {1}}, s, step);
  pool.run(replay::graph_key{.bucket = 8}, s, step);
  const auto st = pool.stats();
  CHECK(st.captures == 2);
  CHECK(st.hits == 1);
  REQUIRE(st.keys.size() == 2);
  CHECK(st.keys[0].last_capture.nodes == 4);
  CHECK(st.keys[1].last_capture.nodes == 8);
}

TEST_CASE("a pool belongs to its device: using it while another device is current is refused") {
  replay::stream s;
  replay::device_buffer<float> x(32), y(32);
  int current = -1;
  REPLAY_CHECK(cudaGetDevice(&current));
  // A pool made for another device than the current one behaves as a pool used on the wrong GPU.
  replay::graph_pool<int> foreign({}, replay::cuda_graph_backend(current + 1));
  auto step = [&](replay::stream_ref cs) { scale_into<<<1, 32, 0, cs.get()>>>(x.data(), y.data(), 2.0f); };
  CHECK_THROWS_WITH_AS(foreign.run(1, s, step), doctest::Contains("belongs to device"), replay::usage_error);
  CHECK(foreign.size() == 0);
  CHECK_FALSE(s.is_capturing());
  replay::step_runner<int> runner([&](replay::stream_ref cs, const int&) { step(cs); }, {},
                                  replay::cuda_graph_backend(current + 1));
  CHECK_THROWS_AS(runner.run(1, s), replay::usage_error);  // misuse, not a fallback
  replay::graph_pool<int> own;  // made on the current device
  CHECK(own.backend().device() == current);
  CHECK(own.run(1, s, step) == replay::step_path::captured);
  s.synchronize();
}
