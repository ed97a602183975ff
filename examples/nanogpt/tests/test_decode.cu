// GPU tests of the NanoGPT decoder: logits against a CPU reference, eager == graph == device-loop
// tokens for several prompts / lengths / sampling settings / steps per launch, graph structure,
// argument checks.
#include "gpu_test.hpp"
#include "nanogpt/model.hpp"
#include "nanogpt/vocab.hpp"
#include "nanogpt/weights.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

using namespace nanogpt;
using C = Config;

namespace {

/// Weights with larger magnitudes than the default init, so attention and sampling are not
/// near-uniform and a wrong mask, head split or residual shows up in the logits.
Weights spicy_weights(std::uint64_t seed) {
  Weights w = random_weights(seed);
  std::uint64_t i = 0;
  for (const auto& s : tensor_specs()) {
    const bool is_ln = s.name.find(".ln1.") != std::string::npos || s.name.find(".ln2.") != std::string::npos ||
                       s.name.starts_with("ln_f.");
    for (std::size_t k = 0; k < s.numel; ++k, ++i) {
      float& v = w.data[s.offset + k];
      const float u = replay_examples::uniform01(seed + 99, i) - 0.5f;  // in [-0.5, 0.5)
      if (is_ln) v = s.name.ends_with(".weight") ? 1.0f + 0.4f * u : 0.2f * u;
      else if (s.name.ends_with(".bias")) v = 0.2f * u;
      else v *= 10.0f;  // N(0, 0.2) instead of N(0, 0.02)
    }
  }
  return w;
}

/// Full causal forward of the seed's model in double precision: logits of every position. With
/// `max_score`, also the largest attention score magnitude (after the 1/sqrt(head_size) scale).
std::vector<std::vector<double>> reference_logits(const Weights& w, const std::vector<std::int32_t>& tokens,
                                                  double* max_score = nullptr) {
  const int T = static_cast<int>(tokens.size()), E = C::n_embd, H = C::n_head, D = C::head_size;
  const auto t = [&](const std::string& name) { return w.tensor(name); };
  std::vector<std::vector<double>> x(T, std::vector<double>(E));
  for (int i = 0; i < T; ++i)
    for (int c = 0; c < E; ++c)
      x[i][c] = t("token_embedding_table.weight")[tokens[i] * E + c] + t("position_embedding_table.weight")[i * E + c];
  const auto layer_norm = [&](const std::vector<double>& v, std::span<const float> g, std::span<const float> b) {
    double mean = 0, var = 0;
    for (double a : v) mean += a;
    mean /= E;
    for (double a : v) var += (a - mean) * (a - mean);
    var /= E;
    std::vector<double> o(E);
    for (int c = 0; c < E; ++c) o[c] = (v[c] - mean) / std::sqrt(var + C::ln_eps) * g[c] + b[c];
    return o;
  };
  const auto linear = [&](const std::vector<double>& v, std::span<const float> W, const float* b, int out) {
    const int in = static_cast<int>(v.size());
    std::vector<double> o(out);
    for (int r = 0; r < out; ++r) {
      double acc = b ? b[r] : 0.0;
      for (int c = 0; c < in; ++c) acc += W[r * in + c] * v[c];
      o[r] = acc;
    }
    return o;
  };
  for (int l = 0; l < C::n_layer; ++l) {
    const std::string p = fmt::format("blocks.{}.", l);
    std::vector<std::vector<double>> qkv(T);
    for (int i = 0; i < T; ++i) qkv[i] = linear(layer_norm(x[i], t(p + "ln1.weight"), t(p + "ln1.bias")), t(p + "sa.qkv.weight"), nullptr, 3 * E);
    for (int i = 0; i < T; ++i) {
      std::vector<double> heads(E);
      for (int h = 0; h < H; ++h) {
        std::vector<double> s(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int k = 0; k < D; ++k) d += qkv[i][h * D + k] * qkv[j][E + h * D + k];
          s[j] = d / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[j]);
          if (max_score) *max_score = std::max(*max_score, std::abs(s[j]));
        }
        double sum = 0;
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (int k = 0; k < D; ++k) {
          double acc = 0;
          for (int j = 0; j <= i; ++j) acc += s[j] / sum * qkv[j][2 * E + h * D + k];
          heads[h * D + k] = acc;
        }
      }
      const auto y = linear(heads, t(p + "sa.attn_proj.weight"), t(p + "sa.attn_proj.bias").data(), E);
      for (int c = 0; c < E; ++c) x[i][c] += y[c];
    }
    for (int i = 0; i < T; ++i) {
      auto hdn = linear(layer_norm(x[i], t(p + "ln2.weight"), t(p + "ln2.bias")), t(p + "ffwd.net.0.weight"),
                        t(p + "ffwd.net.0.bias").data(), C::ffn_hidden);
      for (auto& v : hdn) v = std::max(v, 0.0);
      const auto y = linear(hdn, t(p + "ffwd.net.2.weight"), t(p + "ffwd.net.2.bias").data(), E);
      for (int c = 0; c < E; ++c) x[i][c] += y[c];
    }
  }
  std::vector<std::vector<double>> logits(T);
  for (int i = 0; i < T; ++i)
    logits[i] = linear(layer_norm(x[i], t("ln_f.weight"), t("ln_f.bias")), t("lm_head.weight"), t("lm_head.bias").data(),
                       C::vocab_size);
  return logits;
}

