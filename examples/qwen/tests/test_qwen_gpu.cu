// GPU tests of the Qwen example: eager and graph decode give identical tokens and logits; the batch-1
// GEMV agrees with a host reference; the fused GEMV (CUDA-core and tensor-core, its ring refilled)
// agrees with cuBLAS; paged KV keeps sequences apart across buckets; decode agrees with prefill, also
// with split-KV at long context; every supported head shape (head_dim 64 and 128, 1..8 query heads
// per kv head) runs; the device loop (decode_loop) gives the per-step graph path's tokens for any
// tokens per launch, stops on a stop token inside a launch and at the end of the context; bad input
// is rejected before any launch.
#include <doctest/doctest.h>

#include "gpu_test.hpp"
#include "qwen/kernels.cuh"
#include "qwen/model.hpp"
#include "qwen/sample.cuh"

#include <common/device.hpp>
#include <common/rng.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace qwen;

namespace {

EngineOptions small_opts(int gemv_max_rows = 16) {
  EngineOptions o;
  o.max_batch = 16;
  o.max_bucket = 16;
  o.kv_budget_bytes = 64ull << 20;
  o.max_context = 512;
  o.prefill_chunk = 32;
  o.gemv_max_rows = gemv_max_rows;
  return o;
}

Config tiny_shape(const char* name, int vocab, int hidden, int inter, int layers, int heads, int kv_heads,
                  int head_dim) {
  Config c = preset("tiny");
  c.name = name;
  c.vocab_size = vocab, c.hidden_size = hidden, c.intermediate_size = inter, c.num_hidden_layers = layers;
  c.num_attention_heads = heads, c.num_key_value_heads = kv_heads, c.head_dim = head_dim;
  c.validate();
  return c;
}

/// head_dim 128 and 4 query heads per kv head (as Qwen3-4B).
Config tiny_hd128_g4() { return tiny_shape("tiny_hd128_g4", 4096, 512, 1024, 3, 8, 2, 128); }
/// 5 query heads per kv head (as Qwen3-14B: 40 over 8), head_dim 128.
Config tiny_g5() { return tiny_shape("tiny_g5", 4096, 640, 1280, 2, 10, 2, 128); }
/// 3 query heads per kv head, head_dim 64; hidden 2304 (a row spans several ring pieces).
Config tiny_g3() { return tiny_shape("tiny_g3", 2048, 2304, 1280, 2, 6, 2, 64); }

std::vector<Config> shapes() { return {preset("tiny"), tiny_hd128_g4(), tiny_g5(), tiny_g3()}; }
/// 8 kv heads with 2 query heads each, head_dim 128 (as Qwen3-0.6B): at 64 rows attention has more
/// blocks than one wave of 8 warps, so it runs 4-warp blocks.
Config tiny_kv8() { return tiny_shape("tiny_kv8", 2048, 256, 512, 2, 16, 8, 128); }
/// 64 kv heads of head_dim 64: past one wave of 8-warp attention blocks from 16 rows (the fused GEMV's
/// largest bucket), so the 4-warp path runs without cuBLAS in the decode step.
Config tiny_kv64() { return tiny_shape("tiny_kv64", 2048, 256, 512, 2, 64, 64, 64); }

/// Runs `seqs` (all joining at once) greedily for `steps` decode steps; returns tokens per sequence
/// and the logits of every step (poisoned with NaN first: every value must be written).
std::vector<std::vector<int>> generate(Engine& e, const std::vector<std::vector<int>>& prompts, int steps, bool graph,
                                       std::vector<float>* all_logits = nullptr) {
  auto& book = e.kv();
  const int n = static_cast<int>(prompts.size());
  const int V = e.config().vocab_size;
  std::vector<int> slot(n), pos(n), next(n);
  std::vector<std::vector<int>> out(n);
  for (int i = 0; i < n; ++i) {
    slot[i] = book.acquire_slot();
    book.ensure(slot[i], static_cast<int>(prompts[i].size()) + steps);
    next[i] = e.prefill(slot[i], prompts[i], 0);
    pos[i] = static_cast<int>(prompts[i].size());
    out[i].push_back(next[i]);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<DecodeRow> rows;
    for (int i = 0; i < n; ++i) rows.push_back({slot[i], next[i], pos[i]});
    std::vector<float> logits(std::size_t(n) * V, std::numeric_limits<float>::quiet_NaN());
    e.decode(rows, graph, next, logits);
    for (float v : logits) REQUIRE(std::isfinite(v));
    if (all_logits) all_logits->insert(all_logits->end(), logits.begin(), logits.end());
    for (int i = 0; i < n; ++i) out[i].push_back(next[i]), ++pos[i];
  }
  for (int i = 0; i < n; ++i) book.release(slot[i]);
  return out;
}

std::vector<int> prompt_of(int len, int salt, int vocab) {
  std::vector<int> p(len);
  for (int i = 0; i < len; ++i) p[i] = (i * 131 + salt * 977 + 7) % vocab;
  return p;
}
/// n prompts: prompt i has len0 + dlen * i tokens and salt salt0 + i.
std::vector<std::vector<int>> prompts_of(int n, int len0, int dlen, int salt0, int vocab) {
  std::vector<std::vector<int>> v;
  for (int i = 0; i < n; ++i) v.push_back(prompt_of(len0 + dlen * i, salt0 + i, vocab));
  return v;
}

/// How many of the logits differ bit for bit (a count, so that a failure says how many).
std::size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t k = 0; k < a.size(); ++k) n += a[k] != b[k] ? 1 : 0;
  return n;
}
/// Decodes `prompts` for 12 steps eagerly, then from graphs: the same tokens and bit-identical logits.
/// Returns the graph run's tokens.
std::vector<std::vector<int>> check_eager_is_graph(Engine& e, const std::vector<std::vector<int>>& prompts) {
  std::vector<float> le, lg;
  const auto eager = generate(e, prompts, 12, false, &le);
  const auto graph = generate(e, prompts, 12, true, &lg);
  CHECK(eager == graph);
  CHECK(differing(le, lg) == 0);
  return graph;
}

