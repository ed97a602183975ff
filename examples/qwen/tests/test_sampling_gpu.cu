// GPU tests of the Qwen example's sampler (sample.cu, EngineOptions::sampling): the kernel on
// synthetic logits (greedy at temperature 0 and top_k 1, only the top k drawn, a hand-computed
// nucleus, frequencies against softmax, draws independent of the row), and the engine (eager ==
// graph at several batch sizes, the device loop == per-step decode, temperature 0 == sampling off,
// no capture when the parameters change, bad parameters refused).
#include <doctest/doctest.h>

#include "engine_fixtures.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace qwen;

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
