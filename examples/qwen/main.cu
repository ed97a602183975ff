// examples/qwen/main.cu: the `qwen` CLI: generate with a Qwen3-shaped decoder, eagerly and from CUDA
// graphs, benchmark batch-1 TPOT and batched throughput, and dump teacher-forced logits for parity.
//
//   qwen --preset qwen3-0.6b --random-prompt 16 --gen 64 --mode both
//   qwen --model /path/to/hf_dir --prompt 1,2,3 --gen 32 --json out.json
//   qwen --preset qwen3-4b --bench --gen 128
//   qwen --preset qwen3-0.6b --gen 64 --tokens-per-launch 16   # device loop: 16 tokens per launch
//   qwen --preset tiny --demo                 # sequences join and finish at different steps
//   qwen --model dir --prompt ... --teacher-force 8 --dump-logits logits.f32
//   qwen --tokenizer dir/tokenizer.json --tokenize "Hello"     # text flags: text.hpp
//   qwen --model dir --chat "Why is the sky blue?" --gen 64
// Every flag is checked before any GPU work; bad input exits with code 2 and a message naming the flag.
#include "model.hpp"
#include "text.hpp"

#include <common/device.hpp>
#include <common/report.hpp>
#include <common/rng.hpp>
#include <common/safetensors.hpp>
#include <common/timing.hpp>
#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/inspect.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace qwen;
using json = nlohmann::json;

/// Comma-separated non-negative integers; `flag` names the option in errors.
std::vector<int> parse_ids(const std::string& s, const char* flag) {
  if (s.empty()) throw input_error(fmt::format("{}: empty list", flag));
  std::vector<int> out;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = s.find(',', begin);
    const std::string item = s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const std::size_t index = out.size();
    if (item.empty()) throw input_error(fmt::format("{}: empty entry at position {}", flag, index));
    if (item.find_first_not_of("0123456789") != std::string::npos)
      throw input_error(fmt::format("{}: '{}' at position {} is not a non-negative integer", flag, item, index));
    if (item.size() > 10 || std::stoll(item) > (1ll << 31) - 1)
      throw input_error(fmt::format("{}: {} at position {} is out of range", flag, item, index));
    out.push_back(static_cast<int>(std::stoll(item)));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

std::vector<int> random_prompt(int n, int vocab, std::uint64_t seed) {
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int>(replay_examples::random_bits(seed, i) % std::uint64_t(vocab));
  return p;
}

/// Result of running a set of sequences to completion.
struct RunResult {
  std::vector<std::vector<int>> tokens;  ///< generated tokens per sequence
  std::vector<double> step_us;           ///< host wall time of each decode step (push..read back)
  std::vector<int> step_rows;            ///< real rows of each decode step
  std::vector<int> step_bucket;          ///< rows run (bucket) of each decode step
  double prefill_ms = 0;                 ///< total prefill time
  double decode_s = 0;                   ///< total decode wall time
};

/// Runs `seqs` to completion: sequence i joins at step join[i] (prefilled then), decodes one token per
/// step with the others, and leaves (freeing its blocks) when it has generated its tokens.
RunResult run_schedule(Engine& eng, const std::vector<SequenceRequest>& seqs, const std::vector<int>& join,
                       bool graph, bool verbose) {
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
      if (verbose) fmt::print("  step {:4}: sequence {} joins (prompt {} tokens, generating {})\n", step, i, q.prompt.size(), q.generate);
      if (static_cast<int>(res.tokens[i].size()) >= q.generate) {
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
      st[i].next = next[k];
      ++st[i].pos;
      if (static_cast<int>(res.tokens[i].size()) >= seqs[i].generate) {
        st[i].done = true, ++finished;
        book.release(st[i].slot);
        st[i].slot = -1;
        if (verbose) fmt::print("  step {:4}: sequence {} finishes ({} tokens)\n", step, i, res.tokens[i].size());
      }
    }
  }
  return res;
}

/// Runs one sequence with the device loop: prefill, then one Engine::decode_loop launch per `k`
/// tokens (fewer for the last). step_us holds each launch's host wall time (push..read back)
/// divided by the tokens it produced: the time per token.
RunResult run_looped(Engine& eng, const SequenceRequest& q, int k) {
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
  int pos = static_cast<int>(q.prompt.size());
  std::vector<int> out(static_cast<std::size_t>(k));
  while (static_cast<int>(tokens.size()) < q.generate) {
    const int want = std::min(k, q.generate - static_cast<int>(tokens.size()));
    sw.restart();
    const int n = eng.decode_loop(slot, next, pos, want, /*stop_token=*/-1, out);
    const double us = sw.elapsed_us();
    res.step_us.push_back(us / n);
    res.decode_s += us * 1e-6;
    res.step_rows.push_back(1);
    res.step_bucket.push_back(1);
    tokens.insert(tokens.end(), out.begin(), out.begin() + n);
    next = out[n - 1];
    pos += n;
    if (n < want) break;  // the context is full (validate_request rules it out)
  }
  book.release(slot);
  return res;
}