/// The launch settings the tests cover: every metadata path, PDL on and off.
const std::vector<ModelOptions>& all_variants() {
  static const std::vector<ModelOptions> v = {
      {.pdl = true, .meta = MetaPath::push},       {.pdl = false, .meta = MetaPath::push},
      {.pdl = true, .meta = MetaPath::graph_copy},
      {.pdl = true, .meta = MetaPath::device},     {.pdl = false, .meta = MetaPath::device},
  };
  return v;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

}  // namespace

TEST_CASE("logits of prefill and of eager and graph decode steps match a CPU reference") {
  const Weights w = spicy_weights(11);
  const auto tokens = encode("First Citizen:\nBefore we proceed any further, hear me speak.");
  const auto ref = reference_logits(w, tokens);
  double spread = 0;
  for (double v : ref.back()) spread = std::max(spread, std::abs(v));
  REQUIRE(spread > 0.5);  // the test weights give non-trivial logits
  for (const ModelOptions& opt : all_variants()) {
    Model model(w, opt);
    for (Mode mode : {Mode::eager, Mode::graph}) {
      CAPTURE(opt.pdl);
      CAPTURE(to_string(opt.meta));
      CAPTURE(to_string(mode));
      const int k = 5;
      (void)model.prefill(std::span<const std::int32_t>(tokens.data(), k), {});
      CHECK(max_abs_diff(model.logits(), ref[k - 1]) < 1e-4);
      if (mode == Mode::graph) model.capture_decode_graph();
      double worst = 0;
      for (int pos = k; pos < static_cast<int>(tokens.size()); ++pos) {
        (void)model.decode_step(tokens[pos], pos, {}, mode);
        worst = std::max(worst, max_abs_diff(model.logits(), ref[pos]));
      }
      CHECK(worst < 1e-4);
      // A full prefill of the whole text gives the last position's logits too.
      (void)model.prefill(tokens, {});
      CHECK(max_abs_diff(model.logits(), ref.back()) < 1e-4);
    }
  }
}

TEST_CASE("attention scores too large for unshifted exponentials take the shifted path") {
  // The decode and prefill attention weigh the slots with exp(score) unshifted while the sum of the
  // weights stays in [2^-60, 2^60] (scores within about ±41) and recompute a head shifted by its
  // maximum otherwise. Query and key weights 8 times larger make many heads' scores far larger.
  // With scores past 100, fp32 rounding of the scores alone moves the softmax weights by about
  // 1e-4 relative, so the bound here is 1e-3 of the logits' magnitude: what it catches is an
  // overflow (inf or NaN) or a wrong normalisation, which are off by orders of magnitude.
  Weights w = spicy_weights(5);
  for (int l = 0; l < C::n_layer; ++l) {
    const std::size_t offset = spec(fmt::format("blocks.{}.sa.qkv.weight", l)).offset;
    for (std::size_t k = 0; k < 2 * C::n_embd * C::n_embd; ++k) w.data[offset + k] *= 8.0f;  // q and k rows
  }
  const auto tokens = encode("To be, or not to be, that is the question:");
  double max_score = 0;
  const auto ref = reference_logits(w, tokens, &max_score);
  REQUIRE(max_score > 100.0);  // far outside the unshifted range
  for (Mode mode : {Mode::eager, Mode::graph}) {
    CAPTURE(to_string(mode));
    Model model(w);
    const int k = 4;
    (void)model.prefill(std::span<const std::int32_t>(tokens.data(), k), {});
    double scale = 1;
    for (double v : ref[k - 1]) scale = std::max(scale, std::abs(v));
    CHECK(max_abs_diff(model.logits(), ref[k - 1]) < 1e-3 * scale);
    if (mode == Mode::graph) model.capture_decode_graph();
    double worst = 0;
    for (int pos = k; pos < static_cast<int>(tokens.size()); ++pos) {
      (void)model.decode_step(tokens[pos], pos, {}, mode);
      double s = 1;
      for (double v : ref[pos]) s = std::max(s, std::abs(v));
      worst = std::max(worst, max_abs_diff(model.logits(), ref[pos]) / s);
    }
    CHECK(worst < 1e-3);
  }
}

