// examples/qwen/schedule.cpp: running sequences to completion (schedule.hpp).
#include "schedule.hpp"

#include <common/rng.hpp>
#include <common/timing.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <span>

namespace qwen {

std::vector<int> random_prompt(int n, int vocab, std::uint64_t seed) {
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int>(replay_examples::random_bits(seed, i) % std::uint64_t(vocab));
  return p;
}

void demo_requests(int n, int vocab, std::uint64_t seed, std::vector<SequenceRequest>& seqs,
                   std::vector<int>& join) {
  for (int i = 0; i < n; ++i) {
    seqs.push_back({random_prompt(4 + 3 * (i % 7), vocab, seed + 100 + i), 6 + (i * 7) % 23});
    join.push_back(i < 4 ? 0 : 2 * (i - 3));
  }
}

RunResult run_schedule(Decoder& eng, const std::vector<SequenceRequest>& seqs, const std::vector<int>& join,
                       bool graph, bool verbose, const TokenSink& sink) {
  struct State {
    int slot = -1;
    int pos = 0;
    int next = 0;
    bool done = false;
  };
  const int n = static_cast<int>(seqs.size());
  std::vector<State> st(n);
  RunResult res;
  res.tokens.assign(n, {});
  auto& book = eng.kv();
  int finished = 0, prev_bucket = -1;
  for (int step = 0; finished < n; ++step) {
    for (int i = 0; i < n; ++i) {  // admissions
      if (st[i].slot >= 0 || st[i].done || join[i] > step) continue;
      const auto& q = seqs[i];
      st[i].slot = book.acquire_slot();
      book.ensure(st[i].slot, static_cast<int>(q.prompt.size()));
      replay_examples::stopwatch sw;
      st[i].next = eng.prefill(st[i].slot, q.prompt, 0);
      res.prefill_ms += sw.elapsed_ms();
      st[i].pos = static_cast<int>(q.prompt.size());
      res.tokens[i].push_back(st[i].next);
      if (sink) sink(i, st[i].next);
      if (verbose) fmt::print("  step {:4}: sequence {} joins (prompt {} tokens, generating {})\n", step, i, q.prompt.size(), q.generate);
      if (static_cast<int>(res.tokens[i].size()) >= q.generate || q.stops_at(st[i].next)) {
        st[i].done = true, ++finished;
        book.release(st[i].slot);
        st[i].slot = -1;
      }
    }
    std::vector<DecodeRow> rows;
    std::vector<int> who;
    for (int i = 0; i < n; ++i)
      if (st[i].slot >= 0 && !st[i].done) {
        book.ensure(st[i].slot, st[i].pos + 1);
        rows.push_back({st[i].slot, st[i].next, st[i].pos});
        who.push_back(i);
      }
    if (rows.empty()) continue;
    std::vector<int> next(rows.size());
    replay_examples::stopwatch sw;
    eng.decode(rows, graph, next);
    const double us = sw.elapsed_us();
    res.step_us.push_back(us);
    res.decode_s += us * 1e-6;
    res.step_rows.push_back(static_cast<int>(rows.size()));
    const int bucket = eng.bucket_for(static_cast<int>(rows.size()));
    res.step_bucket.push_back(bucket);
    if (verbose && bucket != prev_bucket)
      fmt::print("  step {:4}: {} active sequences -> bucket {}\n", step, rows.size(), bucket);
    prev_bucket = bucket;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      const int i = who[k];
      res.tokens[i].push_back(next[k]);
      if (sink) sink(i, next[k]);
      st[i].next = next[k];
      ++st[i].pos;
      if (static_cast<int>(res.tokens[i].size()) >= seqs[i].generate || seqs[i].stops_at(next[k])) {
        st[i].done = true, ++finished;
        book.release(st[i].slot);
        st[i].slot = -1;
        if (verbose) fmt::print("  step {:4}: sequence {} finishes ({} tokens)\n", step, i, res.tokens[i].size());
      }
    }
  }
  return res;
}

RunResult run_looped(Decoder& eng, const SequenceRequest& q, int k, const TokenSink& sink) {
  auto& book = eng.kv();
  RunResult res;
  res.tokens.assign(1, {});
  auto& tokens = res.tokens[0];
  const int slot = book.acquire_slot();
  book.ensure(slot, static_cast<int>(q.prompt.size()));
  replay_examples::stopwatch sw;
  int next = eng.prefill(slot, q.prompt, 0);
  res.prefill_ms = sw.elapsed_ms();
  tokens.push_back(next);
  if (sink) sink(0, next);
  int pos = static_cast<int>(q.prompt.size());
  std::vector<int> out(static_cast<std::size_t>(k));
  bool stopped = q.stops_at(next);
  while (!stopped && static_cast<int>(tokens.size()) < q.generate) {
    const int want = std::min(k, q.generate - static_cast<int>(tokens.size()));
    sw.restart();
    // The device loop stops on one token; the host ends the sequence at any stop id.
    int n = eng.decode_loop(slot, next, pos, want, q.stop.empty() ? -1 : q.stop.front(), out);
    const double us = sw.elapsed_us();
    res.step_us.push_back(us / n);
    res.decode_s += us * 1e-6;
    res.step_rows.push_back(1);
    res.step_bucket.push_back(1);
    n = static_cast<int>(q.kept(std::span<const int>(out.data(), static_cast<std::size_t>(n))));
    stopped = q.stops_at(out[n - 1]);
    tokens.insert(tokens.end(), out.begin(), out.begin() + n);
    if (sink)
      for (int j = 0; j < n; ++j) sink(0, out[j]);
    next = out[n - 1];
    pos += n;
    if (!stopped && n < want) break;  // the context is full (validate_request rules it out)
  }
  book.release(slot);
  return res;
}

BucketUse bucket_use(const RunResult& r) {
  BucketUse u;
  u.steps = r.step_rows.size();
  const std::set<int> bs(r.step_bucket.begin(), r.step_bucket.end());
  u.buckets.assign(bs.begin(), bs.end());
  for (std::size_t i = 0; i < r.step_rows.size(); ++i) u.real += r.step_rows[i], u.run += r.step_bucket[i];
  return u;
}

std::vector<float> teacher_forced_logits(Decoder& eng, const std::vector<int>& prompt, int prefix, bool graph) {
  const int P = prefix, n = static_cast<int>(prompt.size()), V = eng.config().vocab_size;
  std::vector<float> logits(std::size_t(n - P + 1) * V);
  auto& book = eng.kv();
  const int slot = book.acquire_slot();
  book.ensure(slot, n);
  (void)eng.prefill(slot, std::span<const int>(prompt.data(), P), 0, std::span<float>(logits.data(), V));
  for (int i = P; i < n; ++i) {
    DecodeRow row{slot, prompt[i], i};
    int next = 0;
    eng.decode(std::span<const DecodeRow>(&row, 1), graph, std::span<int>(&next, 1),
               std::span<float>(logits.data() + std::size_t(i - P + 1) * V, V));
  }
  book.release(slot);
  return logits;
}

}  // namespace qwen