/// Relative L2 distance of got[0, n) from want[0, n).
double rel_l2(const float* got, const float* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const double d = double(got[k]) - want[k];
    num += d * d, den += double(want[k]) * want[k];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("eager and graph decode give identical tokens and logits (fused GEMV and cuBLAS buckets)") {
  for (const Config& cfg : shapes())
    for (int gemv_rows : {16, 4}) {  // buckets 8 and 16 on the tensor-core GEMV, then on cuBLAS
      CAPTURE(cfg.name);
      CAPTURE(gemv_rows);
      Engine e(cfg, small_opts(gemv_rows), nullptr);
      MESSAGE(e.describe_kernels());
      const int V = e.config().vocab_size;
      for (int batch : {1, 3, 6, 11}) {  // buckets 1, 4 (a padded row), 8 and 16
        CAPTURE(batch);
        (void)check_eager_is_graph(e, prompts_of(batch, 5, 3, 0, V));
      }
      const auto st = e.graph_stats();
      CHECK(st.captures == 4);
      CHECK(st.replays == 48);
      // embed + 5 launches per layer + lm_head on the fused GEMV path, at every bucket it serves.
      CHECK(st.nodes_per_bucket.at(1) == 2 + 5 * cfg.num_hidden_layers);
      if (gemv_rows == 16) {
        CHECK(st.nodes_per_bucket.at(8) == 2 + 5 * cfg.num_hidden_layers);
      } else {
        CHECK(st.nodes_per_bucket.at(8) > 2 + 5 * cfg.num_hidden_layers);
      }
    }
}

/// One batch-1 GEMV (`mode`, N x K) on the kernel plan_gemv picks, against a host reference in double
/// over the same bf16 inputs: every output written, within fp32 rounding of the reference, and the
/// same bits when run again.
static void check_batch1_gemv(gemv_out mode, int N, int K, GemvPlan::kernel want) {
  CAPTURE(static_cast<int>(mode));
  CAPTURE(N);
  CAPTURE(K);
  replay::stream s;
  init_gemv_attributes();
  const int R = mode == gemv_out::silu_mul ? 2 : 1;
  const bool norm = mode != gemv_out::add_f32;
  const std::uint64_t seed = (std::uint64_t(N) << 20) ^ std::uint64_t(K);
  std::uint64_t counter = 0;
  auto uniform = [&] { return 2.f * replay_examples::uniform01(seed, counter++) - 1.f; };  // in [-1, 1)
  std::vector<bf16> w(std::size_t(R) * N * K), g(K), xb(K);
  std::vector<float> xf(K), y0(N);
  for (auto& v : w) v = __float2bfloat16(uniform());
  for (auto& v : g) v = __float2bfloat16(1.f + 0.5f * uniform());
  for (int k = 0; k < K; ++k) xf[k] = 3.f * uniform(), xb[k] = __float2bfloat16(uniform());
  for (auto& v : y0) v = uniform();

  // The reference: x as the kernels stage it (bf16 of x times the norm weight), dot products in
  // double, times the fp32 RMS scale.
  std::vector<double> x(K);
  double rs = 1.0;
  if (norm) {
    float ss = 0.f;
    for (float v : xf) ss += v * v;
    rs = 1.f / std::sqrt(ss / K + 1e-6f);
    for (int k = 0; k < K; ++k) x[k] = __bfloat162float(__float2bfloat16(xf[k] * __bfloat162float(g[k])));
  } else {
    for (int k = 0; k < K; ++k) x[k] = __bfloat162float(xb[k]);
  }
  std::vector<double> ref(N);
  for (int n = 0; n < N; ++n) {
    double d[2] = {0, 0};
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < K; ++k) d[r] += double(__bfloat162float(w[(std::size_t(r) * N + n) * K + k])) * x[k];
      d[r] *= rs;
    }
    ref[n] = mode == gemv_out::add_f32    ? y0[n] + d[0]
             : mode == gemv_out::silu_mul ? d[0] / (1.0 + std::exp(-d[0])) * d[1]
                                          : d[0];
  }

  replay::device_buffer<bf16> dw(w.size()), dg(K), dxb(K), dyb(N);
  replay::device_buffer<float> dxf(K), dyf(N);
  replay::device_buffer<unsigned long long> keys(1);
  REPLAY_CHECK(cudaMemcpyAsync(dw.data(), w.data(), w.size() * sizeof(bf16), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(dg.data(), g.data(), K * sizeof(bf16), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(dxb.data(), xb.data(), K * sizeof(bf16), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(dxf.data(), xf.data(), K * sizeof(float), cudaMemcpyHostToDevice, s.get()));
  Linear op;
  op.W = dw.data(), op.N = N, op.K = K, op.mode = mode, op.ldy = N;
  op.in = norm ? GemvIn{.x_f32 = dxf.data(), .norm_w = dg.data()} : GemvIn{.x_bf16 = dxb.data()};
  op.y_f32 = dyf.data(), op.y_bf16 = dyb.data(), op.keys = keys.data();
  const GemvPlan plan = plan_gemv(op, 1, replay_examples::sm_count());
  REQUIRE(plan.kind == want);

  std::vector<double> got[2];
  for (auto& out : got) {
    replay_test::poison(dyb.data(), N * sizeof(bf16), s);
    if (mode == gemv_out::add_f32)
      REPLAY_CHECK(cudaMemcpyAsync(dyf.data(), y0.data(), N * sizeof(float), cudaMemcpyHostToDevice, s.get()));
    else
      replay_test::poison(dyf.data(), N * sizeof(float), s);
    REPLAY_CHECK(cudaMemsetAsync(keys.data(), 0, sizeof(unsigned long long), s.get()));
    launch_gemv(op, 1, plan, s);
    if (mode == gemv_out::silu_mul)
      for (bf16 v : replay_test::to_host(dyb.data(), N, s)) out.push_back(__bfloat162float(v));
    else
      for (float v : replay_test::to_host(dyf.data(), N, s)) out.push_back(v);
    if (mode == gemv_out::argmax) {
      const int idx = key_to_token(replay_test::to_host(keys.data(), 1, s)[0]);
      REQUIRE(idx >= 0);
      REQUIRE(idx < N);
      CHECK(out[idx] == *std::max_element(out.begin(), out.end()));
      CHECK(std::find(out.begin(), out.end(), out[idx]) - out.begin() == idx);  // the lowest index
    }
  }
  CHECK(got[0] == got[1]);
  const double tol = mode == gemv_out::silu_mul ? 1e-2 : 1e-4;  // silu_mul rounds its output to bf16
  double scale = 0;
  for (double v : ref) scale = std::max(scale, std::abs(v));
  int bad = 0;
  for (int n = 0; n < N; ++n) bad += std::abs(got[0][n] - ref[n]) <= tol * scale ? 0 : 1;
  CHECK(bad == 0);
}

TEST_CASE("the batch-1 pipelined GEMV: every epilogue, one and two chunks before the wait, against a host reference") {
  using kind = GemvPlan::kernel;
  // 1500 x 2304: rows of three chunks (the last a quarter full); 2560 x 4096 and x 9728 (4B's O and
  // down) and the others: 16 MiB or more, two chunks loaded before the wait.
  for (gemv_out m : {gemv_out::store_f32, gemv_out::add_f32, gemv_out::silu_mul, gemv_out::argmax})
    check_batch1_gemv(m, 1500, 2304, kind::pipelined);
  check_batch1_gemv(gemv_out::add_f32, 2560, 4096, kind::pipelined_deep);
  check_batch1_gemv(gemv_out::add_f32, 2560, 9728, kind::pipelined_deep);
  check_batch1_gemv(gemv_out::silu_mul, 2560, 2560, kind::pipelined_deep);
  check_batch1_gemv(gemv_out::argmax, 7001, 2560, kind::pipelined_deep);
}

TEST_CASE("the fused GEMV buckets compute what the cuBLAS path computes") {
  for (const Config& cfg : shapes()) {
    CAPTURE(cfg.name);
    Engine fused(cfg, small_opts(16), nullptr);
    Engine gemm(cfg, small_opts(0), nullptr);
    const int V = cfg.vocab_size;
    for (int batch : {1, 2, 4, 5, 8, 16}) {
      CAPTURE(batch);
      const auto prompts = prompts_of(batch, 6, 2, 3, V);
      std::vector<float> lf, lc;
      (void)generate(fused, prompts, 1, true, &lf);
      (void)generate(gemm, prompts, 1, true, &lc);
      const double r = rel_l2(lf.data(), lc.data(), lf.size());
      MESSAGE(cfg.name << " batch " << batch << ": fused GEMV vs cuBLAS relative L2 " << r);
      CHECK(r < 1e-2);
    }
  }
}

TEST_CASE("the tensor-core GEMV's ring wraps: many tiles per block, several pieces per tile") {
  // lm_head of 32768 rows over K = 1280 (pieces of 1024 and 256): 4096 tiles of 8 rows, more items per
  // block than ring slots, so every slot is refilled (the other shapes fit their rings at once).
  const Config cfg = tiny_shape("tiny_vocab32k", 32768, 1280, 1536, 1, 10, 2, 128);
  Engine fused(cfg, small_opts(16), nullptr);
  Engine gemm(cfg, small_opts(0), nullptr);
  for (int batch : {2, 8, 16}) {
    CAPTURE(batch);
    const auto prompts = prompts_of(batch, 4, 1, 5, cfg.vocab_size);
    std::vector<float> lf, lc;
    const auto tf = generate(fused, prompts, 2, true, &lf);
    (void)generate(gemm, prompts, 2, true, &lc);
    const double r = rel_l2(lf.data(), lc.data(), lf.size());
    MESSAGE("batch " << batch << ": fused GEMV vs cuBLAS relative L2 " << r);
    CHECK(r < 1e-2);
    std::vector<float> le;
    CHECK(generate(fused, prompts, 2, false, &le) == tf);
    CHECK(differing(le, lf) == 0);
  }
}

TEST_CASE("a sequence decoded in a bucket of up to 64 rows matches it decoded alone") {
  for (const Config& cfg : shapes())
    for (int gemv_rows : {16, 4}) {  // bucket 8 on the tensor-core GEMV, then on cuBLAS; 32 and 64 on cuBLAS
      CAPTURE(cfg.name);
      CAPTURE(gemv_rows);
      EngineOptions o = small_opts(gemv_rows);
      o.max_batch = 64, o.max_bucket = 64, o.kv_budget_bytes = 256ull << 20;
      Engine e(cfg, o, nullptr);
      const int V = cfg.vocab_size;
      for (int batch : {5, 17, 33, 64}) {  // buckets 8, 32 (padded), 64 (padded), 64
        CAPTURE(batch);
        const auto prompts = prompts_of(batch, 3, 1, 11, V);
        std::vector<float> lb;
        (void)generate(e, prompts, 1, true, &lb);
        for (int i : {0, batch / 2, batch - 1}) {
          std::vector<float> la;
          (void)generate(e, {prompts[i]}, 1, true, &la);  // bucket 1: the CUDA-core GEMV
          const double r = rel_l2(lb.data() + std::size_t(i) * V, la.data(), std::size_t(V));
          MESSAGE(cfg.name << " (gemv rows " << gemv_rows << ") batch " << batch << " row " << i
                           << ": bucket vs batch 1 relative L2 " << r);
          CHECK(r < 1e-2);
        }
      }
    }
}

/// A bucket of `rows` rows whose attention grid needs more than one wave of 8-warp blocks: checks that
/// the plan picked 4-warp blocks, that eager and graph agree bit for bit, and that rows match the
/// same sequences decoded alone (bucket 1: 8-warp blocks, split-KV).
void four_warp_check(const Config& cfg, int rows) {
  EngineOptions o = small_opts();
  o.max_batch = rows, o.max_bucket = rows, o.kv_budget_bytes = 256ull << 20, o.prefill_chunk = 128;
  Engine e(cfg, o, nullptr);
  const std::string kernels = e.describe_kernels(), at = " " + std::to_string(rows) + ": ";
  MESSAGE(kernels);
  REQUIRE(kernels.find(at) != std::string::npos);
  CHECK(kernels.substr(kernels.find(at)).find("1x4.") != std::string::npos);
  const int V = e.config().vocab_size;
  const auto prompts = prompts_of(rows, 40, 64 / rows, 5, V);  // contexts of 40 to ~100 positions: 2 to 4 load rounds
  std::vector<float> le, lg;
  const auto eager = generate(e, prompts, 3, false, &le);
  const auto graph = generate(e, prompts, 3, true, &lg);
  CHECK(eager == graph);
  CHECK(differing(le, lg) == 0);
  for (int i : {0, rows / 2, rows - 1}) {
    std::vector<float> la;
    (void)generate(e, {prompts[i]}, 1, true, &la);
    const double r = rel_l2(lg.data() + std::size_t(i) * V, la.data(), std::size_t(V));
    MESSAGE(cfg.name << " row " << i << ": bucket " << rows << " vs alone relative L2 " << r);
    CHECK(r < 1e-2);
  }
}

TEST_CASE("attention in 4-warp blocks (a bucket past one wave): Qwen3-0.6B heads at bucket 64") {
  four_warp_check(tiny_kv8(), 64);
}

TEST_CASE("attention in 4-warp blocks (a bucket past one wave): 64 kv heads at bucket 16, no cuBLAS in decode") {
  four_warp_check(tiny_kv64(), 16);
}

TEST_CASE("padding rows and other sequences do not disturb a sequence (paged KV isolation)") {
  for (const Config& cfg : shapes()) {
  CAPTURE(cfg.name);
  Engine e(cfg, small_opts(), nullptr);
  const int V = e.config().vocab_size;
  const auto a = prompt_of(9, 1, V);
  const auto alone = generate(e, {a}, 24, true);                                           // bucket 1
  const auto with2 = generate(e, {prompt_of(4, 2, V), a, prompt_of(13, 3, V)}, 24, true);  // bucket 4, padded
  CHECK(alone[0] == with2[1]);
  // The blocks were all returned.
  CHECK(e.kv().free_blocks() == e.kv().num_blocks() - 1);
 }
}

TEST_CASE("prefill and token-by-token decode agree on the last prompt token") {
  for (const Config& cfg : shapes()) {
  CAPTURE(cfg.name);
  Engine e(cfg, small_opts(), nullptr);
  const int V = e.config().vocab_size;
  const auto p = prompt_of(40, 5, V);  // > prefill_chunk: two chunks
  auto& book = e.kv();
  const int s = book.acquire_slot();
  book.ensure(s, 41);
  std::vector<float> ref(V), dec(V);
  (void)e.prefill(s, p, 0, ref);
  // Now the same prompt through decode steps: prefill only the first token, decode the rest.
  (void)e.prefill(s, std::span<const int>(p.data(), 1), 0);
  int next = 0;
  for (int i = 1; i < 40; ++i) {
    DecodeRow row{s, p[i], i};
    e.decode(std::span<const DecodeRow>(&row, 1), true, std::span<int>(&next, 1), dec);
  }
  const double rel = rel_l2(dec.data(), ref.data(), std::size_t(V));
  MESSAGE("prefill vs decode relative L2 error: " << rel);
  CHECK(rel < 1e-2);
  book.release(s);
 }
}

/// Split-KV decode attention at long context (several chunks per (row, kv head)): the decode logits
/// of a sequence's last token agree with its prefill (which does not split), eager is bit-identical
/// to graph, alone (bucket 1, GEMV path) and among other rows (bucket 8, GEMM path).
void split_kv_check(const Config& cfg) {
  EngineOptions o = small_opts();
  o.max_context = 1024;
  o.kv_budget_bytes = 128ull << 20;
  Engine e(cfg, o, nullptr);
  const int V = e.config().vocab_size;
  auto& book = e.kv();
  const std::vector<int> lens = {700, 130, 311, 64, 1000};  // 6, 2, 3, 1 and 8 chunks of 128
  std::vector<std::vector<int>> prompts;
  std::vector<int> slots;
  std::vector<float> ref(lens.size() * V);
  for (std::size_t i = 0; i < lens.size(); ++i) {
    prompts.push_back(prompt_of(lens[i], 20 + int(i), V));
    slots.push_back(book.acquire_slot());
    book.ensure(slots.back(), lens[i]);
    (void)e.prefill(slots.back(), prompts.back(), 0, std::span<float>(ref).subspan(i * V, V));
  }
  const auto rel = [](std::span<const float> a, std::span<const float> b) { return rel_l2(a.data(), b.data(), a.size()); };
  // Each sequence's last prompt token again, as a decode step (it rewrites the same K/V), alone and
  // all together, eager and graph.
  for (bool together : {false, true}) {
    std::vector<DecodeRow> rows;
    for (std::size_t i = 0; i < lens.size(); ++i) rows.push_back({slots[i], prompts[i].back(), lens[i] - 1});
    std::vector<std::vector<float>> out;
    for (bool graph : {false, true}) {
      std::vector<float> logits(lens.size() * V, std::numeric_limits<float>::quiet_NaN());
      std::vector<int> next(lens.size());
      if (together) {
        e.decode(rows, graph, next, logits);
      } else {
        for (std::size_t i = 0; i < lens.size(); ++i)
          e.decode(std::span<const DecodeRow>(&rows[i], 1), graph, std::span<int>(&next[i], 1),
                   std::span<float>(logits).subspan(i * V, V));
      }
      for (float v : logits) REQUIRE(std::isfinite(v));
      out.push_back(logits);
    }
    CAPTURE(together);
    CHECK(out[0] == out[1]);  // eager == graph, bit for bit
    for (std::size_t i = 0; i < lens.size(); ++i) {
      const double r = rel(std::span<const float>(out[1]).subspan(i * V, V), std::span<const float>(ref).subspan(i * V, V));
      MESSAGE(cfg.name << std::string(together ? " together" : " alone") << ", context " << lens[i] << ": decode vs prefill relative L2 " << r);
      CHECK(r < 1e-2);
    }
  }
  for (int s : slots) book.release(s);
}

TEST_CASE("split-KV decode attention at long context agrees with prefill") {
  split_kv_check(preset("tiny"));
  split_kv_check(tiny_hd128_g4());  // this and the next: 16 lanes per position in attention
  split_kv_check(tiny_g5());
}

TEST_CASE("unsupported head shapes are rejected with a clear message") {
  Config c = preset("tiny");
  c.head_dim = 96;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("head_dim must be 64 or 128"), input_error);
  Config g = preset("tiny");
  g.num_attention_heads = 18, g.num_key_value_heads = 2;  // 9 per group
  CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("at most 8"), input_error);
  CHECK_THROWS_AS(Engine(c, small_opts(), nullptr), input_error);
}

