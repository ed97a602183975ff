// Shared by the Qwen example's GPU tests: small engines, prompts, the eager == graph check, and the
// device-loop runner. Each test executable includes it once.
#pragma once

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
std::vector<std::vector<int>> generate(Decoder& e, const std::vector<std::vector<int>>& prompts, int steps, bool graph,
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
std::vector<std::vector<int>> check_eager_is_graph(Decoder& e, const std::vector<std::vector<int>>& prompts) {
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