TEST_CASE("eager and graph produce identical tokens for several prompts, lengths and settings") {
  std::vector<std::pair<std::string, Weights>> weight_sets;
  weight_sets.emplace_back("spicy", spicy_weights(3));
  weight_sets.emplace_back("random init", random_weights(1));
  if (std::filesystem::exists(NANOGPT_DEFAULT_WEIGHTS))
    weight_sets.emplace_back("shipped", load_weights(NANOGPT_DEFAULT_WEIGHTS));
  struct Case {
    std::string prompt;
    int tokens;
    Sampling sampling;
  };
  const std::vector<Case> cases = {
      {"\n", 63, {1.0f, 42, false}},
      {"ROMEO:", 20, {0.8f, 7, false}},
      {"To be, or not to be", 45, {1.0f, 1337, false}},
      {"First Citizen:\nBefore we proceed any further, hear me speak.", 4, {1.3f, 5, false}},
      {"KING", 60, {1.0f, 0, true}},
      {"a", 1, {1.0f, 9, false}},
  };
  for (const auto& [wname, w] : weight_sets) {
    std::vector<std::vector<std::int32_t>> first_variant;  // tokens of every case under the first variant
    for (const ModelOptions& opt : all_variants()) {
      Model model(w, opt);
      for (const auto& c : cases) {
        CAPTURE(wname);
        CAPTURE(opt.pdl);
        CAPTURE(to_string(opt.meta));
          CAPTURE(c.prompt);
        CAPTURE(c.tokens);
        const auto prompt = encode(c.prompt);
        const auto e = generate(model, prompt, c.tokens, Mode::eager, c.sampling);
        const auto g = generate(model, prompt, c.tokens, Mode::graph, c.sampling);
        REQUIRE(e.tokens.size() == static_cast<std::size_t>(c.tokens));
        CHECK(e.tokens == g.tokens);
        // Same seed again: same tokens (no hidden state survives between generations).
        const auto again = generate(model, prompt, c.tokens, Mode::graph, c.sampling, /*fresh_capture=*/false);
        CHECK(again.tokens == g.tokens);
        // The launch settings change how kernels wait, never what they compute.
        const std::size_t i = static_cast<std::size_t>(&c - cases.data());
        if (first_variant.size() <= i) first_variant.push_back(e.tokens);
        else CHECK(e.tokens == first_variant[i]);
      }
    }
  }
}

TEST_CASE("PDL on and off run the same kernels: identical tokens") {
  const Weights w = spicy_weights(5);
  const auto prompt = encode("MENENIUS:");
  Model a(w, {.pdl = true});
  Model b(w, {.pdl = false});
  const Sampling s{1.0f, 77, false};
  CHECK(generate(a, prompt, 50, Mode::graph, s).tokens == generate(b, prompt, 50, Mode::eager, s).tokens);
}

TEST_CASE("different seeds sample different text; greedy ignores the seed") {
  const Weights w = spicy_weights(9);
  Model model(w);
  const auto prompt = encode("ROMEO:");
  const auto a = generate(model, prompt, 40, Mode::graph, {1.0f, 1, false});
  const auto b = generate(model, prompt, 40, Mode::graph, {1.0f, 2, false});
  CHECK(a.tokens != b.tokens);
  const auto g1 = generate(model, prompt, 40, Mode::graph, {1.0f, 1, true});
  const auto g2 = generate(model, prompt, 40, Mode::eager, {1.0f, 2, true});
  CHECK(g1.tokens == g2.tokens);
}