/// Device-to-device copy bandwidth (bytes read + written per second), measured now.
double d2d_bandwidth(replay::stream_ref s) {
  const std::size_t bytes = 1ull << 30;
  replay::device_buffer<std::byte> a(bytes), b(bytes);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
  const double ms = replay_examples::median_gpu_ms(s, 10, [&] {
    REPLAY_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s.get()));
  });
  return 2.0 * bytes / (ms * 1e-3);
}

/// Read-only streaming bandwidth (bytes read per second) of launch_read_probe over 1 GiB, measured now.
double read_bandwidth(replay::stream_ref s) {
  const std::size_t bytes = 1ull << 30;
  replay::device_buffer<std::byte> a(bytes);
  replay::device_buffer<unsigned> sink(1);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
  const int sms = replay_examples::sm_count();
  const double ms = replay_examples::median_gpu_ms(s, 10, [&] { qwen::launch_read_probe(a.data(), bytes, sink.data(), sms, s); });
  return bytes / (ms * 1e-3);
}

/// The kernel-per-matrix floor of a batch-1 decode step, in ms of GPU time: one streaming-read kernel
/// (launch_read_link) per matrix, in the step's order and sizes (per layer QKV, a weightless link
/// where attention runs, O, gate/up, down; then lm_head), captured once as a graph and replayed;
/// median of 20 replays. What the step would cost if every kernel only streamed its weights, with
/// the same launches and PDL handoffs. 0 when the device has no room for a copy of the weights.
double chain_floor_ms(const qwen::Config& c, replay::stream_ref s) {
  const auto mats = c.layer_matrices();
  std::vector<std::size_t> sizes;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    for (std::size_t i = 0; i < mats.size(); ++i) {
      sizes.push_back(mats[i].params() * sizeof(qwen::bf16));
      if (i == 0) sizes.push_back(0);  // attention runs after the QKV projection
    }
  sizes.push_back(std::size_t(c.vocab_size) * c.hidden_size * sizeof(qwen::bf16));
  std::size_t total = 0;
  for (std::size_t b : sizes) total += b;
  std::size_t free_bytes = 0, device_bytes = 0;
  REPLAY_CHECK(cudaMemGetInfo(&free_bytes, &device_bytes));
  if (total + (512ull << 20) > free_bytes) return 0.0;
  replay::device_buffer<std::byte> w(total);
  replay::device_buffer<unsigned> sink(1);
  REPLAY_CHECK(cudaMemsetAsync(w.data(), 1, total, s.get()));
  const int sms = replay_examples::sm_count();
  const auto exec = replay::capture(s, [&](replay::stream_ref cs) {
                      std::size_t off = 0;
                      for (std::size_t b : sizes) {
                        qwen::launch_read_link(w.data() + off, b, sink.data(), sms, cs);
                        off += b;
                      }
                    }).instantiate({.upload_stream = s.get()});
  return replay_examples::median_gpu_ms(s, 20, [&] { exec.launch(s); });
}

double mib(double b) { return b / 1048576.0; }

/// Padding waste of the bucket policy if batch sizes 1..max are equally likely.
double uniform_padding_waste(const Engine& e, int max) {
  double real = 0, run = 0;
  for (int n = 1; n <= max; ++n) real += n, run += e.bucket_for(n);
  return 1.0 - real / run;
}


/// The command line: one field per flag, described by its help text in add_flags().
struct Args {
  std::string preset = "qwen3-0.6b", model_dir, prompt, mode = "both", bench_batches = "1,8,32,64";
  std::string json_path, dump_logits, dump_graph;
  long long random_prompt = 0, seed = 1234;
  int gen = 32, batch = 1, max_bucket = 64, max_context = 4096, teacher_force = -1, gemv_max_rows = 16;
  int bench_steps = 0, long_prompt = 4096, tokens_per_launch = 0;
  double kv_mb = 1024;
  bool bench = false, demo = false, no_fallback = false, quiet = false;
  TextOptions text;  ///< --tokenizer, --tokenize, --detokenize, --prompt-text, --chat, --system
};