TEST_CASE("bad decode input is rejected before any launch") {
  Engine e(preset("tiny"), small_opts(), nullptr);
  auto& book = e.kv();
  const int s = book.acquire_slot();
  book.ensure(s, 4);
  std::vector<int> next(1);
  DecodeRow bad_tok{s, 5000, 0};
  CHECK_THROWS_AS(e.decode(std::span<const DecodeRow>(&bad_tok, 1), true, next), input_error);
  DecodeRow bad_pos{s, 1, 7};
  CHECK_THROWS_AS(e.decode(std::span<const DecodeRow>(&bad_pos, 1), true, next), input_error);
  DecodeRow bad_slot{5, 1, 0};
  CHECK_THROWS_AS(e.decode(std::span<const DecodeRow>(&bad_slot, 1), false, next), input_error);
  CHECK(e.graph_stats().captures == 0);
}

// ---- the device loop (Engine::decode_loop) ------------------------------------------------------

namespace {

/// One sequence decoded greedily with the device loop: its tokens (the prefill's first) and the
/// tokens each launch produced.
struct LoopRun {
  std::vector<int> tokens;
  std::vector<int> per_launch;
};

constexpr int kPoison = -7;  // never a token id

/// Prefills `prompt`, then launches decode_loop with up to `k` tokens until `total` tokens, the stop
/// token or the end of the context. `reserve_all`: the whole context's blocks are reserved first, so
/// the device's context check, not the reservation, ends the last launch.
LoopRun generate_looped(Engine& e, const std::vector<int>& prompt, int total, int k, int stop = -1,
                        bool reserve_all = false) {
  auto& book = e.kv();
  const int C = e.options().max_context;
  const int slot = book.acquire_slot();
  book.ensure(slot, reserve_all ? book.max_tokens_per_seq() : static_cast<int>(prompt.size()));
  LoopRun r;
  int next = e.prefill(slot, prompt, 0);
  r.tokens.push_back(next);
  int pos = static_cast<int>(prompt.size());
  std::vector<int> out(static_cast<std::size_t>(k));
  while (static_cast<int>(r.tokens.size()) < total && next != stop && pos + 2 <= C) {
    std::fill(out.begin(), out.end(), kPoison);
    const int want = std::min(k, total - static_cast<int>(r.tokens.size()));
    const int n = e.decode_loop(slot, next, pos, want, stop, out);
    REQUIRE(n >= 1);
    REQUIRE(n <= want);
    for (int i = 0; i < k; ++i) REQUIRE((i < n) == (out[i] != kPoison));  // exactly n written
    r.per_launch.push_back(n);
    r.tokens.insert(r.tokens.end(), out.begin(), out.begin() + n);
    next = out[n - 1];
    pos += n;
  }
  book.release(slot);
  return r;
}

/// The per-step graph path's tokens for `prompt`: the prefill's, then `steps` decode() calls.
std::vector<int> per_step(Engine& e, const std::vector<int>& prompt, int steps) {
  return generate(e, {prompt}, steps, true)[0];
}

/// The tiny preset with an lm_head of its own. With random weights and a tied head, a greedy step
/// mostly returns its input token (the head is the embedding), so the tiny preset's sequences repeat
/// one token; an untied head gives varied tokens, which a loop that failed to advance the token
/// on the device could not reproduce.
Config tiny_untied() {
  Config c = preset("tiny");
  c.name = "tiny_untied";
  c.tie_word_embeddings = false;
  c.validate();
  return c;
}

std::size_t distinct(const std::vector<int>& v) {
  std::vector<int> s = v;
  std::sort(s.begin(), s.end());
  return static_cast<std::size_t>(std::unique(s.begin(), s.end()) - s.begin());
}

}  // namespace