TEST_CASE("the captured step is one kernel node and one capture serves every position") {
  for (MetaPath meta : {MetaPath::push, MetaPath::graph_copy, MetaPath::device}) {
  CAPTURE(to_string(meta));
  const bool in_graph = meta == MetaPath::graph_copy;
  Model model(spicy_weights(4), {.pdl = true, .meta = meta});
  CHECK_FALSE(model.has_graph());
  const auto prompt = encode("HAMLET:");
  (void)model.prefill(prompt, {});
  model.capture_decode_graph();
  CHECK(model.has_graph());
  CHECK(model.graph_kernel_nodes() == static_cast<std::size_t>(Model::kernels_per_decode_step));
  // graph-copy adds the metadata copy and its guard (an event-record node).
  CHECK(model.graph_nodes() == static_cast<std::size_t>(Model::kernels_per_decode_step + (in_graph ? 2 : 0)));
  // Reuse the same graph for two different prompts and compare with eager.
  for (const char* text : {"O", "Good morrow, cousin."}) {
    const auto p = encode(text);
    const auto e = generate(model, p, 30, Mode::eager, {1.0f, 3, false});
    const auto g = generate(model, p, 30, Mode::graph, {1.0f, 3, false}, /*fresh_capture=*/false);
    CHECK(e.tokens == g.tokens);
  }
  }
}

TEST_CASE("steps enqueued without reading their token, then synchronous steps") {
  for (const ModelOptions& opt : all_variants()) {
    CAPTURE(to_string(opt.meta));
    Model model(spicy_weights(6), opt);
    const auto prompt = encode("CORIOLANUS:");
    const Sampling s{1.0f, 21, false};
    const auto ref = generate(model, prompt, 12, Mode::eager, s);
    model.capture_decode_graph();
    for (Mode mode : {Mode::eager, Mode::graph}) {
      (void)model.prefill(prompt, s);
      for (int i = 0; i < 5; ++i) model.enqueue_decode_step(ref.tokens[0], static_cast<int>(prompt.size()), s, mode);
      // The enqueued steps all rewrote slot prompt.size() with the same token: the sequence is unchanged.
      std::int32_t token = ref.tokens[0];
      for (std::size_t i = 1; i < ref.tokens.size(); ++i) {
        token = model.decode_step(token, static_cast<int>(prompt.size() + i - 1), s, mode);
        CHECK(token == ref.tokens[i]);
      }
    }
  }
}

TEST_CASE("MetaPath::device: steps the device did not predict are pushed, predicted ones are not") {
  // The device path writes nothing from the host for a step whose metadata the previous step's
  // sampler already wrote. Any other step must still see exactly the metadata it was given: forced
  // tokens, repeated and skipped positions, other sampling settings. Compared with the push path
  // (the host writes every step), token for token and logit for logit.
  for (bool pdl : {true, false}) {
    CAPTURE(pdl);
    Model dev(spicy_weights(8), {.pdl = pdl, .meta = MetaPath::device});
    Model ref(spicy_weights(8), {.pdl = pdl, .meta = MetaPath::push});
    const auto prompt = encode("KING LEAR:");
    for (Mode mode : {Mode::eager, Mode::graph}) {
      CAPTURE(to_string(mode));
      const Sampling s0{0.9f, 5, false};
      std::int32_t td = dev.prefill(prompt, s0), tr = ref.prefill(prompt, s0);
      REQUIRE(td == tr);
      if (mode == Mode::graph) dev.capture_decode_graph(), ref.capture_decode_graph();
      int pos = static_cast<int>(prompt.size());
      int forced = 0;
      const std::size_t writes_before = dev.meta_writes();
      for (int i = 0; i < 40; ++i) {
        CAPTURE(i);
        Sampling s = s0;
        std::int32_t in = td;  // the predicted step: the sampled token at the next position
        int p = pos;
        if (i % 5 == 1) in = (i * 7 + 3) % Config::vocab_size;  // a forced token
        if (i % 7 == 2) s = {1.3f, 77, false};                  // other sampling settings
        if (i % 11 == 3) s.greedy = true;
        if (i % 13 == 4 && p > 0) p -= 1;                       // rewrite the previous slot
        const bool predicted = in == td && p == pos && s.temperature == s0.temperature && s.seed == s0.seed &&
                               s.greedy == s0.greedy;
        if (i > 0 && !predicted) ++forced;
        td = dev.decode_step(in, p, s, mode);
        tr = ref.decode_step(in, p, s, mode);
        CHECK(td == tr);
        CHECK(dev.logits() == ref.logits());
        pos = p + 1;
        if (pos >= Config::block_size) break;
      }
      // Only the steps the device could not predict were written by the host. (Step 0 follows the
      // prefill with its own settings; a step after a changed one is a change back, so pushed too.)
      CHECK(dev.meta_writes() - writes_before <= static_cast<std::size_t>(2 * forced + 1));
      CHECK(dev.meta_writes() - writes_before < 30);
    }
    // An ordinary generation: one write (the prefill's), whatever its length.
    const std::size_t before = dev.meta_writes();
    const auto g = generate(dev, prompt, 30, Mode::graph, {1.0f, 9, false}, /*fresh_capture=*/false);
    CHECK(dev.meta_writes() - before == 1);
    const auto e = generate(dev, prompt, 30, Mode::eager, {1.0f, 9, false});
    CHECK(dev.meta_writes() - before == 2);
    CHECK(e.tokens == g.tokens);
  }
}