void add_flags(CLI::App& app, Args& a) {
  app.add_option("--preset", a.preset, fmt::format("model shape: {} (random weights)", fmt::join(preset_names(), ", ")));
  app.add_option("--model", a.model_dir, "Hugging Face directory (config.json + model.safetensors[.index.json])");
  app.add_option("--prompt", a.prompt, "prompt token ids, comma-separated");
  app.add_option("--random-prompt", a.random_prompt, "random prompt of N tokens (when --prompt is not given)");
  app.add_option("--gen", a.gen, "tokens to generate per sequence (1..1048576)");
  app.add_option("--batch", a.batch, "sequences decoded together (1..1024)");
  app.add_option("--mode", a.mode, "eager, graph or both (both: checks identical tokens)")
      ->check(CLI::IsMember({"eager", "graph", "both"}));
  app.add_flag("--bench", a.bench, "benchmark: batch-1 TPOT against its floors, long context, batched throughput");
  app.add_option("--bench-steps", a.bench_steps, "decode steps timed per bench (default: --gen)");
  app.add_option("--bench-batches", a.bench_batches, "batch sizes of the throughput bench");
  app.add_option("--long-prompt", a.long_prompt, "prompt tokens of the long-context bench (0: skip it)");
  app.add_option("--tokens-per-launch", a.tokens_per_launch,
                 "batch 1, graph mode: decode K tokens per graph launch with a device loop (1..1024)");
  app.add_flag("--demo", a.demo, "staggered batch demo: sequences join and finish at different steps");
  app.add_option("--json", a.json_path, "write results as JSON to this file");
  app.add_option("--kv-mem-mb", a.kv_mb, "KV cache memory budget in MiB");
  app.add_option("--max-context", a.max_context, "tokens per sequence at most (prompt + generation)");
  app.add_option("--max-bucket", a.max_bucket, "largest graph bucket (batch rows)");
  app.add_option("--gemv-max-rows", a.gemv_max_rows,
                 "largest bucket on the fused GEMV: 0, 1, 2, 4, 8 or 16 (larger: cuBLAS)");
  app.add_flag("--no-eager-fallback", a.no_fallback, "fail instead of running batches above the largest bucket eagerly");
  app.add_option("--teacher-force", a.teacher_force,
                 "parity mode: prefill the first N prompt tokens, then feed the rest one per step");
  app.add_option("--dump-logits", a.dump_logits, "parity mode: write the logits of every step (float32, steps x vocab)");
  app.add_option("--seed", a.seed, "seed of random weights and prompts (non-negative)");
  app.add_flag("--quiet", a.quiet, "print less");
  app.add_option("--dump-graph", a.dump_graph,
                 "write bucket 1's decode-step graph to PATH: DOT if it ends in .dot, else JSON");
  add_text_flags(app, a.text);
}

/// What a run needs, built from the flags and checked on the host before any GPU work.
struct Setup {
  Config cfg;
  std::optional<replay_examples::safetensors> weights;  ///< empty: random weights
  EngineOptions opt;
  std::uint64_t seed = 0;
  std::vector<int> prompt;
  std::vector<SequenceRequest> seqs;  ///< the sequences of a generation, demo or parity run
  std::vector<int> join;              ///< the step at which each sequence joins
  std::vector<int> bench_batches;
  int steps = 0;                      ///< decode steps per bench
  std::vector<std::string> modes;     ///< "eager", "graph" or both, in that order
};