TEST_CASE("the device loop gives the per-step graph path's tokens, for any tokens per launch") {
  for (const Config& cfg : {preset("tiny"), tiny_untied()}) {
    CAPTURE(cfg.name);
    Engine e(cfg, small_opts(), nullptr);
    const int V = e.config().vocab_size;
    for (int salt : {0, 1}) {
      CAPTURE(salt);
      const auto p = prompt_of(7 + 5 * salt, 40 + salt, V);
      const auto ref = per_step(e, p, 40);  // 41 tokens
      MESSAGE(cfg.name << ", prompt " << salt << ": " << distinct(ref) << " distinct tokens of 41");
      if (!cfg.tie_word_embeddings) CHECK(distinct(ref) >= 3);  // the tokens change from step to step
      for (int k : {1, 3, 16, 64}) {
        CAPTURE(k);
        const LoopRun r = generate_looped(e, p, 41, k);
        CHECK(r.tokens == ref);
        // Full launches of k tokens, the last one what is left.
        const int launches = (40 + k - 1) / k;
        REQUIRE(static_cast<int>(r.per_launch.size()) == launches);
        for (int i = 0; i + 1 < launches; ++i) CHECK(r.per_launch[i] == k);
        CHECK(r.per_launch.back() == 40 - (launches - 1) * k);
      }
    }
    CHECK(e.kv().free_blocks() == e.kv().num_blocks() - 1);
  }
}

