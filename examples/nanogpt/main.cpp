// nanogpt: generate Shakespeare-like text with the seed's 4-layer character model, eagerly and by
// CUDA graph replay, and reproduce the seed's benchmark tables (--bench).
//
//   nanogpt                                   default prompt, 40 tokens: eager, per-step graph and
//                                             device loop (16 decode steps per launch), compared
//   nanogpt -p "ROMEO:" -n 50 --mode graph    one mode
//   nanogpt --mode graph --tokens-per-launch 8   graph and device loop (8 steps per launch)
//   nanogpt --bench [--json]                  the seed's tables (named configurations + sweep)
//   nanogpt --parity-dump out.json -p TEXT    logits for parity.py (PyTorch comparison)
//
// Everything a user can get wrong (prompt characters, lengths, temperature, the weights file) is
// checked on the host before any GPU work; errors print one clear line and exit non-zero.
#include "common/report.hpp"
#include "common/timing.hpp"
#include "nanogpt/model.hpp"
#include "nanogpt/vocab.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <replay/capture.hpp>
#include <replay/inspect.hpp>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef NANOGPT_DEFAULT_WEIGHTS
#define NANOGPT_DEFAULT_WEIGHTS "examples/nanogpt/weights/shakespeare_char.safetensors"
#endif