/// Checks every flag and builds the Setup; throws input_error naming the flag.
Setup prepare(Args& a, const CLI::App& app) {
  if (a.gen < 1 || a.gen > (1 << 20)) throw input_error(fmt::format("--gen {} must be in 1..1048576", a.gen));
  if (a.batch < 1 || a.batch > 1024) throw input_error(fmt::format("--batch {} must be in 1..1024", a.batch));
  if (a.max_context < 2 || a.max_context > (1 << 24))
    throw input_error(fmt::format("--max-context {} must be in 2..16777216", a.max_context));
  if (a.max_bucket < 1 || a.max_bucket > 1024)
    throw input_error(fmt::format("--max-bucket {} must be in 1..1024", a.max_bucket));
  if (!std::isfinite(a.kv_mb) || a.kv_mb <= 0 || a.kv_mb > double(1 << 24))
    throw input_error(fmt::format("--kv-mem-mb {} must be a positive number of MiB, at most 16777216", a.kv_mb));
  if (a.seed < 0) throw input_error(fmt::format("--seed {} must be non-negative", a.seed));
  if (a.random_prompt < 0 || a.random_prompt > a.max_context)
    throw input_error(
        fmt::format("--random-prompt {} must be in 0..--max-context ({})", a.random_prompt, a.max_context));
  if (app.count("--prompt") > 0 && a.prompt.empty()) throw input_error("--prompt: empty prompt");
  if (a.bench_steps < 0 || a.bench_steps > (1 << 20)) throw input_error("--bench-steps must be in 0..1048576");
  if (a.long_prompt < 0 || a.long_prompt > (1 << 24)) throw input_error("--long-prompt must be in 0..16777216");
  if (app.count("--tokens-per-launch") > 0) {
    if (a.tokens_per_launch < 1 || a.tokens_per_launch > kMaxTokensPerLaunch)
      throw input_error(
          fmt::format("--tokens-per-launch {} must be in 1..{}", a.tokens_per_launch, kMaxTokensPerLaunch));
    if (a.batch != 1)
      throw input_error(fmt::format("--tokens-per-launch decodes one sequence: it needs --batch 1 (got {})", a.batch));
    if (a.demo || a.teacher_force >= 0)
      throw input_error("--tokens-per-launch does not combine with --demo or --teacher-force");
    if (a.mode == "eager") throw input_error("--tokens-per-launch is a graph path: use --mode graph or both");
  }
  if (app.count("--model") != 0 && a.model_dir.empty()) throw input_error("--model: the path is empty");

  Setup s;
  s.seed = static_cast<std::uint64_t>(a.seed);
  if (!a.model_dir.empty()) {
    s.cfg = config_from_file(a.model_dir);
    try {
      s.weights = replay_examples::safetensors::open(a.model_dir);
    } catch (const replay_examples::safetensors_error& e) {
      throw input_error(fmt::format("weights: {}", e.what()));
    }
    check_weights(s.cfg, *s.weights);
  } else {
    s.cfg = qwen::preset(a.preset);
  }
  const Config& cfg = s.cfg;
  s.steps = a.bench_steps > 0 ? a.bench_steps : a.gen;
  if (a.bench && a.long_prompt > 0) a.max_context = std::max(a.max_context, a.long_prompt + s.steps + 2);
  if (app.count("--max-context") == 0) a.max_context = std::min(a.max_context, cfg.max_position_embeddings);
  if (a.max_context > cfg.max_position_embeddings)
    throw input_error(fmt::format("--max-context {} exceeds the model's max_position_embeddings {}", a.max_context,
                                  cfg.max_position_embeddings));
  EngineOptions& opt = s.opt;
  opt.max_bucket = a.max_bucket;
  opt.eager_fallback = !a.no_fallback;
  opt.kv_budget_bytes = static_cast<std::size_t>(a.kv_mb * 1048576.0);
  opt.max_context = a.max_context;
  opt.seed = s.seed;
  opt.gemv_max_rows = a.gemv_max_rows;

  const bool text_prompt = text_prompt_requested(app);
  if (text_prompt) s.prompt = text_prompt_ids(app, a.text, a.model_dir);
  else if (!a.prompt.empty()) s.prompt = parse_ids(a.prompt, "--prompt");
  else s.prompt = random_prompt(a.random_prompt > 0 ? static_cast<int>(a.random_prompt) : 8, cfg.vocab_size, s.seed);
  const auto& prompt = s.prompt;

  if (a.bench) s.bench_batches = parse_ids(a.bench_batches, "--bench-batches");
  if (a.teacher_force >= 0) {
    if (a.teacher_force < 1 || a.teacher_force > static_cast<int>(prompt.size()))
      throw input_error(
          fmt::format("--teacher-force {} must be in 1..prompt length {}", a.teacher_force, prompt.size()));
    s.seqs.push_back({prompt, 1});
  } else if (a.demo) {
    // Sequences of different prompt and output lengths joining at different steps.
    const int n = std::max(a.batch, 12);
    for (int i = 0; i < n; ++i) {
      s.seqs.push_back({random_prompt(4 + 3 * (i % 7), cfg.vocab_size, s.seed + 100 + i), 6 + (i * 7) % 23});
      s.join.push_back(i < 4 ? 0 : 2 * (i - 3));
    }
  } else {
    for (int i = 0; i < a.batch; ++i) {
      s.seqs.push_back({i == 0 || !a.prompt.empty() || text_prompt
                            ? prompt
                            : random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, s.seed + i),
                        a.gen});
      s.join.push_back(0);
    }
  }
  opt.max_batch = std::max(64, static_cast<int>(s.seqs.size()));
  for (int b : s.bench_batches) opt.max_batch = std::max(opt.max_batch, b);
  if (a.bench && app.count("--kv-mem-mb") == 0) {
    // The bench's largest request (a full batch of short prompts, or the long prompt) sizes the KV budget.
    const std::int64_t per_seq = (std::int64_t(prompt.size()) + s.steps + 1 + opt.block_size - 1) / opt.block_size;
    std::int64_t blocks = 0;
    for (int b : s.bench_batches) blocks = std::max(blocks, b * per_seq);
    blocks = std::max(blocks, (std::int64_t(a.long_prompt) + s.steps + 1 + opt.block_size - 1) / opt.block_size);
    opt.kv_budget_bytes = std::max(opt.kv_budget_bytes, std::size_t(blocks + 2) * kv_block_bytes(cfg, opt.block_size));
  }
  validate_request(cfg, opt, s.seqs);
  if (a.bench) {
    std::vector<SequenceRequest> bseqs;
    for (int b : s.bench_batches) {
      if (b < 1 || b > 1024) throw input_error("--bench-batches: batch sizes must be in 1..1024");
      bseqs.assign(b, SequenceRequest{prompt, s.steps + 1});
      validate_request(cfg, opt, bseqs);
    }
    if (a.long_prompt > 0)
      validate_request(cfg, opt, {SequenceRequest{std::vector<int>(a.long_prompt, 0), s.steps + 1}});
  }
  if (a.mode == "both") s.modes = {"eager", "graph"};
  else s.modes = {a.mode};
  return s;
}