TEST_CASE("the device loop and per-step decode take turns on one sequence") {
  for (const Config& cfg : {preset("tiny"), tiny_untied()}) {
    CAPTURE(cfg.name);
    Engine e(cfg, small_opts(), nullptr);
    const int V = e.config().vocab_size;
    const auto p = prompt_of(9, 3, V);
    const auto ref = per_step(e, p, 30);
    auto& book = e.kv();
    const int slot = book.acquire_slot();
    book.ensure(slot, static_cast<int>(p.size()));
    std::vector<int> got{e.prefill(slot, p, 0)};
    int pos = static_cast<int>(p.size());
    std::vector<int> out(8, kPoison);
    while (static_cast<int>(got.size()) < 31) {
      // 5 tokens from the loop, then 3 per-step decodes (which restage the metadata the loop advanced).
      const int n = e.decode_loop(slot, got.back(), pos, std::min(5, 31 - static_cast<int>(got.size())), -1, out);
      got.insert(got.end(), out.begin(), out.begin() + n);
      pos += n;
      for (int i = 0; i < 3 && static_cast<int>(got.size()) < 31; ++i) {
        book.ensure(slot, pos + 1);
        DecodeRow row{slot, got.back(), pos};
        int next = kPoison;
        e.decode(std::span<const DecodeRow>(&row, 1), true, std::span<int>(&next, 1));
        got.push_back(next);
        ++pos;
      }
    }
    CHECK(got == ref);
    book.release(slot);
  }
}