namespace {

using nanogpt::Config;
using nanogpt::Mode;
using nanogpt::Model;
using replay_examples::summarize;
using json = nlohmann::json;

/// Text the benchmark prompts are cut from (all characters are in the vocabulary).
constexpr std::string_view bench_text = "First Citizen:\nBefore we proceed any further, hear me speak.";

struct Options {
  std::string prompt = "To be, or not to be";
  int tokens = 40;
  std::uint64_t seed = 1337;
  float temperature = 1.0f;
  bool greedy = false;
  std::string mode = "both";
  std::string weights;  // empty: the shipped file, else a random init
  bool random_init = false;
  std::uint64_t init_seed = 1;
  bool bench = false;
  int repeats = 20;
  bool json_out = false;
  bool no_pdl = false;
  std::string meta = "device";
  int tokens_per_launch = 16;  // the device loop's decode steps per graph launch
  bool loop = false;           // run the device loop: --mode both, or --tokens-per-launch given
  std::string stop;           // one character ends the generation (empty: none)
  std::string parity_dump;
  int prefill_len = 0;
};

std::string show_text(std::string_view s) {
  std::string out = "\"";
  for (char c : s) out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out + "\"";
}

double stat_median(const std::vector<double>& v) { return summarize(v).median; }

/// The token id of --stop, or -1.
std::int32_t stop_token(const Options& o) { return o.stop.empty() ? -1 : nanogpt::encode(o.stop).front(); }

// -------------------------------------------------------------------------------------------
// Generation (default)
// -------------------------------------------------------------------------------------------

json run_json(const nanogpt::GenerateResult& r, const std::vector<std::int32_t>& prompt) {
  const auto st = summarize(r.step_us);
  std::vector<std::int32_t> all(prompt);
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  return {{"text", nanogpt::decode(all)},
          {"tokens", r.tokens},
          {"prefill_us", r.prefill_us},
          {"capture_us", r.capture_us},
          {"decode_us", r.decode_us},
          {"total_us", r.total_us},
          {"tok_per_s", static_cast<double>(r.tokens.size()) / (r.total_us * 1e-6)},
          {"step_median_us", st.median},
          {"step_mean_us", st.mean},
          {"step_p90_us", st.p90},
          {"steps", st.count}};
}

/// Decode time per token of each path that ran (host wall clock over all its decode steps, as
/// --bench measures it), each against eager when eager ran.
void print_per_token(const std::vector<Mode>& modes, const std::vector<nanogpt::GenerateResult>& results,
                     const nanogpt::GenerateResult* looped, int tokens_per_launch) {
  const auto us_per_token = [](const nanogpt::GenerateResult& r) {
    return r.tokens.size() > 1 ? r.decode_us / static_cast<double>(r.tokens.size() - 1) : 0.0;
  };
  std::vector<std::pair<std::string, double>> rows;
  for (std::size_t i = 0; i < modes.size(); ++i)
    rows.emplace_back(modes[i] == Mode::eager ? "eager, one launch per step" : "graph, one replay per step",
                      us_per_token(results[i]));
  if (looped != nullptr)
    rows.emplace_back(fmt::format("device loop, up to {} steps per launch", tokens_per_launch),
                      us_per_token(*looped));
  if (rows.size() < 2 || rows.back().second <= 0) return;
  const bool eager = modes.front() == Mode::eager;
  replay_examples::table t({"path", "µs per token", eager ? "vs eager" : "vs graph"});
  for (const auto& [name, us] : rows)
    t.add_row({name, fmt::format("{:.2f}", us), fmt::format("{:.2f}x", rows[0].second / us)});
  fmt::print("\ndecode time per token ({} decode steps each, host wall clock):\n{}",
             results.front().tokens.size() - 1, t.markdown());
}

int run_generate(Model& model, const Options& o, const std::vector<std::int32_t>& prompt,
                 const nanogpt::Sampling& sampling, json& out) {
  std::vector<Mode> modes;
  if (o.mode != "graph") modes.push_back(Mode::eager);
  if (o.mode != "eager") modes.push_back(Mode::graph);
  const std::int32_t stop = stop_token(o);
  std::vector<nanogpt::GenerateResult> results;
  for (Mode m : modes) results.push_back(nanogpt::generate(model, prompt, o.tokens, m, sampling, true, stop));
  std::optional<nanogpt::GenerateResult> looped;
  if (o.loop) {
    looped = nanogpt::generate_looped(model, prompt, o.tokens, o.tokens_per_launch, sampling, true, stop);
    out["runs"]["loop"] = run_json(*looped, prompt);
    out["runs"]["loop"]["tokens_per_launch"] = o.tokens_per_launch;
    out["runs"]["loop"]["launches"] = looped->launch_us.size();
  }

  for (std::size_t i = 0; i < modes.size(); ++i) out["runs"][std::string(to_string(modes[i]))] = run_json(results[i], prompt);
  bool identical = results.size() < 2 || results[0].tokens == results[1].tokens;
  if (looped) identical = identical && looped->tokens == results[0].tokens;
  out["identical"] = identical;
  if (!o.json_out) {
    for (std::size_t i = 0; i < modes.size(); ++i) {
      const auto& r = results[i];
      if (modes[i] == Mode::eager)
        fmt::print("── eager: {} kernel launches per step ──\n", Model::kernels_per_decode_step);
      else
        fmt::print("── graph: one replay of {} kernel nodes per step ──\n", model.graph_kernel_nodes());
      fmt::print("{}{}\n", o.prompt, nanogpt::decode(r.tokens));
      fmt::print("   prefill {:.1f} µs{}, {} decode steps, median step {:.2f} µs, {:.0f} tok/s end to end\n\n",
                 r.prefill_us, modes[i] == Mode::graph ? fmt::format(", capture {:.1f} µs", r.capture_us) : "",
                 r.step_us.size(), stat_median(r.step_us),
                 static_cast<double>(r.tokens.size()) / (r.total_us * 1e-6));
    }
    if (looped) {
      const auto& r = *looped;
      const std::size_t steps = r.tokens.size() - 1;
      fmt::print("── device loop: up to {} decode steps per graph launch ──\n", o.tokens_per_launch);
      fmt::print("{}{}\n", o.prompt, nanogpt::decode(r.tokens));
      fmt::print("   prefill {:.1f} µs, capture {:.1f} µs, {} decode steps in {} launches, {:.2f} µs per token, {:.0f} "
                 "tok/s end to end\n\n",
                 r.prefill_us, r.capture_us, steps, r.launch_us.size(),
                 steps > 0 ? r.decode_us / static_cast<double>(steps) : 0.0,
                 static_cast<double>(r.tokens.size()) / (r.total_us * 1e-6));
    }
    if (results.size() + (looped ? 1 : 0) >= 2)
      fmt::print("{} tokens identical: {}\n", looped ? "all runs'" : "eager and graph", identical ? "yes" : "NO");
    print_per_token(modes, results, looped ? &*looped : nullptr, o.tokens_per_launch);
  }
  return identical ? 0 : 3;
}

// -------------------------------------------------------------------------------------------
// --bench: the seed's tables
// -------------------------------------------------------------------------------------------

struct CaseResult {
  std::string name;
  int prompt_len = 0;
  int gen = 0;
  // per mode: medians over repeats (µs), step latencies pooled over repeats
  double total_us[2]{}, prefill_us[2]{}, capture_us = 0;
  replay_examples::stats step[2];
  int mismatches = 0;
  [[nodiscard]] double tok_s(int m) const { return gen / (total_us[m] * 1e-6); }
  [[nodiscard]] double e2e_speedup() const { return total_us[0] / total_us[1]; }
  [[nodiscard]] double step_speedup() const { return step[0].median / step[1].median; }
};

CaseResult run_case(Model& model, std::string name, int prompt_len, int gen, int repeats) {
  CaseResult c;
  c.name = std::move(name);
  c.prompt_len = prompt_len;
  c.gen = gen;
  const auto prompt = nanogpt::encode(bench_text.substr(0, static_cast<std::size_t>(prompt_len)));
  std::vector<double> total[2], prefill[2], steps[2], capture;
  for (int rep = 0; rep < repeats; ++rep) {
    const nanogpt::Sampling s{1.0f, 1000 + static_cast<std::uint64_t>(rep), false};
    const auto e = nanogpt::generate(model, prompt, gen, Mode::eager, s);
    const auto g = nanogpt::generate(model, prompt, gen, Mode::graph, s, /*fresh_capture=*/true);
    c.mismatches += e.tokens != g.tokens ? 1 : 0;
    const nanogpt::GenerateResult* r[2] = {&e, &g};
    for (int m = 0; m < 2; ++m) {
      total[m].push_back(r[m]->total_us);
      prefill[m].push_back(r[m]->prefill_us);
      steps[m].insert(steps[m].end(), r[m]->step_us.begin(), r[m]->step_us.end());
    }
    capture.push_back(g.capture_us);
  }
  for (int m = 0; m < 2; ++m) {
    c.total_us[m] = stat_median(total[m]);
    c.prefill_us[m] = stat_median(prefill[m]);
    c.step[m] = summarize(steps[m]);
  }
  c.capture_us = stat_median(capture);
  return c;
}

json case_json(const CaseResult& c) {
  json j = {{"name", c.name},          {"prompt_len", c.prompt_len},  {"gen_tokens", c.gen},
            {"e2e_speedup", c.e2e_speedup()}, {"step_speedup", c.step_speedup()},
            {"token_mismatches", c.mismatches}, {"graph_capture_us", c.capture_us}};
  for (int m = 0; m < 2; ++m)
    j[m == 0 ? "eager" : "graph"] = {{"tok_per_s", c.tok_s(m)},           {"total_us", c.total_us[m]},
                                     {"prefill_us", c.prefill_us[m]},     {"step_median_us", c.step[m].median},
                                     {"step_mean_us", c.step[m].mean},    {"step_p10_us", c.step[m].p10},
                                     {"step_p90_us", c.step[m].p90},      {"step_max_us", c.step[m].max},
                                     {"steps", c.step[m].count}};
  return j;
}

int run_bench(Model& model, const Options& o, json& out) {
  struct Named {
    const char* name;
    int prompt_len, gen;
  };
  const Named named[] = {{"smoke_test", 4, 8},
                         {"medium_generation", 8, 32},
                         {"long_generation", 8, 48},
                         {"heavy_prompt", 32, 16},
                         {"near_context_limit", 4, 56}};
  const int sweep[] = {8, 16, 24, 32, 40, 48, 56};
  const int repeats = o.repeats;

  // Warm-up: load every kernel module and touch every buffer once in both modes.
  {
    const auto p = nanogpt::encode(bench_text.substr(0, 8));
    for (int i = 0; i < 3; ++i) {
      (void)nanogpt::generate(model, p, 16, Mode::eager, {});
      (void)nanogpt::generate(model, p, 16, Mode::graph, {});
    }
  }
  std::vector<CaseResult> cases, sweeps;
  for (const auto& n : named) cases.push_back(run_case(model, n.name, n.prompt_len, n.gen, repeats));
  for (int g : sweep) sweeps.push_back(run_case(model, fmt::format("sweep_{}", g), 8, g, repeats));

  // Back-to-back steps with no per-step synchronisation: the launch-bound (eager) and GPU-bound
  // (graph) throughput floors of one step.
  const auto back_to_back = [&](Mode m) {
    const auto p = nanogpt::encode(bench_text.substr(0, 8));
    (void)model.prefill(p, {});
    if (m == Mode::graph && !model.has_graph()) model.capture_decode_graph();
    constexpr int n = 2000;
    std::vector<double> per;
    for (int rep = 0; rep < 5; ++rep) {
      replay_examples::stopwatch sw;
      for (int i = 0; i < n; ++i) model.enqueue_decode_step(0, 8, {}, m);
      model.synchronize();
      per.push_back(sw.elapsed_us() / n);
    }
    return stat_median(per);
  };
  const double b2b[2] = {back_to_back(Mode::eager), back_to_back(Mode::graph)};

  // Decode time per token: a generation from a one-token prompt to the context limit (62 decode
  // steps), step by step (eager, graph) and with the device loop at K steps per launch. The paths
  // take turns within each repeat, so every row sees the same machine state.
  const int loop_ks[] = {1, 4, 16, 64};
  constexpr int n_paths = 2 + static_cast<int>(std::size(loop_ks));
  std::vector<double> per_token[n_paths];
  int loop_mismatches = 0;
  {
    const auto p = nanogpt::encode(bench_text.substr(0, 1));
    const int n = Config::block_size - 1;
    const auto us_per_token = [](const nanogpt::GenerateResult& r) {
      return r.decode_us / static_cast<double>(r.tokens.size() - 1);
    };
    for (int rep = 0; rep < repeats; ++rep) {
      const nanogpt::Sampling s{1.0f, 2000 + static_cast<std::uint64_t>(rep), false};
      const auto e = nanogpt::generate(model, p, n, Mode::eager, s, false);
      const auto g = nanogpt::generate(model, p, n, Mode::graph, s, false);
      per_token[0].push_back(us_per_token(e));
      per_token[1].push_back(us_per_token(g));
      loop_mismatches += e.tokens != g.tokens ? 1 : 0;
      for (std::size_t k = 0; k < std::size(loop_ks); ++k) {
        // Captured afresh for each K (min(K, 8) steps per run of the body; not in decode_us).
        const auto l = nanogpt::generate_looped(model, p, n, loop_ks[k], s, true);
        per_token[2 + k].push_back(us_per_token(l));
        loop_mismatches += l.tokens != g.tokens ? 1 : 0;
      }
    }
  }
  replay_examples::stats token_stats[n_paths];
  for (int i = 0; i < n_paths; ++i) token_stats[i] = summarize(per_token[i]);
  const auto path_name = [&](int i) {
    return i == 0 ? std::string("eager") : i == 1 ? std::string("graph, one step per launch")
                                                  : fmt::format("device loop, K = {}", loop_ks[i - 2]);
  };

  int mismatches = loop_mismatches;
  for (const auto& c : cases) mismatches += c.mismatches;
  for (const auto& c : sweeps) mismatches += c.mismatches;
  const double step_eager = cases[1].step[0].median, step_graph = cases[1].step[1].median;

  out["bench"] = {{"repeats", repeats},
                  {"named", json::array()},
                  {"sweep", json::array()},
                  {"token_mismatches", mismatches},
                  {"back_to_back_step_us", {{"eager", b2b[0]}, {"graph", b2b[1]}}},
                  {"per_token_us", json::array()}};
  for (int i = 0; i < n_paths; ++i)
    out["bench"]["per_token_us"].push_back({{"path", path_name(i)},
                                            {"tokens_per_launch", i < 2 ? 1 : loop_ks[i - 2]},
                                            {"median", token_stats[i].median},
                                            {"p10", token_stats[i].p10},
                                            {"p90", token_stats[i].p90},
                                            {"vs_graph", token_stats[i].median / token_stats[1].median}});
  for (const auto& c : cases) out["bench"]["named"].push_back(case_json(c));
  for (const auto& c : sweeps) out["bench"]["sweep"].push_back(case_json(c));
  if (o.json_out) return mismatches == 0 ? 0 : 3;

  fmt::print("{} repeats per configuration and mode; sampling at temperature 1 with seeds 1000..{}; a graph is "
             "captured fresh in every graph run (counted in its end-to-end time, as in the seed)\n\n",
             repeats, 1000 + repeats - 1);
  fmt::print("### Named configurations\n\n");
  replay_examples::table t1({"Config", "Prompt Len", "Gen Tokens", "Eager tok/s", "Graph tok/s", "E2E Speedup",
                             "Per-step Speedup"});
  for (const auto& c : cases)
    t1.add_row({c.name, fmt::format("{}", c.prompt_len), fmt::format("{}", c.gen), fmt::format("{:.0f}", c.tok_s(0)),
                fmt::format("{:.0f}", c.tok_s(1)), fmt::format("{:.2f}x", c.e2e_speedup()),
                fmt::format("{:.2f}x", c.step_speedup())});
  fmt::print("{}\n", t1.markdown());

  fmt::print("### Generation length sweep (prompt_len=8)\n\n");
  replay_examples::table t2({"Gen Tokens", "Eager tok/s", "Graph tok/s", "E2E Speedup", "Per-step Speedup"});
  for (const auto& c : sweeps)
    t2.add_row({fmt::format("{}", c.gen), fmt::format("{:.0f}", c.tok_s(0)), fmt::format("{:.0f}", c.tok_s(1)),
                fmt::format("{:.2f}x", c.e2e_speedup()), fmt::format("{:.2f}x", c.step_speedup())});
  fmt::print("{}\n", t2.markdown());

  fmt::print("### Per-step decode latency (push → replay/launches → token on the host)\n\n");
  replay_examples::table t3({"Config", "Eager median (µs)", "Graph median (µs)", "Speedup", "Eager p90 (µs)",
                             "Graph p90 (µs)"});
  const auto add3 = [&](const CaseResult& c) {
    t3.add_row({c.name, fmt::format("{:.2f}", c.step[0].median), fmt::format("{:.2f}", c.step[1].median),
                fmt::format("{:.2f}x", c.step_speedup()), fmt::format("{:.2f}", c.step[0].p90),
                fmt::format("{:.2f}", c.step[1].p90)});
  };
  for (const auto& c : cases) add3(c);
  for (const auto& c : sweeps) add3(c);
  fmt::print("{}\n", t3.markdown());

  fmt::print("### Fixed costs (medians)\n\n");
  replay_examples::table t4({"Config", "Eager prefill (µs)", "Graph prefill (µs)", "Graph capture (µs)"});
  const auto add4 = [&](const CaseResult& c) {
    t4.add_row({c.name, fmt::format("{:.1f}", c.prefill_us[0]), fmt::format("{:.1f}", c.prefill_us[1]),
                fmt::format("{:.1f}", c.capture_us)});
  };
  for (const auto& c : cases) add4(c);
  for (const auto& c : sweeps) add4(c);
  fmt::print("{}\n", t4.markdown());

  fmt::print("### Decode time per token (prompt of 1 token, 62 decode steps to the context limit; medians of {} "
             "generations per path)\n\n",
             repeats);
  replay_examples::table t5({"Path", "µs per token", "p10", "p90", "vs graph"});
  for (int i = 0; i < n_paths; ++i)
    t5.add_row({path_name(i), fmt::format("{:.2f}", token_stats[i].median), fmt::format("{:.2f}", token_stats[i].p10),
                fmt::format("{:.2f}", token_stats[i].p90),
                fmt::format("{:.2f}x", token_stats[i].median / token_stats[1].median)});
  fmt::print("{}\n", t5.markdown());

  fmt::print("Back to back (no per-step sync, 2000 steps): eager {:.2f} µs/step (launch-bound), graph {:.2f} "
             "µs/step (GPU time of one replay)\n",
             b2b[0], b2b[1]);
  fmt::print("medium_generation per step [PDL {}, meta {}]: eager {:.2f} µs, graph {:.2f} µs, {:.2f}x; "
             "token mismatches (eager vs graph vs device loop): {}\n",
             o.no_pdl ? "off" : "on", o.meta, step_eager, step_graph, step_eager / step_graph, mismatches);
  return mismatches == 0 ? 0 : 3;
}

// -------------------------------------------------------------------------------------------
// --parity-dump: logits for parity.py
// -------------------------------------------------------------------------------------------

int run_parity_dump(Model& model, const Options& o, const std::vector<std::int32_t>& tokens) {
  const int n = static_cast<int>(tokens.size());
  const int k = o.prefill_len > 0 ? o.prefill_len : std::max(1, n / 2);
  if (k > n) throw std::invalid_argument(fmt::format("--prefill-len {} is longer than the prompt ({})", k, n));
  json out = {{"tokens", tokens}, {"prefill_len", k}, {"first_position", k - 1}};
  for (Mode m : {Mode::eager, Mode::graph}) {
    const nanogpt::Sampling s{1.0f, o.seed, false};
    json rows = json::array();
    (void)model.prefill(std::span<const std::int32_t>(tokens.data(), static_cast<std::size_t>(k)), s);
    rows.push_back(model.logits());
    if (m == Mode::graph) model.capture_decode_graph();
    for (int pos = k; pos < n; ++pos) {  // teacher forcing: feed the prompt's own next token
      (void)model.decode_step(tokens[static_cast<std::size_t>(pos)], pos, s, m);
      rows.push_back(model.logits());
    }
    out[m == Mode::eager ? "logits_eager" : "logits_graph"] = rows;
  }
  std::ofstream f(o.parity_dump);
  if (!f) throw std::runtime_error(fmt::format("cannot write {}", o.parity_dump));
  f << out.dump() << '\n';
  fmt::print("wrote logits for positions {}..{} ({} eager, {} graph) to {}\n", k - 1, n - 1,
             out["logits_eager"].size(), out["logits_graph"].size(), o.parity_dump);
  return 0;
}

/// Checks of the options that the parser cannot make alone (run before any GPU work); throws
/// std::invalid_argument naming the flag.
void check_options(const Options& o, const CLI::App& app, std::size_t prompt_len) {
  if (app.count("--prefill-len") != 0) {
    if (o.parity_dump.empty()) throw std::invalid_argument("--prefill-len is used only with --parity-dump");
    if (o.prefill_len < 1 || static_cast<std::size_t>(o.prefill_len) > prompt_len)
      throw std::invalid_argument(fmt::format("--prefill-len {} must be in 1..{} (the prompt's length)",
                                              o.prefill_len, prompt_len));
  }
  if (app.count("--parity-dump") != 0) {
    if (o.parity_dump.empty()) throw std::invalid_argument("--parity-dump: the path is empty");
    // The file is written after the GPU work: refuse now what could not be written (or would block).
    struct stat st {};
    if (::stat(o.parity_dump.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw std::invalid_argument(fmt::format("--parity-dump {}: exists and is not a regular file", o.parity_dump));
    const auto parent = std::filesystem::path(o.parity_dump).parent_path();
    std::error_code ec;
    if (!parent.empty() && !std::filesystem::is_directory(parent, ec))
      throw std::invalid_argument(fmt::format("--parity-dump {}: the directory {} does not exist", o.parity_dump,
                                              parent.string()));
    if (o.bench) throw std::invalid_argument("--parity-dump and --bench exclude each other");
  }
  if (o.bench && app.count("--tokens") != 0)
    throw std::invalid_argument("--tokens has no effect with --bench (it runs the seed's fixed lengths)");
  if (!o.bench && app.count("--repeats") != 0) throw std::invalid_argument("--repeats is used only with --bench");
  if (o.random_init && app.count("--weights") != 0)
    throw std::invalid_argument("--weights and --random-init exclude each other");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"nanogpt: the seed's 4-layer character GPT, decoded eagerly and by CUDA graph replay"};
  app.add_option("-p,--prompt", o.prompt, "prompt text (characters of the 65-character vocabulary)")
      ->capture_default_str();
  app.add_option("-n,--tokens", o.tokens, "number of new tokens (prompt + tokens <= 64)")->capture_default_str();
  // Seeds are checked as text: digits only, at most 2^64 - 1 (the parser alone would wrap "-1").
  const CLI::Validator unsigned64(
      [](std::string& text) -> std::string {
        std::uint64_t v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (text.empty() || text[0] == '-' || text[0] == '+' || ec != std::errc() || end != text.data() + text.size())
          return fmt::format("'{}' is not an integer in 0..18446744073709551615", text);
        return {};
      },
      "UINT64");
  app.add_option("-s,--seed", o.seed, "sampling seed (same seed: same tokens, eager or graph)")
      ->check(unsigned64)
      ->capture_default_str();
  app.add_option("-t,--temperature", o.temperature, "sampling temperature (> 0)")->capture_default_str();
  app.add_flag("--greedy", o.greedy, "argmax decoding instead of sampling");
  app.add_option("-m,--mode", o.mode, "eager, graph, or both (and compare)")
      ->check(CLI::IsMember({"eager", "graph", "both"}))
      ->capture_default_str();
  app.add_option("-w,--weights", o.weights,
                 "safetensors file or directory with the PyTorch names (default: the shipped " NANOGPT_DEFAULT_WEIGHTS
                 ", or a random init if it is absent)");
  app.add_flag("--random-init", o.random_init, "use deterministic random weights instead of a file");
  app.add_option("--init-seed", o.init_seed, "seed of --random-init")->check(unsigned64)->capture_default_str();
  app.add_flag("--bench", o.bench, "reproduce the seed's benchmark tables");
  app.add_option("--repeats", o.repeats, "--bench: runs per configuration and mode")->check(CLI::Range(1, 10000))
      ->capture_default_str();
  app.add_flag("--json", o.json_out, "print machine-readable JSON instead of text");
  app.add_flag("--no-pdl", o.no_pdl, "launch without programmatic dependent launch");
  app.add_option("--meta", o.meta,
                 "how the step metadata reaches the kernels: push (a copy before each step), graph-copy (graph "
                 "mode: a copy node inside the graph), device (the sampler writes the next step's metadata on the "
                 "device; the host pushes only steps it did not predict)")
      ->check(CLI::IsMember({"push", "graph-copy", "device"}))
      ->capture_default_str();
  app.add_option("--tokens-per-launch", o.tokens_per_launch,
                 "the device loop's decode steps per graph launch (a WHILE node), 1 to 64; it runs in --mode both "
                 "and, when this is given, in any mode")
      ->check(CLI::Range(1, Config::block_size))
      ->capture_default_str();
  app.add_option("--stop", o.stop, "a character that ends the generation (after it is generated)")
      ->check([](const std::string& v) { return v.size() == 1 ? std::string() : std::string("one character"); });
  app.add_option("--parity-dump", o.parity_dump, "write prefill + teacher-forced decode logits of the prompt as "
                                                 "JSON (for parity.py)");
  app.add_option("--prefill-len", o.prefill_len, "--parity-dump: prompt tokens prefilled (default half)");
  std::string dump_graph;
  app.add_option("--dump-graph", dump_graph,
                 "write the decode step's graph (kernels, grids, edges incl. PDL) to PATH: DOT if it ends in .dot, "
                 "else JSON");
  CLI11_PARSE(app, argc, argv);
  o.loop = o.mode == "both" || app.count("--tokens-per-launch") != 0;

  try {
    // ---- host-side checks, before any GPU work --------------------------------------------
    nanogpt::Weights weights;
    std::string note;
    if (app.count("--weights") != 0 && o.weights.empty())
      throw std::invalid_argument("--weights: the path is empty");
    if (o.random_init) {
      weights = nanogpt::random_weights(o.init_seed);
    } else if (!o.weights.empty()) {
      weights = nanogpt::load_weights(o.weights);
    } else if (std::filesystem::exists(NANOGPT_DEFAULT_WEIGHTS)) {
      weights = nanogpt::load_weights(NANOGPT_DEFAULT_WEIGHTS);
    } else {
      weights = nanogpt::random_weights(o.init_seed);
      note = fmt::format("note: {} not found; using a deterministic random init (the text will be noise)",
                         NANOGPT_DEFAULT_WEIGHTS);
    }
    const auto prompt = nanogpt::encode(o.prompt);
    if (!o.stop.empty()) {  // --stop must be in the vocabulary too
      try {
        (void)nanogpt::encode(o.stop);
      } catch (const std::exception&) {
        throw std::invalid_argument(fmt::format("--stop {} is not in the model's 65-character vocabulary",
                                                show_text(o.stop)));
      }
    }
    check_options(o, app, prompt.size());
    if (o.parity_dump.empty() && !o.bench) nanogpt::check_lengths(prompt.size(), o.tokens);
    if (!o.parity_dump.empty() && (prompt.empty() || prompt.size() > Config::block_size))
      nanogpt::check_lengths(prompt.size(), 1);
    if (!o.greedy && !(o.temperature > 0.0f && std::isfinite(o.temperature)))
      throw std::invalid_argument(fmt::format("temperature must be a positive number (got {}); use --greedy "
                                              "for argmax decoding",
                                              o.temperature));
    const nanogpt::Sampling sampling{o.temperature, o.seed, o.greedy};

    // ---- GPU ------------------------------------------------------------------------------
    const std::string device = nanogpt::require_device();
    const nanogpt::ModelOptions options{
        .pdl = !o.no_pdl,
        .meta = o.meta == "push"         ? nanogpt::MetaPath::push
                : o.meta == "graph-copy" ? nanogpt::MetaPath::graph_copy
                                         : nanogpt::MetaPath::device};
    Model model(weights, options);
    if (!dump_graph.empty()) {
      const replay::graph step = replay::capture(replay::stream_ref(model.stream()), [&](replay::stream_ref cs) {
        model.record_decode_step(cs.get());
      });
      replay::write_graph_summary(step, dump_graph);
      if (!o.json_out) fmt::print("decode step graph ({} nodes) written to {}\n", step.node_count(), dump_graph);
    }

    if (!o.parity_dump.empty()) return run_parity_dump(model, o, prompt);

    json out = {{"device", device},
                {"weights", weights.source},
                {"parameters", nanogpt::parameter_count()},
                {"pdl", !o.no_pdl},
                {"meta", o.meta},
                {"tokens_per_launch", o.loop ? o.tokens_per_launch : 0},
                {"kernels_per_decode_step", Model::kernels_per_decode_step},
                {"kernels_per_prefill", Model::kernels_per_prefill}};
    if (!o.json_out) {
      if (!note.empty()) fmt::print("{}\n", note);
      fmt::print("nanogpt on {}: {} ({} parameters), {} kernels per decode step, PDL {}, step metadata: {}\n",
                 device, weights.source, nanogpt::parameter_count(), Model::kernels_per_decode_step,
                 o.no_pdl ? "off" : "on", o.meta);
      if (!o.bench)
        fmt::print("prompt {} ({} tokens), {} new tokens, seed {}, {}\n\n", show_text(o.prompt), prompt.size(), o.tokens,
                   o.seed, o.greedy ? std::string("greedy") : fmt::format("temperature {}", o.temperature));
      else
        fmt::print("\n");
    }
    int rc = 0;
    if (o.bench) {
      rc = run_bench(model, o, out);
    } else {
      out["prompt"] = o.prompt;
      out["seed"] = o.seed;
      out["temperature"] = o.temperature;
      out["greedy"] = o.greedy;
      rc = run_generate(model, o, prompt, sampling, out);
    }
    out["graph_nodes"] = model.graph_nodes();
    out["graph_kernel_nodes"] = model.graph_kernel_nodes();
    if (o.json_out) fmt::print("{}\n", out.dump(2));
    if (rc == 3) fmt::print(stderr, "nanogpt: error: the decode paths produced different tokens\n");
    return rc;
  } catch (const nanogpt::no_device_error& e) {
    fmt::print(stderr, "nanogpt: error: {}. This program needs an NVIDIA GPU (built for sm_90 by default).\n",
               e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "nanogpt: error: {}\n", e.what());
    return 1;
  }
}