/// Parity mode: the logits after the first `teacher_force` prompt tokens (prefill), then after each
/// further prompt token fed as a decode step, in each mode; eager and graph must agree bit for bit.
/// Returns the exit code.
int run_parity(Engine& eng, const Args& a, const Setup& s, json& out) {
  const int P = a.teacher_force, n = static_cast<int>(s.prompt.size()), V = s.cfg.vocab_size;
  std::vector<std::vector<float>> per_mode;
  for (const auto& m : s.modes) {
    std::vector<float> logits(std::size_t(n - P + 1) * V);
    auto& book = eng.kv();
    const int slot = book.acquire_slot();
    book.ensure(slot, n);
    (void)eng.prefill(slot, std::span<const int>(s.prompt.data(), P), 0, std::span<float>(logits.data(), V));
    for (int i = P; i < n; ++i) {
      DecodeRow row{slot, s.prompt[i], i};
      int next = 0;
      eng.decode(std::span<const DecodeRow>(&row, 1), m == "graph", std::span<int>(&next, 1),
                 std::span<float>(logits.data() + std::size_t(i - P + 1) * V, V));
    }
    book.release(slot);
    per_mode.push_back(std::move(logits));
  }
  int rc = 0;
  if (per_mode.size() == 2) {
    const bool same = per_mode[0] == per_mode[1];
    out["parity_eager_graph_logits_identical"] = same;
    fmt::print("teacher-forced logits eager vs graph: {}\n", same ? "bit-identical" : "DIFFERENT");
    if (!same) rc = 1;
  }
  if (!a.dump_logits.empty()) {
    std::ofstream f(a.dump_logits, std::ios::binary);
    f.write(reinterpret_cast<const char*>(per_mode.back().data()),
            static_cast<std::streamsize>(per_mode.back().size() * sizeof(float)));
    if (!f) throw input_error("cannot write " + a.dump_logits);
    fmt::print("wrote {} steps x {} logits to {}\n", n - P + 1, V, a.dump_logits);
  }
  return rc;
}

/// Generation (and the staggered demo): the sequences in each mode; eager and graph must give the
/// same tokens. Returns the exit code.
int run_generation(Engine& eng, const Args& a, const Setup& s, json& out) {
  std::vector<RunResult> results;
  for (const auto& m : s.modes) {
    const bool looped = m == "graph" && a.tokens_per_launch > 0;  // batch 1 (checked by prepare)
    if (!a.quiet && looped) fmt::print("[{}] 1 sequence, device loop, {} tokens per launch\n", m, a.tokens_per_launch);
    else if (!a.quiet) fmt::print("[{}] {} sequence(s)\n", m, s.seqs.size());
    results.push_back(looped ? run_looped(eng, s.seqs[0], a.tokens_per_launch)
                             : run_schedule(eng, s.seqs, s.join, m == "graph", a.demo && !a.quiet));
    const auto& r = results.back();
    const auto st = replay_examples::summarize(r.step_us);
    if (!a.quiet) {
      for (std::size_t i = 0; i < s.seqs.size() && i < 4; ++i)
        fmt::print("  seq {}: {}{}\n", i,
                   fmt::join(r.tokens[i].begin(), r.tokens[i].begin() + std::min<std::size_t>(r.tokens[i].size(), 24), ","),
                   r.tokens[i].size() > 24 ? ",..." : "");
      if (looped)
        fmt::print("  {} launches, median {:.1f} us per token, prefill {:.1f} ms\n", st.count, st.median, r.prefill_ms);
      else
        fmt::print("  {} decode steps, median step {:.1f} us, prefill {:.1f} ms\n", st.count, st.median, r.prefill_ms);
    }
    if (looped) out[m]["tokens_per_launch"] = a.tokens_per_launch;
    out[m]["tokens"] = r.tokens;
    out[m]["median_step_us"] = st.median;
    out[m]["decode_steps"] = st.count;
    out[m]["step_buckets"] = r.step_bucket;
    out[m]["step_rows"] = r.step_rows;
  }
  int rc = 0;
  if (results.size() == 2) {
    const bool same = results[0].tokens == results[1].tokens;
    out["identical_tokens"] = same;
    fmt::print("eager vs graph tokens: {}\n", same ? "identical" : "DIFFERENT");
    if (!same) rc = 1;
  }
  if (a.demo) {
    const auto& r = results.back();
    long long real = 0, run = 0;
    std::set<int> bs(r.step_bucket.begin(), r.step_bucket.end());
    for (std::size_t i = 0; i < r.step_rows.size(); ++i) real += r.step_rows[i], run += r.step_bucket[i];
    fmt::print("demo: {} steps, buckets used {}, padding waste {:.1f}% ({} padded rows of {})\n", r.step_rows.size(),
               fmt::join(bs, ","), 100.0 * (run - real) / run, run - real, run);
    out["demo"] = {{"buckets_used", std::vector<int>(bs.begin(), bs.end())}, {"padding_waste", double(run - real) / run}};
  }
  return rc;
}

