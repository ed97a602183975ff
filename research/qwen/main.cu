// research/qwen/main.cu: the `qwen` CLI: generate with a Qwen3-shaped decoder, eagerly and from CUDA
// graphs, benchmark batch-1 TPOT and batched throughput, and dump teacher-forced logits for parity.
//
//   qwen --preset qwen3-0.6b --random-prompt 16 --gen 64 --mode both
//   qwen --model /path/to/hf_dir --prompt 1,2,3 --gen 32 --json out.json
//   qwen --preset qwen3-4b --bench --gen 128
//   qwen --preset tiny --demo                 # sequences join and finish at different steps
//   qwen --model dir --prompt ... --teacher-force 8 --dump-logits logits.f32
#include "model.hpp"

#include <common/device.hpp>
#include <common/report.hpp>
#include <common/rng.hpp>
#include <common/safetensors.hpp>
#include <common/timing.hpp>
#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
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

std::vector<int> parse_ids(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      std::size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      if (v < -1 || v > (1ll << 31) - 1) throw input_error(fmt::format("token id {} is out of range", item));
      out.push_back(static_cast<int>(v));
    } catch (const std::logic_error&) {
      throw input_error(fmt::format("prompt: '{}' is not a token id", item));
    }
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Qwen3-style decoder with a paged KV cache: eager and CUDA-graph decode"};
  std::string preset = "qwen3-0.6b", model_dir, prompt_s, mode = "both", json_path, dump_logits;
  int random_prompt_n = 0, gen = 32, batch = 1, max_bucket = 64, max_context = 4096, teacher_force = -1;
  int bench_steps = 0;
  double kv_mb = 1024;
  bool bench = false, demo = false, no_fallback = false, quiet = false, no_pdl = false, mega_fma = false,
       mega_rows = false;
  std::string bench_batches_s = "1,8,32,64";
  const char* kernels_env = std::getenv("QWEN_KERNELS");
  std::string kernels_s =
      kernels_env != nullptr && *kernels_env != '\0' ? kernels_env : decode_kernels_name(EngineOptions{}.kernels);
  auto env_int = [](const char* name, int dflt) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : dflt;
  };
  int stream_tile_kb = env_int("QWEN_STREAM_TILE_KB", EngineOptions{}.stream_tile_bytes / 1024);
  int stream_slots = env_int("QWEN_STREAM_SLOTS", EngineOptions{}.stream_max_slots);
  int mega_attn_splits = EngineOptions{}.mega_attn_splits, mega_attn_chunk = EngineOptions{}.mega_attn_min_chunk;
  int mega_attn_heads = EngineOptions{}.mega_attn_heads;
  std::uint64_t seed = 1234;
  app.add_option("--preset", preset, "model shape: qwen3-0.6b, qwen3-1.7b, qwen3-4b, tiny (random weights)");
  app.add_option("--model", model_dir, "Hugging Face directory (config.json + model.safetensors[.index.json])");
  app.add_option("--prompt", prompt_s, "prompt token ids, comma-separated");
  app.add_option("--random-prompt", random_prompt_n, "random prompt of N tokens (when --prompt is not given)");
  app.add_option("--gen", gen, "tokens to generate per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--batch", batch, "sequences decoded together")->check(CLI::Range(1, 1024));
  app.add_option("--mode", mode, "eager, graph or both (both: checks identical tokens)")
      ->check(CLI::IsMember({"eager", "graph", "both"}));
  app.add_flag("--bench", bench, "benchmark: batch-1 TPOT vs D2D bandwidth, and batched throughput");
  app.add_option("--bench-steps", bench_steps, "decode steps timed per bench (default: --gen)");
  app.add_option("--bench-batches", bench_batches_s, "batch sizes of the throughput bench");
  app.add_flag("--demo", demo, "staggered batch demo: sequences join and finish at different steps");
  app.add_option("--json", json_path, "write results as JSON to this file");
  app.add_option("--kv-mem-mb", kv_mb, "KV cache memory budget in MiB")->check(CLI::PositiveNumber);
  app.add_option("--max-context", max_context, "tokens per sequence at most (prompt + generation)");
  app.add_option("--max-bucket", max_bucket, "largest graph bucket (batch rows)");
  app.add_flag("--no-eager-fallback", no_fallback, "fail instead of running batches above the largest bucket eagerly");
  app.add_option("--teacher-force", teacher_force,
                 "parity mode: prefill the first N prompt tokens, then feed the rest one per step");
  app.add_option("--dump-logits", dump_logits, "parity mode: write the logits of every step (float32, steps x vocab)");
  app.add_option("--seed", seed, "seed of random weights and prompts");
  app.add_flag("--no-pdl", no_pdl, "launch kernels without programmatic dependent launch (for comparison)");
  app.add_option("--kernels", kernels_s,
                 "decode kernels of buckets 1..4 (default: $QWEN_KERNELS, else the engine's default, mega): "
                 "rowpipe (one GEMV kernel per matrix, software-pipelined loads), rowpipe8 (8 loads in flight), ring (one GEMV kernel per matrix, one block per SM, "
                 "per-warp shared-memory rings filled before the previous kernel ends), legacy (one "
                 "GEMV kernel per matrix, one warp per row), legacy8 (8 loads in flight), step (streaming "
                 "kernel, one launch per step), layer, phase, mega (bucket 1: one persistent launch per step, "
                 "activations as tagged words; other buckets: ring)");
  app.add_option("--stream-tile-kb", stream_tile_kb,
                 "streaming kernel: weight KiB per work item, about (default: $QWEN_STREAM_TILE_KB or 40)");
  app.add_option("--stream-slots", stream_slots, "streaming kernel: ring slots at most, 2..8 (default: $QWEN_STREAM_SLOTS or 8)");
  app.add_option("--mega-attn-splits", mega_attn_splits,
                 "persistent kernel: attention chunks per context at most for items of one query head, 1..32 "
                 "(default 0: blocks per query head); items of two query heads get twice as many");
  app.add_option("--mega-attn-heads", mega_attn_heads,
                 "persistent kernel: query heads per attention item, 1 or 2 (default 0: 1, or 2 where that splits a "
                 "long context into more chunks)");
  app.add_option("--mega-attn-chunk", mega_attn_chunk,
                 "persistent kernel: positions per attention chunk at least, a multiple of 64 (default 128)");
  app.add_flag("--mega-fma", mega_fma,
               "persistent kernel: GEMV rows with the per-matrix kernels' FMAs (bit-identical to ring) instead of "
               "tensor cores");
  app.add_flag("--mega-rows", mega_rows,
               "persistent kernel: tensor-core rows one (or two) at a time per warp instead of tiles of 4 rows");
  app.add_flag("--quiet", quiet, "print less");
  CLI11_PARSE(app, argc, argv);

  try {
    // ---- everything below up to the Engine is host-only: bad input fails before GPU work --------
    Config cfg;
    std::optional<replay_examples::safetensors> st;
    if (!model_dir.empty()) {
      cfg = config_from_file(model_dir);
      try {
        st = replay_examples::safetensors::open(model_dir);
      } catch (const replay_examples::safetensors_error& e) {
        throw input_error(fmt::format("weights: {}", e.what()));
      }
      check_weights(cfg, *st);
    } else {
      cfg = qwen::preset(preset);
    }
    EngineOptions opt;
    opt.max_bucket = max_bucket;
    opt.eager_fallback = !no_fallback;
    opt.kv_budget_bytes = static_cast<std::size_t>(kv_mb * 1048576.0);
    opt.max_context = std::min(max_context, cfg.max_position_embeddings);
    opt.seed = seed;
    opt.kernels = parse_decode_kernels(kernels_s);
    opt.stream_tile_bytes = stream_tile_kb * 1024;
    opt.stream_max_slots = stream_slots;
    opt.mega_attn_splits = mega_attn_splits;
    opt.mega_attn_min_chunk = mega_attn_chunk;
    opt.mega_attn_heads = mega_attn_heads;
    opt.mega_mma = !mega_fma;
    opt.mega_tiles = !mega_rows;
    opt.stream_trace = env_int("QWEN_STREAM_TRACE", 0) != 0;

    std::vector<int> prompt;
    if (!prompt_s.empty()) prompt = parse_ids(prompt_s);
    else prompt = random_prompt(random_prompt_n > 0 ? random_prompt_n : 8, cfg.vocab_size, seed);

    const bool parity = teacher_force >= 0;
    std::vector<int> bench_batches;
    if (bench) bench_batches = parse_ids(bench_batches_s);
    std::vector<SequenceRequest> seqs;
    std::vector<int> join;
    if (parity) {
      if (teacher_force < 1 || teacher_force > static_cast<int>(prompt.size()))
        throw input_error(fmt::format("--teacher-force {} must be in 1..prompt length {}", teacher_force, prompt.size()));
      seqs.push_back({prompt, 1});
    } else if (demo) {
      // Sequences of different prompt and output lengths joining at different steps.
      const int n = std::max(batch, 12);
      for (int i = 0; i < n; ++i) {
        seqs.push_back({random_prompt(4 + 3 * (i % 7), cfg.vocab_size, seed + 100 + i), 6 + (i * 7) % 23});
        join.push_back(i < 4 ? 0 : 2 * (i - 3));
      }
    } else {
      for (int i = 0; i < batch; ++i) {
        seqs.push_back({i == 0 || !prompt_s.empty() ? prompt : random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, seed + i), gen});
        join.push_back(0);
      }
    }
    opt.max_batch = std::max(64, static_cast<int>(seqs.size()));
    for (int b : bench_batches) opt.max_batch = std::max(opt.max_batch, b);
    validate_request(cfg, opt, seqs);
    if (bench) {
      const int steps = bench_steps > 0 ? bench_steps : gen;
      std::vector<SequenceRequest> bseqs;
      for (int b : bench_batches) {
        if (b < 1) throw input_error("--bench-batches: batch sizes must be positive");
        bseqs.assign(b, SequenceRequest{prompt, steps + 1});
        validate_request(cfg, opt, bseqs);
      }
    }

    // ---- GPU work ---------------------------------------------------------------------------
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
      fmt::print(stderr, "error: no CUDA device\n");
      return 3;
    }
    const std::string dev = replay_examples::device_name();
    set_pdl(!no_pdl);
    replay_examples::stopwatch load_sw;
    Engine eng(cfg, opt, st ? &*st : nullptr);
    const double load_ms = load_sw.elapsed_ms();
    json out;
    out["device"] = dev;
    out["model"] = cfg.name;
    out["weights"] = model_dir.empty() ? "random" : model_dir;
    out["load_ms"] = load_ms;
    out["pdl"] = pdl_enabled();
    out["kernels"] = eng.describe_kernels();
    if (!quiet)
      fmt::print("device: {}\nmodel: {} ({} layers, hidden {}, {} q / {} kv heads, vocab {}), weights {}, {:.1f} MiB; "
                 "KV pool {} blocks x {} tokens = {:.1f} MiB\n",
                 dev, cfg.name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                 cfg.num_key_value_heads, cfg.vocab_size, model_dir.empty() ? "random" : model_dir,
                 mib(eng.weight_bytes()), eng.kv().num_blocks(), eng.kv().block_size(), mib(eng.kv_pool_bytes()));
    if (!quiet) fmt::print("{}\n", eng.describe_kernels());

    std::vector<std::string> modes;
    if (mode == "both") modes = {"eager", "graph"};
    else modes = {mode};
    int rc = 0;

    if (parity) {
      // Teacher forcing: logits after the prefix, then after each forced token.
      const int P = teacher_force, n = static_cast<int>(prompt.size()), V = cfg.vocab_size;
      std::vector<std::vector<float>> per_mode;
      for (const auto& m : modes) {
        std::vector<float> logits(std::size_t(n - P + 1) * V);
        auto& book = eng.kv();
        const int slot = book.acquire_slot();
        book.ensure(slot, n);
        (void)eng.prefill(slot, std::span<const int>(prompt.data(), P), 0, std::span<float>(logits.data(), V));
        for (int i = P; i < n; ++i) {
          DecodeRow row{slot, prompt[i], i};
          int next = 0;
          eng.decode(std::span<const DecodeRow>(&row, 1), m == "graph", std::span<int>(&next, 1),
                     std::span<float>(logits.data() + std::size_t(i - P + 1) * V, V));
        }
        book.release(slot);
        per_mode.push_back(std::move(logits));
      }
      if (per_mode.size() == 2) {
        const bool same = per_mode[0] == per_mode[1];
        out["parity_eager_graph_logits_identical"] = same;
        fmt::print("teacher-forced logits eager vs graph: {}\n", same ? "bit-identical" : "DIFFERENT");
        if (!same) rc = 1;
      }
      if (!dump_logits.empty()) {
        std::ofstream f(dump_logits, std::ios::binary);
        f.write(reinterpret_cast<const char*>(per_mode.back().data()),
                static_cast<std::streamsize>(per_mode.back().size() * sizeof(float)));
        if (!f) throw input_error("cannot write " + dump_logits);
        fmt::print("wrote {} steps x {} logits to {}\n", n - P + 1, V, dump_logits);
      }
    } else if (!bench || demo) {
      std::vector<RunResult> results;
      for (const auto& m : modes) {
        if (!quiet) fmt::print("[{}] {} sequence(s)\n", m, seqs.size());
        results.push_back(run_schedule(eng, seqs, join, m == "graph", demo && !quiet));
        const auto& r = results.back();
        const auto s = replay_examples::summarize(r.step_us);
        if (!quiet) {
          for (std::size_t i = 0; i < seqs.size() && i < 4; ++i)
            fmt::print("  seq {}: {}{}\n", i, fmt::join(r.tokens[i].begin(), r.tokens[i].begin() + std::min<std::size_t>(r.tokens[i].size(), 24), ","),
                       r.tokens[i].size() > 24 ? ",..." : "");
          fmt::print("  {} decode steps, median step {:.1f} us, prefill {:.1f} ms\n", s.count, s.median, r.prefill_ms);
        }
        out[m]["tokens"] = r.tokens;
        out[m]["median_step_us"] = s.median;
        out[m]["decode_steps"] = s.count;
        out[m]["step_buckets"] = r.step_bucket;
        out[m]["step_rows"] = r.step_rows;
      }
      if (results.size() == 2) {
        const bool same = results[0].tokens == results[1].tokens;
        out["identical_tokens"] = same;
        fmt::print("eager vs graph tokens: {}\n", same ? "identical" : "DIFFERENT");
        if (!same) rc = 1;
      }
      if (demo) {
        long long real = 0, run = 0;
        std::set<int> bs(results.back().step_bucket.begin(), results.back().step_bucket.end());
        for (std::size_t i = 0; i < results.back().step_rows.size(); ++i)
          real += results.back().step_rows[i], run += results.back().step_bucket[i];
        fmt::print("demo: {} steps, buckets used {}, padding waste {:.1f}% ({} padded rows of {})\n",
                   results.back().step_rows.size(), fmt::join(bs, ","), 100.0 * (run - real) / run, run - real, run);
        out["demo"] = {{"buckets_used", std::vector<int>(bs.begin(), bs.end())},
                       {"padding_waste", double(run - real) / run}};
      }
    }

    if (bench) {
      const int steps = bench_steps > 0 ? bench_steps : gen;
      const double bw = d2d_bandwidth(eng.stream());
      const double wbytes = static_cast<double>(cfg.decode_weight_bytes());
      fmt::print("\n## Batch-1 decode, {} ({}), {} prompt tokens, {} steps, PDL {}, kernels {}\n", cfg.name, dev,
                 prompt.size(), steps, pdl_enabled() ? "on" : "off", decode_kernels_name(opt.kernels));
      const double rbw = read_bandwidth(eng.stream());
      fmt::print("weights read per step: {:.1f} MiB; D2D copy bandwidth: {:.0f} GB/s (read + write); bytes floor {:.3f} ms\n",
                 mib(wbytes), bw / 1e9, wbytes / bw * 1e3);
      fmt::print("read-only streaming kernel: {:.0f} GB/s ({:.1f}% of D2D); at that rate the weights take {:.3f} ms\n",
                 rbw / 1e9, 100.0 * rbw / bw, wbytes / rbw * 1e3);
      const double chain_ms = chain_floor_ms(cfg, eng.stream());
      if (chain_ms > 0)
        fmt::print("kernel-per-matrix floor (a graph of {} streaming-read kernels with this step's matrix sizes, PDL {}): "
                   "{:.3f} ms\n",
                   5 * cfg.num_hidden_layers + 1, pdl_enabled() ? "on" : "off", chain_ms);
      else
        fmt::print("kernel-per-matrix floor: skipped (no device memory for a copy of the weights)\n");
      replay_examples::table t({"mode", "TPOT median (ms)", "p10 (ms)", "p90 (ms)", "tokens/s", "eff. GB/s", "% of D2D"});
      for (const auto& m : modes) {
        std::vector<SequenceRequest> one{{prompt, steps + 1}};
        (void)run_schedule(eng, std::vector<SequenceRequest>{{prompt, 4}}, {0}, m == "graph", false);  // warm-up
        const auto r = run_schedule(eng, one, {0}, m == "graph", false);
        const auto s = replay_examples::summarize(r.step_us);
        const double tpot = s.median * 1e-6;
        t.add_row({m, fmt::format("{:.3f}", s.median / 1e3), fmt::format("{:.3f}", s.p10 / 1e3),
                   fmt::format("{:.3f}", s.p90 / 1e3), fmt::format("{:.1f}", 1.0 / tpot),
                   fmt::format("{:.0f}", wbytes / tpot / 1e9), fmt::format("{:.1f}", 100.0 * wbytes / tpot / bw)});
        out["bench"]["batch1"][m] = {{"tpot_ms", s.median / 1e3}, {"p10_ms", s.p10 / 1e3}, {"p90_ms", s.p90 / 1e3},
                                     {"tokens_per_s", 1.0 / tpot}, {"eff_bw_GBps", wbytes / tpot / 1e9},
                                     {"pct_d2d", 100.0 * wbytes / tpot / bw}};
      }
      if (const std::string tr = ring_trace_summary(eng.stream()); !tr.empty()) fmt::print("{}", tr);
      out["bench"]["d2d_GBps"] = bw / 1e9;
      out["bench"]["read_GBps"] = rbw / 1e9;
      if (chain_ms > 0) out["bench"]["chain_floor_ms"] = chain_ms;
      if (const std::string tr = eng.stream_trace_summary(1); !tr.empty()) {
        fmt::print("{}\n", tr);
        out["bench"]["stream_trace"] = tr;
      }
      out["bench"]["weight_bytes_per_step"] = wbytes;
      fmt::print("{}", t.markdown());

      replay_examples::table tb({"batch", "bucket", "mode", "step median (ms)", "tokens/s"});
      for (int b : bench_batches) {
        for (const auto& m : modes) {
          std::vector<SequenceRequest> bs;
          for (int i = 0; i < b; ++i) bs.push_back({random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, seed + 7 * i), steps + 1});
          std::vector<int> j(b, 0);
          (void)run_schedule(eng, std::vector<SequenceRequest>(bs.begin(), bs.end()), j, m == "graph", false);
          const auto r = run_schedule(eng, bs, j, m == "graph", false);
          const auto s = replay_examples::summarize(r.step_us);
          tb.add_row({std::to_string(b), std::to_string(eng.bucket_for(b)), m, fmt::format("{:.3f}", s.median / 1e3),
                      fmt::format("{:.0f}", b / (s.median * 1e-6))});
          out["bench"]["batched"][m][std::to_string(b)] = {{"step_ms", s.median / 1e3}, {"tokens_per_s", b / (s.median * 1e-6)},
                                                          {"bucket", eng.bucket_for(b)}};
        }
      }
      fmt::print("\n## Batched decode ({} steps, prompt {} tokens)\n{}", steps, prompt.size(), tb.markdown());
      fmt::print("bucket policy: powers of two up to {}; padding waste for batch sizes 1..{} equally likely: {:.1f}%\n",
                 eng.buckets().back(), eng.buckets().back(), 100.0 * uniform_padding_waste(eng, eng.buckets().back()));
      out["bench"]["uniform_padding_waste"] = uniform_padding_waste(eng, eng.buckets().back());
    }

    const auto gs = eng.graph_stats();
    out["memory"] = {{"weights_bytes", eng.weight_bytes()}, {"kv_pool_bytes", eng.kv_pool_bytes()},
                     {"buffers_bytes", eng.buffer_bytes()}, {"graphs_bytes", gs.graph_bytes}};
    json kpb = json::object();
    for (const auto& [b, k] : gs.nodes_per_bucket) kpb[std::to_string(b)] = k;
    out["pool"] = json::parse(eng.pool_stats().to_json());
    out["graphs"] = {{"captures", gs.captures}, {"replays", gs.replays}, {"eager_steps", gs.eager_steps},
                     {"fallback_steps", gs.fallback_steps}, {"nodes_per_bucket", kpb},
                     {"padded_rows", gs.padded_rows}, {"real_rows", gs.real_rows}};
    if (!quiet) {
      std::string kp;
      for (const auto& [b, k] : gs.nodes_per_bucket) kp += fmt::format(" {}:{}", b, k);
      fmt::print("memory: weights {:.1f} MiB, KV pool {:.1f} MiB, buffers {:.1f} MiB, graphs {:.2f} MiB ({} captured; "
                 "nodes per bucket{})\n",
                 mib(eng.weight_bytes()), mib(eng.kv_pool_bytes()), mib(eng.buffer_bytes()), mib(gs.graph_bytes),
                 gs.captures, kp);
    }
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << out.dump(2) << "\n";
      if (!f) throw input_error("cannot write " + json_path);
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
