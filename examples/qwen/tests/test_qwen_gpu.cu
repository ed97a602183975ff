// GPU tests of the Qwen example: eager and graph decode give identical tokens and logits; the batch-1
// GEMV agrees with a host reference; the fused GEMV (CUDA-core and tensor-core, its ring refilled)
// agrees with cuBLAS; paged KV keeps sequences apart across buckets; decode agrees with prefill, also
// with split-KV at long context; every supported head shape (head_dim 64 and 128, 1..8 query heads
// per kv head) runs; the device loop (decode_loop) gives the per-step graph path's tokens for any
// tokens per launch, stops on a stop token inside a launch and at the end of the context; bad input
// is rejected before any launch; the tensor-parallel pieces that need no second GPU (weight slices,
// partial products from a bf16 x, a shard's argmax keys, logits put back in vocabulary order).
#include <doctest/doctest.h>

#include "engine_fixtures.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace qwen;


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
/// same bits when run again. `bf16_in`: store_f32 reads a bf16 x (a tensor-parallel rank's partial O
/// or down product) instead of the normalised residual; argmax keys count from `index0`.
static void check_batch1_gemv(gemv_out mode, int N, int K, GemvPlan::kernel want, bool bf16_in = false,
                              int index0 = 0) {
  CAPTURE(static_cast<int>(mode));
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(bf16_in);
  replay::stream s;
  init_gemv_attributes();
  const int R = mode == gemv_out::silu_mul ? 2 : 1;
  const bool norm = mode != gemv_out::add_f32 && !bf16_in;
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
  op.W = dw.data(), op.N = N, op.K = K, op.mode = mode, op.ldy = N, op.index0 = index0;
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
      const int idx = key_to_token(replay_test::to_host(keys.data(), 1, s)[0]) - index0;
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
  // Tensor parallel: a rank's partial product stored from a bf16 x, and a vocabulary shard's keys.
  check_batch1_gemv(gemv_out::store_f32, 1500, 2304, kind::pipelined, true);
  check_batch1_gemv(gemv_out::store_f32, 2560, 9728, kind::pipelined_deep, true);
  check_batch1_gemv(gemv_out::argmax, 1500, 2304, kind::pipelined, false, 75968);
}

TEST_CASE("tensor-parallel pieces on one GPU: weight slices, argmax keys of a shard, logits back in order") {
  replay::stream s;
  // A shard of random weights has the values of the same elements of the full tensor.
  constexpr std::size_t R = 37, C = 300;
  replay::device_buffer<bf16> full(R * C), part(R * C);
  launch_fill_random(full.data(), R * C, 99, 0.5f, s);
  const auto f = replay_test::to_host(full.data(), R * C, s);
  auto same_bits = [](bf16 a, bf16 b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  struct Slice { std::size_t rows, cols, row0, col0; };
  for (const Slice sl : {Slice{16, C, 5, 0}, Slice{R, 150, 0, 100}, Slice{3, 7, 30, 293}}) {
    CAPTURE(sl.row0);
    CAPTURE(sl.col0);
    replay_test::poison(part.data(), part.size_bytes(), s);
    launch_fill_random_slice(part.data(), sl.rows, sl.cols, C, sl.row0, sl.col0, 99, 0.5f, s);
    const auto p = replay_test::to_host(part.data(), sl.rows * sl.cols, s);
    int bad = 0;
    for (std::size_t i = 0; i < sl.rows; ++i)
      for (std::size_t j = 0; j < sl.cols; ++j) bad += !same_bits(p[i * sl.cols + j], f[(sl.row0 + i) * C + sl.col0 + j]);
    CHECK(bad == 0);
  }
  // argmax over a shard's logits: keys carry the global token id.
  constexpr int V = 1000, rows = 3, tp = 2;
  std::vector<float> lg(std::size_t(rows) * V);
  for (std::size_t i = 0; i < lg.size(); ++i) lg[i] = static_cast<float>((i * 7919) % 1009) / 1009.f;
  replay::device_buffer<float> dl(lg.size()), out(lg.size() * tp);
  replay::device_buffer<unsigned long long> keys(rows);
  REPLAY_CHECK(cudaMemcpyAsync(dl.data(), lg.data(), lg.size() * sizeof(float), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemsetAsync(keys.data(), 0, keys.size_bytes(), s.get()));
  launch_argmax(dl.data(), V, rows, keys.data(), s, 5 * V);
  const auto k = replay_test::to_host(keys.data(), rows, s);
  for (int r = 0; r < rows; ++r) {
    const auto row = lg.begin() + std::ptrdiff_t(r) * V;
    CHECK(key_to_token(k[r]) == 5 * V + (std::max_element(row, row + V) - row));
  }
  // The all-gathered [tp][rows][shard] back into [rows][tp * shard]: here the "gathered" buffer is
  // lg twice (rank 1's shard = rank 0's + 1), shard = V.
  std::vector<float> g(lg);
  for (float v : lg) g.push_back(v + 1.f);
  replay::device_buffer<float> dg(g.size());
  REPLAY_CHECK(cudaMemcpyAsync(dg.data(), g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice, s.get()));
  replay_test::poison(out.data(), out.size_bytes(), s);
  launch_unshard_logits(dg.data(), tp, rows, V, out.data(), s);
  const auto o = replay_test::to_host(out.data(), out.size(), s);
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < tp * V; ++c)
      bad += o[std::size_t(r) * tp * V + c] != lg[std::size_t(r) * V + c % V] + (c >= V ? 1.f : 0.f);
  CHECK(bad == 0);
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
void split_kv_check(Config cfg) {
  cfg.max_position_embeddings = 8192;  // room for a context of a few thousand positions
  EngineOptions o = small_opts();
  o.max_context = 4608;
  o.kv_budget_bytes = 256ull << 20;
  Engine e(cfg, o, nullptr);
  const int V = e.config().vocab_size;
  auto& book = e.kv();
  // 6, 2, 3, 1, 8 and 1 chunks of 128 and 24 of 192 at bucket 1 (32 splits): one chunk in the first
  // load iteration only (64), one reaching the second, staged in shared memory, with the new position
  // in it (100), and blocks of three load iterations (4500).
  const std::vector<int> lens = {700, 130, 311, 64, 1000, 100, 4500};
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