TEST_CASE("the device loop stops on the stop token inside a launch") {
  Engine e(tiny_untied(), small_opts(), nullptr);
  const int V = e.config().vocab_size;
  int tested[2] = {0, 0};  // k = 4, k = 16
  for (int salt = 0; salt < 12 && (tested[0] < 2 || tested[1] < 2); ++salt) {
    CAPTURE(salt);
    const auto p = prompt_of(6 + salt, 70 + salt, V);
    const auto ref = per_step(e, p, 40);
    for (int j = 0; j < 2; ++j) {
      const int k = j == 0 ? 4 : 16;
      CAPTURE(k);
      // The stop token: one that first appears after the first launch, not at a launch's end.
      int at = -1;
      for (int i = k + 1; i < 40 && at < 0; ++i)
        if (i % k != 0 && std::find(ref.begin(), ref.begin() + i, ref[i]) == ref.begin() + i) at = i;
      if (at < 0) continue;  // the sequence repeats itself too soon
      CAPTURE(at);
      const LoopRun r = generate_looped(e, p, 41, k, ref[at]);
      CHECK(r.tokens == std::vector<int>(ref.begin(), ref.begin() + at + 1));
      REQUIRE(r.per_launch.size() == static_cast<std::size_t>(at / k + 1));
      CHECK(r.per_launch.back() == at % k);  // the last launch was cut short by the stop token
      ++tested[j];
    }
  }
  CHECK(tested[0] >= 2);
  CHECK(tested[1] >= 2);
}

TEST_CASE("the device loop stops at the end of the context") {
  EngineOptions o = small_opts();
  o.max_context = 96;
  for (const Config& cfg : {preset("tiny"), tiny_untied()}) {
    CAPTURE(cfg.name);
    Engine e(cfg, o, nullptr);
    const int V = e.config().vocab_size, P = 20;
    const auto p = prompt_of(P, 9, V);
    const auto ref = per_step(e, p, o.max_context - P - 1);  // the last token at position max_context - 1
    REQUIRE(static_cast<int>(ref.size()) == o.max_context - P);
    for (bool reserve_all : {false, true}) {
      for (int k : {16, 1024}) {
        CAPTURE(reserve_all);
        CAPTURE(k);
        const LoopRun r = generate_looped(e, p, 1 << 20, k, -1, reserve_all);
        CHECK(r.tokens == ref);
        CHECK(r.per_launch.back() == (k == 16 ? (o.max_context - P - 1) % 16 : o.max_context - P - 1));
      }
    }
  }
}

TEST_CASE("bad device-loop input is rejected before any launch") {
  Engine e(preset("tiny"), small_opts(), nullptr);
  const int V = e.config().vocab_size, C = e.options().max_context;
  auto& book = e.kv();
  const int s = book.acquire_slot();
  book.ensure(s, 4);
  std::vector<int> out(16, kPoison);
  CHECK_THROWS_AS(e.decode_loop(s, 1, 4, 0, -1, out), input_error);                        // k = 0
  std::vector<int> big(kMaxTokensPerLaunch + 1);
  CHECK_THROWS_AS(e.decode_loop(s, 1, 4, kMaxTokensPerLaunch + 1, -1, big), input_error);  // k too large
  CHECK_THROWS_AS(e.decode_loop(s, 1, 4, 16, -1, std::span<int>(out.data(), 8)), replay::usage_error);
  CHECK_THROWS_AS(e.decode_loop(s + 1, 1, 4, 4, -1, out), input_error);   // slot not in use
  CHECK_THROWS_AS(e.decode_loop(s, V, 4, 4, -1, out), input_error);       // token out of range
  CHECK_THROWS_AS(e.decode_loop(s, -1, 4, 4, -1, out), input_error);
  CHECK_THROWS_AS(e.decode_loop(s, 1, 4, 4, V, out), input_error);        // stop token out of range
  CHECK_THROWS_AS(e.decode_loop(s, 1, 5, 4, -1, out), input_error);       // past the cached positions
  CHECK_THROWS_AS(e.decode_loop(s, 1, C - 1, 4, -1, out), input_error);   // no room in the context
  CHECK(book.length(s) == 4);                                             // nothing was reserved
  for (int v : out) CHECK(v == kPoison);
  CHECK(e.graph_stats().captures == 0);
}

// ---- sampling (EngineOptions::sampling, sample.cu) ------------------------------------------------