TEST_CASE("the device loop gives the tokens of eager and graph decoding for several K, prompts and lengths") {
  std::vector<std::pair<std::string, Weights>> weight_sets;
  weight_sets.emplace_back("spicy", spicy_weights(13));
  if (std::filesystem::exists(NANOGPT_DEFAULT_WEIGHTS))
    weight_sets.emplace_back("shipped", load_weights(NANOGPT_DEFAULT_WEIGHTS));
  struct Case {
    std::string prompt;
    int tokens;
    Sampling sampling;
  };
  const std::vector<Case> cases = {
      {"\n", 63, {1.0f, 42, false}},                // to the context limit
      {"ROMEO:", 20, {0.8f, 7, false}},
      {"To be, or not to be", 45, {1.0f, 1337, false}},  // to the context limit
      {"KING", 33, {1.0f, 0, true}},
      {"a", 2, {1.0f, 9, false}},
  };
  const ModelOptions variants[] = {{.pdl = true, .meta = MetaPath::device}, {.pdl = false, .meta = MetaPath::device},
                                   {.pdl = true, .meta = MetaPath::push}};
  for (const auto& [wname, w] : weight_sets) {
    for (const ModelOptions& opt : variants) {
      Model model(w, opt);
      for (const auto& c : cases) {
        CAPTURE(wname);
        CAPTURE(opt.pdl);
        CAPTURE(to_string(opt.meta));
        CAPTURE(c.prompt);
        CAPTURE(c.tokens);
        const auto prompt = encode(c.prompt);
        const auto e = generate(model, prompt, c.tokens, Mode::eager, c.sampling);
        const auto g = generate(model, prompt, c.tokens, Mode::graph, c.sampling);
        REQUIRE(e.tokens == g.tokens);
        const auto graph_logits = model.logits();
        for (int k : {1, 3, 16, 64}) {
          CAPTURE(k);
          // A fresh capture: min(k, 8) steps per run of the loop's body.
          const auto l = generate_looped(model, prompt, c.tokens, k, c.sampling, /*fresh_capture=*/true);
          CHECK(model.loop_steps_per_iteration() == std::min(k, Model::default_loop_steps_per_iteration));
          CHECK(l.tokens == g.tokens);
          CHECK_FALSE(l.stopped);
          CHECK(l.launch_us.size() == static_cast<std::size_t>((c.tokens - 1 + k - 1) / k));
          CHECK(model.logits() == graph_logits);  // the last step's logits, bit for bit
        }
      }
    }
  }
}

TEST_CASE("a stop token ends every path at the same token, inside a launch of the device loop") {
  const Weights w = spicy_weights(17);
  for (MetaPath meta : {MetaPath::device, MetaPath::push}) {
    CAPTURE(to_string(meta));
    Model model(w, {.pdl = true, .meta = meta});
    const auto prompt = encode("MENENIUS:");
    const Sampling s{1.0f, 31, false};
    const auto full = generate(model, prompt, 40, Mode::graph, s);
    for (std::size_t at : {std::size_t{0}, std::size_t{6}, std::size_t{21}}) {
      // The stop token: the token at index `at`, or the first earlier occurrence of it.
      const std::int32_t stop = full.tokens[at];
      const std::size_t first = static_cast<std::size_t>(
          std::find(full.tokens.begin(), full.tokens.end(), stop) - full.tokens.begin());
      CAPTURE(at);
      CAPTURE(first);
      const std::vector<std::int32_t> expected(full.tokens.begin(), full.tokens.begin() + first + 1);
      const auto e = generate(model, prompt, 40, Mode::eager, s, true, stop);
      const auto g = generate(model, prompt, 40, Mode::graph, s, false, stop);
      CHECK(e.tokens == expected);
      CHECK(g.tokens == expected);
      CHECK(e.stopped);
      // Any number of steps per run of the body: the steps after the stop do nothing.
      for (int per_run : {1, 3, 8}) {
        model.capture_loop_graph(per_run);
        for (int k : {4, 16, 64}) {
          CAPTURE(per_run);
          CAPTURE(k);
          const auto l = generate_looped(model, prompt, 40, k, s, false, stop);
          CHECK(l.tokens == expected);
          CHECK(l.stopped);
        }
      }
    }
    // A stop token that never comes: the full generation.
    const auto l = generate_looped(model, prompt, 40, 16, s, false, -1);
    CHECK(l.tokens == full.tokens);
  }
}

