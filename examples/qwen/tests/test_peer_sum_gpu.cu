// The tensor-parallel one-shot sum (launch_peer_sum, allreduce.cu) with its "ranks" on one GPU:
// each rank has its own products, flags, call counts, residual and stream, and the ranks' launches
// run concurrently on their streams, as they would on their own GPUs. Sums of exact small integers
// are checked exactly, on every rank, over calls that alternate the two slots and change the row
// count, eagerly and as one captured graph per rank. A rank that never arrives would trap after
// the test's timeout.
#include <doctest/doctest.h>

#include "gpu_test.hpp"
#include "qwen/kernels.cuh"

#include <replay/buffer.hpp>
#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/graph_exec.hpp>
#include <replay/stream.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

using namespace qwen;

namespace {

constexpr std::size_t kHidden = 1024;
constexpr int kMaxRows = 8;
constexpr std::size_t kStride = kMaxRows * kHidden;

/// rank r's product at call c, element i: small integers, so every sum is exact in fp32.
float product_value(int r, int c, std::size_t i) { return static_cast<float>((r + 1) * (c % 7 + 1) + int(i % 5)); }
float residual_init(std::size_t i) { return static_cast<float>(int(i % 11) - 5); }

struct Group {
  int size;
  std::vector<replay::device_buffer<float>> product, residual;  // product: [2 slots][kStride]
  std::vector<replay::device_buffer<unsigned>> flags, calls;
  std::vector<replay::stream> streams;
  std::vector<PeerSum> sums;

  explicit Group(int n) : size(n) {
    for (int r = 0; r < n; ++r) {
      product.emplace_back(2 * kStride);
      residual.emplace_back(kStride);
      flags.emplace_back(std::size_t(kMaxPeers) * kPeerSumBlocks);
      calls.emplace_back(kPeerSumBlocks);
      streams.emplace_back();
      REPLAY_CHECK(cudaMemset(flags.back().data(), 0, flags.back().size_bytes()));
      REPLAY_CHECK(cudaMemset(calls.back().data(), 0, calls.back().size_bytes()));
      std::vector<float> init(kStride);
      for (std::size_t i = 0; i < kStride; ++i) init[i] = residual_init(i);
      REPLAY_CHECK(cudaMemcpy(residual.back().data(), init.data(), kStride * sizeof(float), cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < n; ++r) {
      PeerSum p;
      for (int q = 0; q < n; ++q) {
        p.in[q][0] = product[static_cast<std::size_t>(q)].data();
        p.in[q][1] = product[static_cast<std::size_t>(q)].data() + kStride;
        p.flags[q] = flags[static_cast<std::size_t>(q)].data();
      }
      p.calls = calls[static_cast<std::size_t>(r)].data();
      p.rank = r, p.size = n;
      p.timeout_ns = 20'000'000'000ull;
      sums.push_back(p);
    }
    REPLAY_CHECK(cudaDeviceSynchronize());
  }
};

/// The rows of each call: both slots, growing and shrinking grids.
const std::vector<int> kRows = {1, 8, 3, 8, 1, 1, 5, 8, 2, 7};
std::size_t rows_of(int c) { return std::size_t(kRows[static_cast<std::size_t>(c) % kRows.size()]); }

/// Rank r's sums for calls c0..c0+count-1 on s: copy its product of call c (from `src`, pinned,
/// [count][kStride] from c0) into the call's slot, then sum.
void issue(Group& g, int r, int c0, int count, const float* src, replay::stream_ref s) {
  const auto ri = static_cast<std::size_t>(r);
  for (int c = c0; c < c0 + count; ++c) {
    const int slot = c % 2;
    const std::size_t n = rows_of(c) * kHidden;
    REPLAY_CHECK(cudaMemcpyAsync(g.product[ri].data() + slot * kStride, src + std::size_t(c - c0) * kStride,
                                 n * sizeof(float), cudaMemcpyHostToDevice, s.get()));
    launch_peer_sum(g.sums[ri], slot, n, g.residual[ri].data(), s);
  }
}

/// Rank r's products of calls c0..c0+count-1 into dst ([count][kStride]).
void fill(float* dst, int r, int c0, int count) {
  for (int c = c0; c < c0 + count; ++c)
    for (std::size_t i = 0; i < kStride; ++i) dst[std::size_t(c - c0) * kStride + i] = product_value(r, c, i);
}

/// Checks every rank's residual after calls 0..calls-1.
void check(Group& g, int calls) {
  std::vector<float> want(kStride);
  for (std::size_t i = 0; i < kStride; ++i) {
    double v = residual_init(i);
    for (int c = 0; c < calls; ++c)
      if (i < rows_of(c) * kHidden)
        for (int r = 0; r < g.size; ++r) v += product_value(r, c, i);
    want[i] = static_cast<float>(v);
  }
  for (int r = 0; r < g.size; ++r) {
    std::vector<float> got(kStride);
    REPLAY_CHECK(cudaMemcpy(got.data(), g.residual[std::size_t(r)].data(), kStride * sizeof(float), cudaMemcpyDeviceToHost));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < kStride; ++i) wrong += got[i] != want[i];
    CAPTURE(r);
    CHECK(wrong == 0);
  }
}

}  // namespace

TEST_CASE("one-shot sum: 2 and 3 ranks on one GPU, exact, eager then from captured graphs") {
  constexpr int kEager = 25, kGraphCalls = 10, kReplays = 3;
  static_assert(kGraphCalls % 2 == 0);  // a replay's calls have the slots and rows of calls kEager..
  REQUIRE(kGraphCalls % static_cast<int>(kRows.size()) == 0);
  for (int size : {2, 3}) {
    CAPTURE(size);
    Group g(size);
    // Eager: all of rank 0's launches first; its kernels wait on the GPU for the other ranks'.
    std::vector<replay::pinned_buffer<float>> src;
    for (int r = 0; r < size; ++r) {
      src.emplace_back(std::size_t(kEager) * kStride);
      fill(src.back().data(), r, 0, kEager);
    }
    for (int r = 0; r < size; ++r) issue(g, r, 0, kEager, src[std::size_t(r)].data(), g.streams[std::size_t(r)]);
    for (auto& s : g.streams) s.synchronize();
    check(g, kEager);
    // One graph per rank of the calls kEager..kEager+kGraphCalls-1, its products copied from a
    // pinned stage that each replay refills with the next calls' values.
    std::vector<replay::pinned_buffer<float>> stage;
    std::vector<replay::graph_exec> execs;
    for (int r = 0; r < size; ++r) {
      stage.emplace_back(std::size_t(kGraphCalls) * kStride);
      const replay::stream_ref s = g.streams[std::size_t(r)];
      execs.push_back(replay::capture(s, [&](replay::stream_ref cs) {
                        issue(g, r, kEager, kGraphCalls, stage.back().data(), cs);
                      }).instantiate());
    }
    for (int rep = 0; rep < kReplays; ++rep) {
      for (auto& s : g.streams) s.synchronize();
      for (int r = 0; r < size; ++r) fill(stage[std::size_t(r)].data(), r, kEager + rep * kGraphCalls, kGraphCalls);
      for (int r = 0; r < size; ++r) execs[std::size_t(r)].launch(g.streams[std::size_t(r)]);
    }
    for (auto& s : g.streams) s.synchronize();
    check(g, kEager + kGraphCalls * kReplays);
  }
}