namespace {

/// Runs the sampler on `nrows` rows that all hold the logits `row`; row r's input token is at
/// position pos0 + r, so each row is an independent draw (for position pos0 + r + 1). Returns the
/// token of each row (the keys are poisoned first; every token must be in range).
std::vector<int> draw(const std::vector<float>& row, int nrows, const SampleParams& p, int pos0 = 0) {
  replay::stream s;
  const int V = static_cast<int>(row.size());
  std::vector<float> all;
  all.reserve(std::size_t(nrows) * V);
  for (int r = 0; r < nrows; ++r) all.insert(all.end(), row.begin(), row.end());
  std::vector<RowStep> meta(nrows);
  for (int r = 0; r < nrows; ++r) meta[r] = RowStep{.token = 0, .pos = pos0 + r, .slot = 0};
  replay::device_buffer<float> dl(all.size());
  replay::device_buffer<RowStep> dm(meta.size());
  replay::device_buffer<SampleParams> dp(1);
  replay::device_buffer<unsigned long long> keys(nrows);
  REPLAY_CHECK(cudaMemcpyAsync(dl.data(), all.data(), all.size() * sizeof(float), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(dm.data(), meta.data(), meta.size() * sizeof(RowStep), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(dp.data(), &p, sizeof(SampleParams), cudaMemcpyHostToDevice, s.get()));
  replay_test::poison(keys.data(), std::size_t(nrows) * sizeof(unsigned long long), s);
  launch_sample(dl.data(), V, dm.data(), dp.data(), nrows, keys.data(), s);
  std::vector<int> out;
  for (unsigned long long k : replay_test::to_host(keys.data(), nrows, s)) {
    const int t = key_to_token(k);
    REQUIRE(t >= 0);
    REQUIRE(t < V);
    out.push_back(t);
  }
  return out;
}

/// The distribution the sampler draws from, in double on the host: softmax(logits / T), cut to the
/// top_k largest logits (ties kept), renormalised, then to the smallest prefix (largest first) whose
/// mass reaches top_p, renormalised.
std::vector<double> expected(const std::vector<float>& logits, const SampleParams& p) {
  const int V = static_cast<int>(logits.size());
  std::vector<int> order(V);
  for (int i = 0; i < V; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  int keep = V;
  if (p.top_k > 0 && p.top_k < V) {
    keep = p.top_k;
    while (keep < V && logits[order[keep]] == logits[order[p.top_k - 1]]) ++keep;
  }
  std::vector<double> w(V, 0.0);
  double z = 0;
  for (int j = 0; j < keep; ++j)
    z += w[order[j]] = std::exp((double(logits[order[j]]) - logits[order[0]]) / p.temperature);
  if (p.top_p < 1.f) {
    double c = 0;
    int j = 0;
    while (j < keep && c < double(p.top_p) * z) c += w[order[j++]];
    for (int t = j; t < keep; ++t) w[order[t]] = 0;
    z = c;
  }
  for (double& v : w) v /= z;
  return w;
}

std::vector<double> frequencies(const std::vector<int>& tokens, int V) {
  std::vector<double> f(V, 0.0);
  for (int t : tokens) f[t] += 1.0 / tokens.size();
  return f;
}

/// Uniform logits in [lo, hi) from a seed.
std::vector<float> random_logits(int V, std::uint64_t seed, float lo, float hi) {
  std::vector<float> l(V);
  for (int i = 0; i < V; ++i) l[i] = lo + (hi - lo) * replay_examples::uniform01(seed, i);
  return l;
}

EngineOptions sampling_opts() {
  EngineOptions o = small_opts();
  o.sampling = true;
  return o;
}

constexpr SampleParams kSampled{.temperature = 0.8f, .top_p = 0.95f, .top_k = 40, .seed = 7};

}  // namespace

TEST_CASE("sampling: temperature 0, or top_k 1 at any temperature, picks the argmax, ties to the lowest index") {
  for (int V : {4, 5001, 151936}) {
    for (bool negative : {false, true}) {
      CAPTURE(V);
      CAPTURE(negative);
      std::vector<float> l = negative ? random_logits(V, V, -3.f, -1.f) : random_logits(V, V, -2.f, 2.f);
      const float top = *std::max_element(l.begin(), l.end()) + 0.25f;
      const int a = V / 3, b = V - 1;  // a tie at the top: the lower index wins
      l[a] = l[b] = top;
      const int rows = V > 10000 ? 16 : 512;
      const float tiny_t = std::numeric_limits<float>::denorm_min();  // 1 / T overflows: greedy
      for (const SampleParams& p : {SampleParams{.temperature = 0.f, .top_p = 0.3f, .top_k = 5, .seed = 1},
                                    SampleParams{.temperature = 0.7f, .top_p = 1.f, .top_k = 1, .seed = 2},
                                    SampleParams{.temperature = 50.f, .top_p = 0.5f, .top_k = 1, .seed = 3},
                                    SampleParams{.temperature = tiny_t, .top_p = 1.f, .top_k = 0, .seed = 4}}) {
        CAPTURE(p.temperature);
        for (int t : draw(l, rows, p, 17)) REQUIRE(t == a);
      }
    }
  }
}

TEST_CASE("sampling: with top_k 3 only the three largest logits are ever drawn") {
  for (int V : {1000, 151936}) {
    CAPTURE(V);
    const std::vector<float> l = random_logits(V, 99, -1.f, 1.f);
    std::vector<int> order(V);
    for (int i = 0; i < V; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + 3, order.end(), [&](int x, int y) { return l[x] > l[y]; });
    std::vector<int> seen(V, 0);
    const int rows = V > 10000 ? 64 : 2000;
    for (std::uint32_t seed = 1; seed <= 5; ++seed)
      for (float top_p : {1.f, 0.99f})
        for (int t : draw(l, rows, SampleParams{.temperature = 3.f, .top_p = top_p, .top_k = 3, .seed = seed}))
          ++seen[t];
    int outside = 0;
    for (int i = 0; i < V; ++i)
      if (i != order[0] && i != order[1] && i != order[2]) outside += seen[i];
    CHECK(outside == 0);
    for (int j = 0; j < 3; ++j) CHECK(seen[order[j]] > 0);  // near-equal probabilities at T = 3: each is drawn
  }
}

TEST_CASE("sampling: the top-p nucleus of probabilities 0.5, 0.3, 0.15, 0.05") {
  // Token ids in a shuffled order: 0.05 -> 0, 0.5 -> 1, 0.15 -> 2, 0.3 -> 3.
  const std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  auto support = [&](float top_p) {
    std::vector<int> seen(4, 0);
    for (int t : draw(l, 4000, SampleParams{.temperature = 1.f, .top_p = top_p, .top_k = 0, .seed = 11})) seen[t] = 1;
    return seen;
  };
  CHECK(support(0.45f) == std::vector<int>{0, 1, 0, 0});  // 0.5 >= 0.45
  CHECK(support(0.79f) == std::vector<int>{0, 1, 0, 1});  // 0.5 + 0.3 >= 0.79
  CHECK(support(0.81f) == std::vector<int>{0, 1, 1, 1});  // + 0.15
  CHECK(support(1.f) == std::vector<int>{1, 1, 1, 1});
}

TEST_CASE("sampling: frequencies over 20000 draws follow softmax(logits / T) after top-k and top-p") {
  const std::vector<float> four = {std::log(0.2f), std::log(0.4f), std::log(0.1f), std::log(0.3f)};
  const std::vector<float> five = {2.0f, -1.0f, 0.5f, 1.0f, 0.0f};
  struct Case {
    std::vector<float> logits;
    SampleParams p;
  };
  const Case cases[] = {
      {four, {.temperature = 1.f, .top_p = 1.f, .top_k = 0, .seed = 1}},
      {four, {.temperature = 0.6f, .top_p = 1.f, .top_k = 0, .seed = 2}},
      {four, {.temperature = 2.5f, .top_p = 1.f, .top_k = 4, .seed = 3}},
      {four, {.temperature = 1.f, .top_p = 1.f, .top_k = 2, .seed = 4}},
      {four, {.temperature = 1.f, .top_p = 0.7f, .top_k = 3, .seed = 5}},  // top-3: 4/9, 3/9, 2/9; p: the first two
      {five, {.temperature = 1.5f, .top_p = 0.9f, .top_k = 0, .seed = 6}},
      {five, {.temperature = 0.8f, .top_p = 0.95f, .top_k = 40, .seed = 7}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.p.temperature);
    CAPTURE(c.p.top_p);
    CAPTURE(c.p.top_k);
    const int V = static_cast<int>(c.logits.size());
    const std::vector<double> want = expected(c.logits, c.p);
    const std::vector<double> got = frequencies(draw(c.logits, 20000, c.p, 1000), V);
    double worst = 0;
    for (int i = 0; i < V; ++i) {
      CAPTURE(i);
      if (want[i] == 0) CHECK(got[i] == 0);  // cut by top-k or top-p: never drawn
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
    CHECK(worst < 0.02);
  }
}

TEST_CASE("sampling: a draw depends on (seed, position, token), not on the row it runs in") {
  const std::vector<float> l = random_logits(3000, 5, -2.f, 2.f);
  const SampleParams p{.temperature = 1.f, .top_p = 0.9f, .top_k = 50, .seed = 21};
  const std::vector<int> a = draw(l, 64, p, 100);  // row r: position 100 + r
  const std::vector<int> b = draw(l, 32, p, 132);  // the last 32 of those, in rows 0..31
  CHECK(std::vector<int>(a.begin() + 32, a.end()) == b);
  CHECK(draw(l, 64, p, 100) == a);  // deterministic
  SampleParams q = p;
  q.seed = 22;
  CHECK(draw(l, 64, q, 100) != a);  // another seed, other draws
}

TEST_CASE("sampling engine: eager and graph decode give the same sampled tokens at batch 1, 2 and 8") {
  Engine e(tiny_untied(), sampling_opts(), nullptr);
  e.set_sampling(kSampled);
  const int V = e.config().vocab_size;
  Engine greedy(tiny_untied(), small_opts(), nullptr);
  for (int batch : {1, 2, 8}) {
    CAPTURE(batch);
    const auto prompts = prompts_of(batch, 5, 3, 0, V);
    const auto graph = check_eager_is_graph(e, prompts);
    CHECK(generate(greedy, prompts, 12, true) != graph);  // it does sample
  }
  CHECK(e.graph_stats().captures == 3);
}

TEST_CASE("sampling engine: the device loop gives the per-step sampled tokens") {
  Engine e(tiny_untied(), sampling_opts(), nullptr);
  const int V = e.config().vocab_size;
  for (const SampleParams& p : {kSampled, SampleParams{.temperature = 1.3f, .top_p = 1.f, .top_k = 0, .seed = 99}}) {
    CAPTURE(p.seed);
    e.set_sampling(p);  // the second set runs the loop graph captured with the first
    const auto prompt = prompt_of(9, 4, V);
    const auto ref = per_step(e, prompt, 40);
    MESSAGE("seed " << p.seed << ": " << distinct(ref) << " distinct tokens of 41");
    CHECK(distinct(ref) >= 3);
    for (int k : {1, 7, 64}) {
      CAPTURE(k);
      CHECK(generate_looped(e, prompt, 41, k).tokens == ref);
    }
  }
}

TEST_CASE("sampling engine: temperature 0 gives the tokens of the engine without sampling") {
  for (int gemv_rows : {16, 0}) {  // the fused GEMV's argmax epilogue, and cuBLAS + argmax kernel
    CAPTURE(gemv_rows);
    EngineOptions on = small_opts(gemv_rows), off = small_opts(gemv_rows);
    on.sampling = true;
    Engine s(tiny_untied(), on, nullptr), g(tiny_untied(), off, nullptr);
    s.set_sampling(SampleParams{.temperature = 0.f, .top_p = 0.5f, .top_k = 3, .seed = 5});
    const int V = s.config().vocab_size;
    for (int batch : {1, 3, 8}) {
      CAPTURE(batch);
      const auto prompts = prompts_of(batch, 6, 2, 3, V);
      for (bool graph : {false, true}) CHECK(generate(s, prompts, 10, graph) == generate(g, prompts, 10, graph));
    }
    const auto prompt = prompt_of(7, 8, V);
    CHECK(generate_looped(s, prompt, 30, 8).tokens == generate_looped(g, prompt, 30, 8).tokens);
  }
}

TEST_CASE("sampling engine: changing the parameters between steps captures no graph") {
  Engine e(tiny_untied(), sampling_opts(), nullptr);
  const int V = e.config().vocab_size;
  const SampleParams other{.temperature = 1.5f, .top_p = 0.8f, .top_k = 0, .seed = 3};
  const auto prompts = prompts_of(3, 6, 1, 1, V);
  // Per step: the parameters alternate (greedy, kSampled, other); eager and graph runs agree.
  auto run = [&](bool graph) {
    auto& book = e.kv();
    std::vector<int> slot(3), next(3, kPoison), pos(3);
    std::vector<int> tokens;
    for (int i = 0; i < 3; ++i) {
      slot[i] = book.acquire_slot();
      book.ensure(slot[i], static_cast<int>(prompts[i].size()) + 12);
      e.set_sampling(SampleParams{});
      next[i] = e.prefill(slot[i], prompts[i], 0);
      pos[i] = static_cast<int>(prompts[i].size());
    }
    for (int s = 0; s < 12; ++s) {
      e.set_sampling(s % 3 == 0 ? SampleParams{} : s % 3 == 1 ? kSampled : other);
      std::vector<DecodeRow> rows;
      for (int i = 0; i < 3; ++i) rows.push_back({slot[i], next[i], pos[i]++});
      std::fill(next.begin(), next.end(), kPoison);
      e.decode(rows, graph, next);
      tokens.insert(tokens.end(), next.begin(), next.end());
    }
    for (int i = 0; i < 3; ++i) book.release(slot[i]);
    return tokens;
  };
  const auto eager = run(false);
  CHECK(e.graph_stats().captures == 0);
  const auto graph = run(true);
  CHECK(eager == graph);
  const GraphStats st = e.graph_stats();
  CHECK(st.captures == 1);  // bucket 4, once
  CHECK(st.replays == 12);
  CHECK(run(true) == graph);
  CHECK(e.graph_stats().captures == 1);
  CHECK(e.graph_stats().replays == 24);
  CHECK(e.sampling() == other);
}

TEST_CASE("sampling engine: invalid parameters are rejected") {
  Engine s(preset("tiny"), sampling_opts(), nullptr);
  Engine g(preset("tiny"), small_opts(), nullptr);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (Engine* e : {&s, &g}) {
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = -0.1f}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = nan}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = inf}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = 1.f, .top_p = 0.f}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = 1.f, .top_p = 1.5f}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = 1.f, .top_p = nan}), input_error);
    CHECK_THROWS_AS(e->set_sampling(SampleParams{.temperature = 1.f, .top_k = -1}), input_error);
    CHECK(e->sampling() == SampleParams{});
  }
  CHECK_THROWS_WITH_AS(g.set_sampling(kSampled), doctest::Contains("EngineOptions::sampling"), input_error);
  g.set_sampling(SampleParams{.temperature = 0.f, .top_p = 0.5f, .top_k = 3, .seed = 1});  // greedy: accepted
  s.set_sampling(kSampled);
  CHECK(s.sampling() == kSampled);
}
