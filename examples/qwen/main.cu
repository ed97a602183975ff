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
//   qwen --preset qwen3-32b --tp 4 --bench --bench-batches 1,8   # tensor parallel over 4 GPUs (NCCL)
// Every flag is checked before any GPU work; bad input exits with code 2 and a message naming the flag.
#include "bench.hpp"
#include "model.hpp"
#include "schedule.hpp"
#include "text.hpp"
#if QWEN_WITH_NCCL
#  include "tp.hpp"
#endif

#include <common/device.hpp>
#include <common/report.hpp>
#include <common/safetensors.hpp>
#include <common/timing.hpp>
#include <replay/capture.hpp>
#include <replay/inspect.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace qwen;
using json = nlohmann::json;

/// The command line: one field per flag, described by its help text in add_flags().
struct Args {
  std::string preset = "qwen3-0.6b", model_dir, prompt, mode = "both", bench_batches = "1,8,32,64";
  std::string bench_prefill = "512,4096";
  std::string json_path, dump_logits, dump_graph;
  long long random_prompt = 0, seed = 1234;
  int gen = 32, batch = 1, max_bucket = 64, max_context = 4096, teacher_force = -1, gemv_max_rows = 16,
      attn_min_chunk = 128;
  int bench_steps = 0, long_prompt = 4096, tokens_per_launch = 0, tp = 1;
  std::string tp_sum = "one-shot";
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
  app.add_option("--bench-prefill", a.bench_prefill, "prompt lengths of the prefill bench, comma-separated (0: skip it)");
  app.add_option("--tokens-per-launch", a.tokens_per_launch,
                 "batch 1, graph mode: decode K tokens per graph launch with a device loop (1..1024)");
  app.add_flag("--demo", a.demo, "staggered batch demo: sequences join and finish at different steps");
  app.add_option("--json", a.json_path, "write results as JSON to this file");
  app.add_option("--kv-mem-mb", a.kv_mb, "KV cache memory budget in MiB");
  app.add_option("--max-context", a.max_context, "tokens per sequence at most (prompt + generation)");
  app.add_option("--max-bucket", a.max_bucket, "largest graph bucket (batch rows)");
  app.add_option("--gemv-max-rows", a.gemv_max_rows,
                 "largest bucket on the fused GEMV: 0, 1, 2, 4, 8 or 16 (larger: cuBLAS)");
  app.add_option("--attn-min-chunk", a.attn_min_chunk,
                 "split-KV decode attention: positions per block at least (a multiple of 64)");
  app.add_flag("--no-eager-fallback", a.no_fallback, "fail instead of running batches above the largest bucket eagerly");
  app.add_option("--teacher-force", a.teacher_force,
                 "parity mode: prefill the first N prompt tokens, then feed the rest one per step");
  app.add_option("--dump-logits", a.dump_logits, "parity mode: write the logits of every step (float32, steps x vocab)");
  app.add_option("--seed", a.seed, "seed of random weights and prompts (non-negative)");
  app.add_flag("--quiet", a.quiet, "print less");
  app.add_option("--dump-graph", a.dump_graph,
                 "write bucket 1's decode-step graph to PATH: DOT if it ends in .dot, else JSON");
  app.add_option("--tp", a.tp, "tensor parallel over N GPUs (devices 0..N-1, NCCL); 1: one GPU");
  app.add_option("--tp-sum", a.tp_sum,
                 "tensor parallel: how the ranks' O and down products are summed: one-shot (a kernel reading "
                 "every GPU's product over peer memory) or nccl (ncclAllReduce)")
      ->check(CLI::IsMember({"one-shot", "nccl"}));
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
  BenchOptions bench;                 ///< --bench: what it runs
  std::vector<std::string> modes;     ///< "eager", "graph" or both, in that order
  SampleParams sample;                ///< --temperature, --top-k, --top-p, --sample-seed
  std::optional<TextSession> text;    ///< a text prompt: its tokenizer prints the output as text
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
  if (a.attn_min_chunk < 64 || a.attn_min_chunk > (1 << 24) || a.attn_min_chunk % 64 != 0)
    throw input_error(
        fmt::format("--attn-min-chunk {} must be a positive multiple of 64, at most 16777216", a.attn_min_chunk));
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
  if (a.tp > 1 && app.count("--tokens-per-launch") > 0)
    throw input_error("--tokens-per-launch runs on one GPU (the device loop): it does not combine with --tp");
  if (a.tp > 1 && !a.dump_graph.empty()) throw input_error("--dump-graph shows one GPU's step: it does not combine with --tp");

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
  int devices = 0;  // the one device query before any GPU work: how many GPUs --tp may use
  if (a.tp > 1 && cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  check_tp_request(cfg, a.tp, devices, QWEN_WITH_NCCL != 0);
  s.bench.steps = a.bench_steps > 0 ? a.bench_steps : a.gen;
  s.bench.long_prompt = a.long_prompt;
  if (a.bench && a.long_prompt > 0) a.max_context = std::max(a.max_context, a.long_prompt + s.bench.steps + 2);
  if (a.bench)
    for (int n : parse_ids(a.bench_prefill, "--bench-prefill"))
      if (n > 0) s.bench.prefill.push_back(n), a.max_context = std::max(a.max_context, n);
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
  opt.attn_min_chunk = a.attn_min_chunk;
  opt.tp_size = a.tp;  // the KV budget is per GPU; each GPU holds 1/tp of the kv heads
  opt.tp_sum = a.tp_sum == "nccl" ? TpSum::nccl : TpSum::one_shot;

  s.sample = sampling_from_flags(a.text);
  opt.sampling = s.sample.temperature > 0;  // the head then writes logits for the sampler
  const bool text_prompt = text_prompt_requested(app);
  if (text_prompt) s.text = text_session(app, a.text, a.model_dir), s.prompt = s.text->prompt;
  else if (!a.prompt.empty()) s.prompt = parse_ids(a.prompt, "--prompt");
  else s.prompt = random_prompt(a.random_prompt > 0 ? static_cast<int>(a.random_prompt) : 8, cfg.vocab_size, s.seed);
  const auto& prompt = s.prompt;
  s.bench.prompt = s.prompt;
  s.bench.seed = s.seed;

  if (a.bench) s.bench.batches = parse_ids(a.bench_batches, "--bench-batches");
  if (a.teacher_force >= 0) {
    if (a.teacher_force < 1 || a.teacher_force > static_cast<int>(prompt.size()))
      throw input_error(
          fmt::format("--teacher-force {} must be in 1..prompt length {}", a.teacher_force, prompt.size()));
    s.seqs.push_back({prompt, 1});
  } else if (a.demo) {
    demo_requests(std::max(a.batch, 12), cfg.vocab_size, s.seed, s.seqs, s.join);
  } else {
    for (int i = 0; i < a.batch; ++i) {
      s.seqs.push_back({i == 0 || !a.prompt.empty() || text_prompt
                            ? prompt
                            : random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, s.seed + i),
                        a.gen, s.text ? s.text->stop : std::vector<int>{}});
      s.join.push_back(0);
    }
  }
  opt.max_batch = std::max(64, static_cast<int>(s.seqs.size()));
  if (a.bench) size_for_bench(cfg, s.bench, /*size_kv=*/app.count("--kv-mem-mb") == 0, opt);
  validate_request(cfg, opt, s.seqs);
  if (a.bench) validate_bench(cfg, opt, s.bench);
  if (a.mode == "both") s.modes = {"eager", "graph"};
  else s.modes = {a.mode};
  s.bench.modes = s.modes;
  return s;
}