/// The benchmark: batch-1 TPOT per mode and of the device loop against the bytes floor and the
/// kernel-per-matrix chain floor (both measured now), batch 1 after a long prompt, batched throughput.
void run_bench(Engine& eng, const Args& a, const Setup& s, const std::string& dev, json& out) {
  const Config& cfg = s.cfg;
  const auto& prompt = s.prompt;
  const int steps = s.steps;
  const bool graph = std::find(s.modes.begin(), s.modes.end(), "graph") != s.modes.end();
  if (graph) {
    replay_examples::stopwatch sw;
    const std::size_t n = eng.prewarm_graphs();  // every bucket captured up front, largest first
    fmt::print("prewarm: {} graphs captured in {:.1f} ms\n", n, sw.elapsed_ms());
  }
  const double bw = d2d_bandwidth(eng.stream());
  const double wbytes = static_cast<double>(cfg.decode_weight_bytes());
  fmt::print("\n## Batch-1 decode, {} ({}), {} prompt tokens, {} steps\n", cfg.name, dev, prompt.size(), steps);
  const double rbw = read_bandwidth(eng.stream());
  fmt::print("weights read per step: {:.1f} MiB; D2D copy bandwidth: {:.0f} GB/s (read + write); bytes floor {:.3f} ms\n",
             mib(wbytes), bw / 1e9, wbytes / bw * 1e3);
  fmt::print("read-only streaming kernel: {:.0f} GB/s ({:.1f}% of D2D); at that rate the weights take {:.3f} ms\n",
             rbw / 1e9, 100.0 * rbw / bw, wbytes / rbw * 1e3);
  const double chain_ms = chain_floor_ms(cfg, eng.stream());
  if (chain_ms > 0)
    fmt::print("kernel-per-matrix chain floor (a graph of {} streaming-read kernels with this step's matrix sizes, "
               "PDL): {:.3f} ms\n",
               5 * cfg.num_hidden_layers + 1, chain_ms);
  else
    fmt::print("kernel-per-matrix chain floor: skipped (no device memory for a copy of the weights)\n");
  replay_examples::table t({"mode", "TPOT median (ms)", "p10 (ms)", "p90 (ms)", "tokens/s", "% of D2D",
                            "x bytes floor", "x chain floor"});
  double tpot_graph_ms = 0;
  auto add_tpot_row = [&](const std::string& name, const replay_examples::stats& st) {
    const double tpot = st.median * 1e-6;
    t.add_row({name, fmt::format("{:.3f}", st.median / 1e3), fmt::format("{:.3f}", st.p10 / 1e3),
               fmt::format("{:.3f}", st.p90 / 1e3), fmt::format("{:.1f}", 1.0 / tpot),
               fmt::format("{:.1f}", 100.0 * wbytes / tpot / bw), fmt::format("{:.2f}", tpot / (wbytes / bw)),
               chain_ms > 0 ? fmt::format("{:.2f}", st.median / 1e3 / chain_ms) : std::string("-")});
    out["bench"]["batch1"][name] = {{"tpot_ms", st.median / 1e3}, {"p10_ms", st.p10 / 1e3}, {"p90_ms", st.p90 / 1e3},
                                    {"tokens_per_s", 1.0 / tpot}, {"eff_bw_GBps", wbytes / tpot / 1e9},
                                    {"pct_d2d", 100.0 * wbytes / tpot / bw}};
  };
  for (const auto& m : s.modes) {
    std::vector<SequenceRequest> one{{prompt, steps + 1}};
    (void)run_schedule(eng, std::vector<SequenceRequest>{{prompt, 4}}, {0}, m == "graph", false);  // warm-up
    const auto r = run_schedule(eng, one, {0}, m == "graph", false);
    const auto st = replay_examples::summarize(r.step_us);
    if (m == "graph") tpot_graph_ms = st.median / 1e3;
    add_tpot_row(m, st);
  }
  if (tpot_graph_ms > 0) {
    // The device loop at K = 1 and K = 16 tokens per launch: per token, the host wall time of a
    // launch (push, launch, read back) over the tokens it produced; `steps` samples each (the same
    // sequence rerun as often as needed), median.
    double loop_us[2] = {0, 0};
    const int ks[2] = {1, 16};
    for (int i = 0; i < 2; ++i) {
      (void)run_looped(eng, SequenceRequest{prompt, 4}, ks[i]);  // warm-up (the first captures the loop)
      std::vector<double> per_token;
      for (int rep = 0; rep < 64 && per_token.size() < static_cast<std::size_t>(steps); ++rep) {
        const auto r = run_looped(eng, SequenceRequest{prompt, steps + 1}, ks[i]);
        per_token.insert(per_token.end(), r.step_us.begin(), r.step_us.end());
      }
      const auto st = replay_examples::summarize(per_token);
      loop_us[i] = st.median;
      add_tpot_row(fmt::format("loop K={}", ks[i]), st);
    }
    // Per token, a launch of K tokens costs about d + h / K: d on the device, h on the host once
    // per launch (the metadata push, the launch, the wait for the read-back).
    const double h = (loop_us[0] - loop_us[1]) * 16.0 / 15.0, d = loop_us[0] - h;
    fmt::print("device loop per token: K=1 {:.1f} us, K=16 {:.1f} us, per-step graph {:.1f} us; as d + h/K: "
               "device d = {:.1f} us, host share per launch h = {:.1f} us (K=16 pays {:.1f} us of it per token)\n",
               loop_us[0], loop_us[1], tpot_graph_ms * 1e3, d, h, h / 16.0);
    out["bench"]["loop_fit"] = {{"device_us_per_token", d}, {"host_us_per_launch", h}};
  }
  out["bench"]["d2d_GBps"] = bw / 1e9;
  out["bench"]["read_GBps"] = rbw / 1e9;
  out["bench"]["bytes_floor_ms"] = wbytes / bw * 1e3;
  if (chain_ms > 0) out["bench"]["chain_floor_ms"] = chain_ms;
  out["bench"]["weight_bytes_per_step"] = wbytes;
  fmt::print("{}", t.markdown());

  if (a.long_prompt > 0) {
    // Batch 1 after a long prompt: each step also reads the sequence's K/V (every layer, K and V).
    const std::vector<int> lp = random_prompt(a.long_prompt, cfg.vocab_size, s.seed + 99);
    const auto r = run_schedule(eng, {SequenceRequest{lp, steps + 1}}, {0}, true, false);
    const auto st = replay_examples::summarize(r.step_us);
    const double kv_per_token = 2.0 * cfg.num_hidden_layers * cfg.kv_dim() * sizeof(bf16);
    const double kv_bytes = kv_per_token * (a.long_prompt + steps / 2.0);  // mean context over the steps
    const double floor_ms = (wbytes + kv_bytes) / bw * 1e3;
    fmt::print("\n## Long context: batch 1 (graph) after a {}-token prompt, {} steps\n"
               "TPOT median {:.3f} ms; bytes floor (weights + {:.1f} MiB of K/V per step) {:.3f} ms: {:.2f}x\n",
               a.long_prompt, steps, st.median / 1e3, mib(kv_bytes), floor_ms, st.median / 1e3 / floor_ms);
    out["bench"]["long_context"] = {{"prompt", a.long_prompt}, {"tpot_ms", st.median / 1e3},
                                    {"kv_bytes_per_step", kv_bytes}, {"bytes_floor_ms", floor_ms}};
  }

  replay_examples::table tb({"batch", "bucket", "mode", "step median (ms)", "tokens/s", "x batch-1 graph TPOT"});
  for (int b : s.bench_batches) {
    for (const auto& m : s.modes) {
      std::vector<SequenceRequest> bs;
      for (int i = 0; i < b; ++i)
        bs.push_back({random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, s.seed + 7 * i), steps + 1});
      std::vector<int> j(b, 0);
      (void)run_schedule(eng, bs, j, m == "graph", false);
      const auto r = run_schedule(eng, bs, j, m == "graph", false);
      const auto st = replay_examples::summarize(r.step_us);
      tb.add_row({std::to_string(b), std::to_string(eng.bucket_for(b)), m, fmt::format("{:.3f}", st.median / 1e3),
                  fmt::format("{:.0f}", b / (st.median * 1e-6)),
                  tpot_graph_ms > 0 ? fmt::format("{:.2f}", st.median / 1e3 / tpot_graph_ms) : std::string("-")});
      out["bench"]["batched"][m][std::to_string(b)] = {
          {"step_ms", st.median / 1e3}, {"tokens_per_s", b / (st.median * 1e-6)}, {"bucket", eng.bucket_for(b)}};
    }
  }
  fmt::print("\n## Batched decode ({} steps, prompt {} tokens)\n{}", steps, prompt.size(), tb.markdown());
  const int largest = eng.buckets().back();
  const double waste = uniform_padding_waste(eng, largest);
  fmt::print("bucket policy: powers of two up to {}; padding waste for batch sizes 1..{} equally likely: {:.1f}%\n",
             largest, largest, 100.0 * waste);
  out["bench"]["uniform_padding_waste"] = waste;
}

