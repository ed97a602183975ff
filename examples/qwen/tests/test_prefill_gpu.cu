// GPU tests of prefill: the tensor-core prefill attention (prefill_attention.cu) against decode
// attention run on the same rows (head_dim 64 and 128, 1 to 8 query heads per kv head, chunks at
// position 0 and past it, lengths that are not multiples of the tiles, KV blocks of 16 and 5
// positions placed out of order, poison where nothing may be read or written); and the engine's
// prefill in one chunk, in many chunks and token by token giving the same logits and tokens.
#include <doctest/doctest.h>

#include "engine_fixtures.cuh"

#include <replay/buffer.hpp>
#include <replay/error.hpp>

#include <algorithm>
#include <array>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

using namespace qwen;

namespace {

struct AttnCase {
  int head_dim, kv_heads, q_heads;
  int block_size;  // positions per KV block
  int start, rows;  // the chunk: positions start .. start + rows - 1
};

std::vector<float> to_host(const replay::device_buffer<bf16>& d) {
  std::vector<bf16> h(d.size());
  REPLAY_CHECK(cudaMemcpy(h.data(), d.data(), d.size_bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> f(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

/// One chunk of `c` through launch_kv_write and then launch_prefill_attention, against decode
/// attention (launch_attention, no split, fp32 q) on the same rows and pool. Layer 1 of a two-layer
/// pool; the sequence's blocks in reverse order; every pool value random except the positions of the
/// last block past the chunk, which hold NaN (never read), and block-table entries past the
/// sequence, which are out of range (never looked up). Outputs are NaN-filled first, with one row
/// more than the chunk (never written).
void check_prefill_attention(const AttnCase& c) {
  CAPTURE(c.head_dim);
  CAPTURE(c.kv_heads);
  CAPTURE(c.q_heads);
  CAPTURE(c.block_size);
  CAPTURE(c.start);
  CAPTURE(c.rows);
  replay::stream s;
  init_attention_attributes();
  init_prefill_attention_attributes();
  const int D = c.head_dim, bs = c.block_size, rows = c.rows;
  const int q_dim = c.q_heads * D, kv_dim = c.kv_heads * D, width = q_dim + 2 * kv_dim;
  const int len = c.start + rows;
  const int nblk = (len + bs - 1) / bs;
  const int layer = 1;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::uint64_t seed = std::uint64_t(D) * 1000003u + c.q_heads * 1009u + c.start * 7u + rows;

  KvPool kv{.num_blocks = nblk + 3, .block_size = bs, .kv_heads = c.kv_heads, .head_dim = D};
  replay::device_buffer<bf16> pool(kv.layer_stride() * 2);
  kv.base = pool.data();
  launch_fill_random(pool.data(), pool.size(), seed, 3.0f, s);  // earlier chunks' K/V: uniform(-3, 3)
  // Block table: slot 1 holds the sequence's blocks, last block first; the rest out of range.
  const int tw = nblk + 2;
  std::vector<std::int32_t> table(2 * std::size_t(tw), 0x3fffffff);
  for (int b = 0; b < nblk; ++b) table[tw + b] = kv.num_blocks - 1 - b;
  std::vector<bf16> nan_row(D, __float2bfloat16(nan));
  for (int t = len; t < nblk * bs; ++t)  // the last block's positions past the chunk
    for (int h = 0; h < c.kv_heads; ++h)
      for (int half = 0; half < 2; ++half) {
        const std::size_t at = layer * kv.layer_stride() + half * kv.kv_stride() +
                               ((std::size_t(table[tw + t / bs]) * c.kv_heads + h) * bs + t % bs) * D;
        REPLAY_CHECK(cudaMemcpyAsync(pool.data() + at, nan_row.data(), D * sizeof(bf16), cudaMemcpyHostToDevice,
                                     s.get()));
      }
  std::uint64_t counter = 0;
  auto uniform = [&] { return 2.f * replay_examples::uniform01(seed, counter++) - 1.f; };
  std::vector<float> qkv_h(std::size_t(rows) * width);
  for (auto& v : qkv_h) v = 2.f * uniform();
  std::vector<bf16> norms(2 * D);
  for (auto& v : norms) v = __float2bfloat16(1.f + 0.3f * uniform());
  std::vector<RowStep> steps(rows);
  for (int r = 0; r < rows; ++r) steps[r] = {0, c.start + r, 1};

  replay::device_buffer<float> qkv(qkv_h.size());
  replay::device_buffer<bf16> norm_w(norms.size());
  replay::device_buffer<float2> rope(std::size_t(len) * D / 2);
  replay::device_buffer<RowStep> rows_d(steps.size());
  replay::device_buffer<std::int32_t> table_d(table.size());
  REPLAY_CHECK(cudaMemcpyAsync(qkv.data(), qkv_h.data(), qkv.size_bytes(), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(norm_w.data(), norms.data(), norm_w.size_bytes(), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(rows_d.data(), steps.data(), rows_d.size_bytes(), cudaMemcpyHostToDevice, s.get()));
  REPLAY_CHECK(cudaMemcpyAsync(table_d.data(), table.data(), table_d.size_bytes(), cudaMemcpyHostToDevice, s.get()));
  launch_rope_table(rope.data(), len, D, 1000000.0, s);
  const RowMeta meta{.rows = rows_d.data(), .block_table = table_d.data(), .table_width = tw};
  const bf16* q_norm = norm_w.data();
  const bf16* k_norm = norm_w.data() + D;
  const float eps = 1e-6f;

  launch_kv_write(qkv.data(), c.q_heads, k_norm, eps, rope.data(), meta, rows, kv, layer, s);
  replay::device_buffer<bf16> got(std::size_t(rows + 1) * q_dim), again(got.size()), want(got.size());
  for (auto* b : {&got, &again, &want}) launch_fill_const(b->data(), b->size(), nan, s);
  launch_prefill_attention(qkv.data(), c.q_heads, q_norm, eps, rope.data(), meta, rows, kv, layer, got.data(), s);
  launch_prefill_attention(qkv.data(), c.q_heads, q_norm, eps, rope.data(), meta, rows, kv, layer, again.data(), s);
  launch_attention(qkv.data(), c.q_heads, q_norm, k_norm, eps, rope.data(), meta, rows, kv, layer, /*write_kv=*/false,
                   AttnPlan{}, want.data(), s);
  s.synchronize();
  const auto g = to_host(got), a = to_host(again), w = to_host(want);

  std::size_t nonfinite = 0, written_past = 0, not_repeated = 0;
  for (std::size_t i = 0; i < std::size_t(rows) * q_dim; ++i) nonfinite += std::isfinite(g[i]) ? 0 : 1;
  for (std::size_t i = std::size_t(rows) * q_dim; i < g.size(); ++i) written_past += std::isnan(g[i]) ? 0 : 1;
  for (std::size_t i = 0; i < g.size(); ++i) not_repeated += (g[i] == a[i] || (std::isnan(g[i]) && std::isnan(a[i]))) ? 0 : 1;
  CHECK(nonfinite == 0);
  CHECK(written_past == 0);
  CHECK(not_repeated == 0);  // no atomics: the same bits every run
  REQUIRE(nonfinite == 0);
  // Per (row, head) and over the chunk: relative L2 distance from decode attention.
  double worst = 0;
  int worst_row = -1;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < c.q_heads; ++h) {
      const std::size_t at = std::size_t(r) * q_dim + h * D;
      const double e = rel_l2(g.data() + at, w.data() + at, D);
      if (e > worst) worst = e, worst_row = r;
    }
  const double all = rel_l2(g.data(), w.data(), std::size_t(rows) * q_dim);
  MESSAGE("prefill attention D=" << D << " q/kv=" << c.q_heads << "/" << c.kv_heads << " block " << bs << " chunk "
                                  << c.start << "+" << rows << ": relative L2 vs decode attention " << all
                                  << " over the chunk | " << worst << " worst (row, head), row " << worst_row);
  CHECK(all < 1e-2);
  CHECK(worst < 4e-2);
}

}  // namespace

TEST_CASE("prefill attention: tensor-core kernel vs decode attention, every head shape, chunks at and past 0") {
  // Chunks: from position 0 (one tile, several tiles, not multiples of 64), past 0 at a position
  // that is not block- or tile-aligned, a single row deep into the context, two tiles past 128.
  const std::vector<std::pair<int, int>> chunks = {{0, 100}, {0, 64}, {37, 70}, {200, 1}, {129, 131}, {0, 1}};
  const std::vector<std::array<int, 3>> heads = {
      {64, 2, 4},    // tiny: head_dim 64, 2 query heads per kv head
      {64, 4, 4},    // one query head per kv head
      {128, 2, 8},   // tiny-hd128 / Qwen3-4B: head_dim 128, 4 per kv head
      {128, 2, 10},  // 5 per kv head (Qwen3-14B): packed tiles straddle rows
      {128, 1, 8},   // 8 per kv head
      {64, 1, 3},    // 3 per kv head, head_dim 64
  };
  for (const auto& [d, kvh, qh] : heads)
    for (const auto& [start, rows] : chunks) check_prefill_attention({d, kvh, qh, 16, start, rows});
  // KV blocks of 5 positions: a key tile spans blocks that do not divide it.
  check_prefill_attention({64, 2, 4, 5, 37, 70});
  check_prefill_attention({128, 2, 8, 5, 129, 131});
}

namespace {

/// Whether the largest logit leads the second by more than 2% of the largest magnitude (a greedy
/// choice that rounding cannot flip).
bool decisive(const std::vector<float>& l) {
  std::vector<float> v = l;
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  float mx = 0;
  for (float x : l) mx = std::max(mx, std::fabs(x));
  return v[0] - v[1] > 2e-2f * mx;
}

int argmax(const std::vector<float>& l) {
  return static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin());
}

}  // namespace

TEST_CASE("prefill in one chunk, in many chunks and token by token: the same logits and greedy tokens") {
  for (const Config& cfg : shapes()) {
    CAPTURE(cfg.name);
    EngineOptions one = small_opts(), many = small_opts();
    one.prefill_chunk = 512;  // the whole prompt at once
    many.prefill_chunk = 37;  // chunks starting at positions that are not tile- or block-aligned
    Engine a(cfg, one, nullptr), b(cfg, many, nullptr);  // the same random weights
    const int V = cfg.vocab_size, n = 300;
    const auto p = prompt_of(n, 11, V);
    std::vector<float> la(V, NAN), lb(V, NAN), lc(V, NAN);
    int ta = 0, tb = 0, tc = 0;
    for (Engine* e : {&a, &b}) {
      const int slot = e->kv().acquire_slot();
      e->kv().ensure(slot, n);
      (e == &a ? ta : tb) = e->prefill(slot, p, 0, e == &a ? la : lb);
      e->kv().release(slot);
    }
    // Token by token: the first token prefilled, the others decoded (decode attention).
    {
      const int slot = a.kv().acquire_slot();
      a.kv().ensure(slot, n);
      (void)a.prefill(slot, std::span<const int>(p.data(), 1), 0);
      for (int i = 1; i < n; ++i) {
        const DecodeRow row{slot, p[i], i};
        a.decode(std::span<const DecodeRow>(&row, 1), true, std::span<int>(&tc, 1), lc);
      }
      a.kv().release(slot);
    }
    for (const auto* l : {&la, &lb, &lc})
      REQUIRE(std::all_of(l->begin(), l->end(), [](float v) { return std::isfinite(v); }));
    const double ab = rel_l2(lb.data(), la.data(), V), ac = rel_l2(lc.data(), la.data(), V);
    MESSAGE(cfg.name << ": logits after a " << n << "-token prompt, relative L2: 37-token chunks vs one chunk " << ab
                     << ", token by token vs one chunk " << ac);
    CHECK(ab < 1e-2);
    CHECK(ac < 2e-2);
    CHECK(ta == argmax(la));
    CHECK(tb == argmax(lb));
    if (decisive(la)) {
      CHECK(ta == tb);
      CHECK(ta == tc);
    }
    // Greedy continuations from the two prefills (decode is the same code in both engines; a step
    // whose top two logits are within rounding may differ, so this is reported, not checked).
    const auto ga = generate(a, {p}, 8, true), gb = generate(b, {p}, 8, true);
    MESSAGE(cfg.name << ": 8 greedy tokens after a one-chunk prefill vs after 37-token chunks: "
                     << (ga == gb ? "identical" : "different"));
  }
}