TEST_CASE("the device loop advances the metadata on the device: the host writes it once per generation") {
  const Weights w = spicy_weights(19);
  const auto prompt = encode("GLOUCESTER:");
  Model dev(w, {.pdl = true, .meta = MetaPath::device});
  (void)generate_looped(dev, prompt, 40, 8, {1.0f, 3, false});  // captures the loop graph
  std::size_t before = dev.meta_writes();
  const auto a = generate_looped(dev, prompt, 40, 8, {1.0f, 3, false}, false);
  CHECK(a.launch_us.size() == 5u);
  CHECK(dev.meta_writes() - before == 1);  // the prefill's; every launch found its metadata on the device
  // Per step after a loop launch: the device holds the next step's metadata (no push either).
  Model push(w, {.pdl = true, .meta = MetaPath::push});
  before = push.meta_writes();
  const auto b = generate_looped(push, prompt, 40, 8, {1.0f, 3, false});
  CHECK(push.meta_writes() - before == 2);  // the prefill's and the first launch's
  CHECK(a.tokens == b.tokens);
  // Mixing: a loop launch, then per-step decoding from where it stopped, gives the same text.
  std::vector<std::int32_t> mixed{dev.prefill(prompt, {1.0f, 3, false})};
  int pos = static_cast<int>(prompt.size());
  const LoopLaunch l = dev.decode_loop(mixed.back(), pos, {1.0f, 3, false}, 10, -1, mixed);
  CHECK(l.steps == 10);
  pos += l.steps;
  dev.capture_decode_graph();
  while (mixed.size() < 40) mixed.push_back(dev.decode_step(mixed.back(), pos++, {1.0f, 3, false}, Mode::graph));
  CHECK(mixed == a.tokens);
}

TEST_CASE("the device loop refuses bad arguments") {
  Model model(random_weights(1));
  std::vector<std::int32_t> out;
  CHECK_THROWS_AS((void)model.decode_loop(0, 0, {}, 4, -1, out), replay::usage_error);  // no loop graph yet
  model.capture_loop_graph();
  CHECK(model.has_loop_graph());
  CHECK_THROWS_AS((void)model.decode_loop(0, 60, {}, 5, -1, out), std::invalid_argument);
  CHECK_THROWS_AS((void)model.decode_loop(0, 3, {}, 0, -1, out), std::invalid_argument);
  CHECK_THROWS_AS((void)model.decode_loop(70, 3, {}, 2, -1, out), std::invalid_argument);
  CHECK_THROWS_AS((void)generate_looped(model, encode("abc"), 10, 0, {}), std::invalid_argument);
  CHECK_THROWS_AS((void)generate_looped(model, encode("abc"), 10, 65, {}), std::invalid_argument);
  CHECK_THROWS_AS(model.capture_loop_graph(0), std::invalid_argument);
  CHECK(out.empty());
}

TEST_CASE("decode_step and prefill refuse bad arguments") {
  Model model(random_weights(1));
  CHECK_THROWS_AS((void)model.decode_step(0, 0, {}, Mode::graph), replay::usage_error);
  const std::vector<std::int32_t> bad = {1, 65};
  CHECK_THROWS_AS((void)model.prefill(bad, {}), std::invalid_argument);
  CHECK_THROWS_AS((void)model.prefill({}, {}), std::invalid_argument);
  CHECK_THROWS_AS((void)model.decode_step(70, 3, {}, Mode::eager), std::invalid_argument);
  CHECK_THROWS_AS((void)model.decode_step(1, 64, {}, Mode::eager), std::invalid_argument);
  CHECK_THROWS_AS((void)model.decode_step(1, 3, {0.0f, 1, false}, Mode::eager), std::invalid_argument);
  CHECK_THROWS_AS((void)generate(model, encode("abc"), 62, Mode::eager, {}), std::invalid_argument);
}