/// The memory report: weights, KV pool, buffers and the captured graphs, and the graph counters.
void report_memory(const Engine& eng, bool quiet, json& out) {
  const auto gs = eng.graph_stats();
  out["memory"] = {{"weights_bytes", eng.weight_bytes()}, {"kv_pool_bytes", eng.kv_pool_bytes()},
                   {"buffers_bytes", eng.buffer_bytes()}, {"graphs_bytes", gs.graph_bytes}};
  json kpb = json::object();
  for (const auto& [b, k] : gs.nodes_per_bucket) kpb[std::to_string(b)] = k;
  out["pool"] = json::parse(eng.pool_stats().to_json());
  out["graphs"] = {{"captures", gs.captures}, {"replays", gs.replays}, {"eager_steps", gs.eager_steps},
                   {"fallback_steps", gs.fallback_steps}, {"nodes_per_bucket", kpb},
                   {"padded_rows", gs.padded_rows}, {"real_rows", gs.real_rows}};
  if (quiet) return;
  std::string kp;
  for (const auto& [b, k] : gs.nodes_per_bucket) kp += fmt::format(" {}:{}", b, k);
  fmt::print("memory: weights {:.1f} MiB, KV pool {:.1f} MiB, buffers {:.1f} MiB, graphs {:.2f} MiB ({} captured; "
             "nodes per bucket{})\n",
             mib(eng.weight_bytes()), mib(eng.kv_pool_bytes()), mib(eng.buffer_bytes()), mib(gs.graph_bytes),
             gs.captures, kp);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Qwen3-style decoder with a paged KV cache: eager and CUDA-graph decode"};
  Args a;
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  if (text_tool_requested(app)) return run_text_tool(app, a.text);  // host only, no CUDA
  try {
    const Setup s = prepare(a, app);  // host only: bad input fails before any GPU work
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
      fmt::print(stderr, "error: no CUDA device\n");
      return 3;
    }
    const std::string dev = replay_examples::device_name();
    const Config& cfg = s.cfg;
    replay_examples::stopwatch load_sw;
    Engine eng(cfg, s.opt, s.weights ? &*s.weights : nullptr);
    const double load_ms = load_sw.elapsed_ms();
    if (!a.dump_graph.empty()) {
      const replay::graph g = replay::capture(eng.stream(), [&](replay::stream_ref cs) { eng.record_decode_step(1, cs); });
      replay::write_graph_summary(g, a.dump_graph);
    }
    json out;
    out["device"] = dev;
    out["model"] = cfg.name;
    out["weights"] = a.model_dir.empty() ? "random" : a.model_dir;
    out["load_ms"] = load_ms;
    out["kernels"] = eng.describe_kernels();
    if (!a.quiet)
      fmt::print("device: {}\nmodel: {} ({} layers, hidden {}, {} q / {} kv heads, vocab {}), weights {}, {:.1f} MiB; "
                 "KV pool {} blocks x {} tokens = {:.1f} MiB\n{}\n",
                 dev, cfg.name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                 cfg.num_key_value_heads, cfg.vocab_size, a.model_dir.empty() ? "random" : a.model_dir,
                 mib(eng.weight_bytes()), eng.kv().num_blocks(), eng.kv().block_size(), mib(eng.kv_pool_bytes()),
                 eng.describe_kernels());

    int rc = 0;
    if (a.teacher_force >= 0) rc = run_parity(eng, a, s, out);
    else if (!a.bench || a.demo) rc = run_generation(eng, a, s, out);
    if (a.bench) run_bench(eng, a, s, dev, out);
    report_memory(eng, a.quiet, out);
    if (!a.json_path.empty()) {
      std::ofstream f(a.json_path);
      f << out.dump(2) << "\n";
      if (!f) throw input_error("cannot write " + a.json_path);
    }
    return rc;
  } catch (const input_error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const replay_examples::safetensors_error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "fatal: {}\n", e.what());
    return 1;
  }
}