/// Parity mode: the logits after the first `teacher_force` prompt tokens (prefill), then after each
/// further prompt token fed as a decode step, in each mode; eager and graph must agree bit for bit.
/// Returns the exit code.
int run_parity(Decoder& eng, const Args& a, const Setup& s, json& out) {
  const int P = a.teacher_force, n = static_cast<int>(s.prompt.size()), V = s.cfg.vocab_size;
  std::vector<std::vector<float>> per_mode;
  for (const auto& m : s.modes) per_mode.push_back(teacher_forced_logits(eng, s.prompt, P, m == "graph"));
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
int run_generation(Decoder& eng, const Args& a, const Setup& s, json& out) {
  std::vector<RunResult> results;
  for (const auto& m : s.modes) {
    const bool looped = m == "graph" && a.tokens_per_launch > 0;  // batch 1 (checked by prepare)
    if (!a.quiet && looped) fmt::print("[{}] 1 sequence, device loop, {} tokens per launch\n", m, a.tokens_per_launch);
    else if (!a.quiet) fmt::print("[{}] {} sequence(s)\n", m, s.seqs.size());
    std::optional<TextPrinter> text;  // a text prompt: sequence 0 printed as text while it is generated
    if (s.text && !a.quiet) text.emplace(s.text->tokenizer);
    const TokenSink sink = [&](int seq, int token) { if (text && seq == 0) text->token(token); };
    results.push_back(looped ? run_looped(eng, s.seqs[0], a.tokens_per_launch, sink)
                             : run_schedule(eng, s.seqs, s.join, m == "graph", a.demo && !a.quiet, sink));
    if (text) text->finish();
    const auto& r = results.back();
    const auto st = replay_examples::summarize(r.step_us);
    const bool cold = results.size() == 1;  // the first prefill of the process
    if (!a.quiet) {
      for (std::size_t i = 0; i < s.seqs.size() && i < 4; ++i)
        fmt::print("  seq {}: {}{}\n", i,
                   fmt::join(r.tokens[i].begin(), r.tokens[i].begin() + std::min<std::size_t>(r.tokens[i].size(), 24), ","),
                   r.tokens[i].size() > 24 ? ",..." : "");
      if (looped)
        fmt::print("  {} launches, median {:.1f} us per token, prefill {:.1f} ms\n", st.count, st.median, r.prefill_ms);
      else
        fmt::print("  {} decode steps, median step {:.1f} us, prefill {:.1f} ms{}\n", st.count, st.median, r.prefill_ms,
                   cold ? " (includes the process's first prefill: one-time CUDA/cuBLAS setup; --bench times "
                          "prefill warm)"
                        : "");
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
    const BucketUse u = bucket_use(results.back());
    fmt::print("demo: {} steps, buckets used {}, padding waste {:.1f}% ({} padded rows of {})\n", u.steps,
               fmt::join(u.buckets, ","), 100.0 * (u.run - u.real) / u.run, u.run - u.real, u.run);
    out["demo"] = {{"buckets_used", u.buckets}, {"padding_waste", double(u.run - u.real) / u.run}};
  }
  return rc;
}

/// The engine for the run: one GPU, or tensor parallel over devices 0..tp-1.
std::unique_ptr<Decoder> make_engine(const Setup& s, int tp) {
  const replay_examples::safetensors* w = s.weights ? &*s.weights : nullptr;
#if QWEN_WITH_NCCL
  if (tp > 1) return std::make_unique<TpEngine>(s.cfg, s.opt, w, tp);
#endif
  if (tp > 1) throw input_error("--tp: this build has no NCCL");  // check_tp_request refused it already
  return std::make_unique<Engine>(s.cfg, s.opt, w);
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
    const std::unique_ptr<Decoder> engine = make_engine(s, a.tp);
    Decoder& eng = *engine;
    eng.set_sampling(s.sample);
    const double load_ms = load_sw.elapsed_ms();
    if (!a.dump_graph.empty()) {  // one GPU (prepare refuses it with --tp)
      auto& one = static_cast<Engine&>(eng);
      const replay::graph g = replay::capture(one.stream(), [&](replay::stream_ref cs) { one.record_decode_step(1, cs); });
      replay::write_graph_summary(g, a.dump_graph);
    }
    json out;
    out["device"] = dev;
    out["model"] = cfg.name;
    out["tp"] = a.tp;
    out["weights"] = a.model_dir.empty() ? "random" : a.model_dir;
    out["load_ms"] = load_ms;
    out["kernels"] = eng.describe_kernels();
    if (!a.quiet)
      fmt::print("device: {}{}\nmodel: {} ({} layers, hidden {}, {} q / {} kv heads, vocab {}), weights {}, {:.1f} MiB; "
                 "KV pool {} blocks x {} tokens = {:.1f} MiB\n{}\n",
                 dev, a.tp > 1 ? fmt::format(" x {} (tensor parallel; per-GPU figures below)", a.tp) : std::string(),
                 cfg.name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                 cfg.num_key_value_heads, cfg.vocab_size, a.model_dir.empty() ? "random" : a.model_dir,
                 mib(eng.weight_bytes()), eng.kv().num_blocks(), eng.kv().block_size(), mib(eng.kv_pool_bytes()),
                 eng.describe_kernels());

    int rc = 0;
    if (a.teacher_force >= 0) rc = run_parity(eng, a, s, out);
    else if (!a.bench || a.demo) rc = run_generation(eng, a, s, out);
    if (a.bench) run_bench(eng, s.bench, dev, out);
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
