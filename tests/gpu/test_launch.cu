// GPU tests of replay::launch and programmatic dependent launch: a chain of dependent kernels gives
// identical results eagerly and captured, with and without PDL; captured PDL launches become
// programmatic edges; launch errors name the kernel; cluster and cooperative launches run.
//
// Tests that provoke CUDA API errors on purpose are in the test suite "expected_cuda_errors".
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include <cooperative_groups.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int block = 256;

// buf[i + 1][j] = f(buf[i][j], neighbours), staged through shared memory. The constant part is
// computed before pdl::wait(); everything read from the predecessor is read after it.
__global__ void chain_step(const float* in, float* out, int n, int i) {
  __shared__ float tile[block + 2];
  const float c = 0.5f + 0.001f * static_cast<float>(i);  // independent of the predecessor
  replay::pdl::wait();
  replay::pdl::launch_dependents();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int t = threadIdx.x + 1;
  tile[t] = j < n ? in[j] : 0.0f;
  if (threadIdx.x == 0) tile[0] = j > 0 ? in[j - 1] : 0.0f;
  if (threadIdx.x == blockDim.x - 1) tile[t + 1] = j + 1 < n ? in[j + 1] : 0.0f;
  __syncthreads();
  if (j < n) out[j] = c * tile[t] + 0.25f * (tile[t - 1] + tile[t + 1]) + 1.0f;
}

__global__ void cluster_probe(int* out) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int>(cluster.block_rank()) + 100 * static_cast<int>(cluster.num_blocks());
}

__global__ void grid_sync_probe(int* out) {
  namespace cg = cooperative_groups;
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int>(blockIdx.x);
  cg::this_grid().sync();
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int sum = 0;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += out[b];
    out[gridDim.x] = sum;
  }
}

__global__ void empty_kernel(int) {}

struct chain {
  int n = 8192;
  int kernels = 64;
  replay::device_buffer<float> a{static_cast<std::size_t>(n) * 65};

  void issue(replay::stream_ref s, bool pdl) const {
    const unsigned grid = static_cast<unsigned>((n + block - 1) / block);
    for (int i = 0; i < kernels; ++i)
      replay::launch(chain_step, {.grid = grid, .block = block, .stream = s, .pdl = pdl},
                     a.data() + static_cast<std::size_t>(i) * n, a.data() + static_cast<std::size_t>(i + 1) * n,
                     n, i);
  }
  void reset(replay::stream_ref s) const {
    replay_test::poison(a.data(), a.size_bytes(), s);
    std::vector<float> init(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) init[static_cast<std::size_t>(j)] = static_cast<float>(j % 97) * 0.01f;
    REPLAY_CHECK(cudaMemcpyAsync(a.data(), init.data(), init.size() * sizeof(float), cudaMemcpyHostToDevice,
                                 s.get()));
    s.synchronize();
  }
  std::vector<float> result(replay::stream_ref s) const {
    return replay_test::to_host(a.data() + static_cast<std::size_t>(kernels) * n, static_cast<std::size_t>(n), s);
  }
};

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("a PDL chain gives identical results eager, eager+PDL, graph and graph+PDL") {
  replay::stream s;
  chain c;
  std::vector<std::vector<float>> results;
  for (const bool pdl : {false, true}) {
    c.reset(s);
    c.issue(s, pdl);
    results.push_back(c.result(s));
  }
  for (const bool pdl : {false, true}) {
    replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { c.issue(cs, pdl); });
    CHECK(g.kernel_node_count() == static_cast<std::size_t>(c.kernels));
    CHECK(g.programmatic_edge_count() == (pdl ? static_cast<std::size_t>(c.kernels - 1) : 0u));
    replay::graph_exec exec = g.instantiate({.upload_stream = s.get()});
    for (int rep = 0; rep < 3; ++rep) {
      c.reset(s);
      exec.launch(s);
      results.push_back(c.result(s));
    }
  }
  const std::vector<float>& ref = results.front();
  CHECK(ref[0] != 0.0f);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &ref[17], sizeof bits);
  CHECK(bits != 0xEFEFEFEFu);  // the poison was overwritten
  for (std::size_t k = 1; k < results.size(); ++k) CHECK(same_bits(ref, results[k]));
}

TEST_CASE("thread-block cluster and cooperative launches") {
  replay::stream s;
  replay::device_buffer<int> out(64);
  replay_test::poison(out.data(), out.size_bytes(), s);
  replay::launch(cluster_probe, {.grid = 8, .block = 32, .stream = s, .cluster = {2, 1, 1}}, out.data());
  auto host = replay_test::to_host(out.data(), 8, s);
  for (int b = 0; b < 8; ++b) CHECK(host[static_cast<std::size_t>(b)] == b % 2 + 200);

  replay_test::poison(out.data(), out.size_bytes(), s);
  replay::launch(grid_sync_probe, {.grid = 16, .block = 64, .stream = s, .cooperative = true}, out.data());
  host = replay_test::to_host(out.data(), 17, s);
  CHECK(host[16] == 15 * 16 / 2);
}

TEST_CASE("a PDL launch inside a pool's graph is a programmatic edge") {
  replay::stream s;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    for (int i = 0; i < 4; ++i) replay::launch(empty_kernel, {.stream = cs, .pdl = true}, i);
  });
  CHECK(g.programmatic_edge_count() == 3);
  CHECK(g.edges().size() == 3);
}

TEST_CASE("a failed launch names the kernel and the configuration" * doctest::test_suite("expected_cuda_errors")) {
  replay::stream s;
  bool threw = false;
  try {
    replay::launch(empty_kernel, {.grid = 1, .block = 4096, .stream = s}, 1);  // too many threads
  } catch (const replay::cuda_error& e) {
    threw = true;
    const std::string what = e.what();
    CHECK(e.api().find("empty_kernel") != std::string::npos);
    CHECK(what.find("block (4096,1,1)") != std::string::npos);
    CHECK(what.find("test_launch.cu") != std::string::npos);  // the caller's location
  }
  CHECK(threw);
  CHECK(cudaGetLastError() == cudaSuccess);
  s.synchronize();
}
